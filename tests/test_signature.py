"""What the step accepts as an optimizer, and what tells two optimizers apart."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zero_jax.step.signature import as_transformation, optimizer_signature


@pytest.mark.parametrize("lr", [3e-4, np.float32(3e-4), jnp.float32(3e-4), jnp.asarray(3e-4)],
                         ids=["float", "numpy", "jax_scalar", "jax_array"])
def test_learning_rate_in_any_numeric_form_is_a_hyperparameter_not_identity(lr):
  assert optimizer_signature(optax.adamw(lr)) == optimizer_signature(optax.adamw(1e-2))


@pytest.mark.parametrize("other", [
    lambda: optax.nadamw(1e-2), lambda: optax.adamw(1e-2, nesterov=True),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    lambda: optax.lion(1e-2)])
def test_another_update_rule_or_flag_changes_the_signature(other):
  assert optimizer_signature(other()) != optimizer_signature(optax.adamw(1e-2))


def test_multi_steps_is_taken_as_its_gradient_transformation():
  tx = as_transformation(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=4))
  assert isinstance(tx, optax.GradientTransformation)
  state = tx.init({"w": jnp.ones(3)})
  assert int(state.mini_step) == 0


def test_a_class_instead_of_an_instance_is_refused_with_an_example():
  with pytest.raises(TypeError, match=r"optax.GradientTransformation \(e.g. optax.adamw\(3e-4\)\)"
                                      r" or an optax.MultiSteps; got function"):
    as_transformation(optax.adamw)
