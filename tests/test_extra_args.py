"""optax transformations that take extra arguments (``GradientTransformationExtraArgs``).

The step passes ``value=``, its loss over the global batch, as single-device code does:
``optax.contrib.reduce_on_plateau`` in a chain and ``optax.polyak_sgd`` give the parameters
and optimizer state of single-device optax; ``optax.contrib.sam``, whose update takes no
``value=``, is called without it, as on one device; an extra argument the step cannot give
(a line search's ``value_fn=``, sam's ``grad_fn=`` in opaque mode) is refused naming it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import assert_tree_close
from _small_mlp import init_params, loss_fn

STEPS = 6


def batches():
  r = np.random.default_rng(3)
  return [{"x": r.normal(size=(16, 9)).astype(np.float32),
           "y": r.normal(size=(16, 5)).astype(np.float32)} for _ in range(STEPS)]


def plateau(inner):
  # accumulation_size=1, patience=1 and rtol=0.5: the scale drops within a few steps
  return optax.chain(inner, optax.contrib.reduce_on_plateau(
      factor=0.5, patience=1, rtol=0.5, accumulation_size=1))


OPTS = {"sgd+plateau": lambda: plateau(optax.sgd(0.1)),
        "adam+plateau": lambda: plateau(optax.adam(1e-2)),
        "polyak_sgd": lambda: optax.polyak_sgd(max_learning_rate=10.0, scaling=0.5)}


def reference(opt, params, bs, value=True):
  """Single device: plain jax.jit + optax, value= the loss (unless ``value`` is False)."""
  @jax.jit
  def step(params, opt_state, b):
    loss, grads = jax.value_and_grad(loss_fn)(params, b)
    extra = {"value": loss} if value else {}
    updates, opt_state = opt.update(grads, opt_state, params, **extra)
    return optax.apply_updates(params, updates), opt_state
  params = jax.tree.map(jnp.asarray, params)
  opt_state = opt.init(params)
  for b in bs:
    params, opt_state = step(params, opt_state, b)
  return params, opt_state


@pytest.mark.parametrize("name,kw", [("sgd+plateau", {}),
                                     ("adam+plateau", {"stage": 3, "grad_accum_steps": 2}),
                                     ("polyak_sgd", {"stage": 1})])
def test_value_is_the_global_loss_and_training_equals_one_device(name, kw, mesh):
  bs = batches()
  ref_params, ref_state = reference(OPTS[name](), init_params(), bs)
  step = zj.make_sharded_train_step(loss_fn, OPTS[name](), mesh=mesh, **kw)
  state = step.init(init_params())
  for b in bs:
    state, _ = step(state, b)
  assert_tree_close(step.get_params(state), ref_params)  # polyak: its step size is from value=
  if "plateau" in name:  # best_value, avg_value, scale: from value=
    assert_tree_close(state.opt_state[1], ref_state[1])
    assert float(ref_state[1].scale) < 1  # the plateau was reached


def test_an_extra_argument_the_step_cannot_give_is_refused_naming_it(mesh):
  opt = optax.chain(optax.sgd(0.1), optax.scale_by_zoom_linesearch(max_linesearch_steps=4))
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=mesh)
  state = step.init(init_params())
  with pytest.raises(TypeError, match=r"needs grad=, value_fn=, which the step cannot give: "
                                      r"it passes only value=.*global batch.*polyak_sgd"):
    step(state, batches()[0])


def sam(opaque_mode=False):
  return optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.05), sync_period=2,
                           opaque_mode=opaque_mode)


@pytest.mark.parametrize("name,kw", [("sam", {}), ("sam-in-chain", {"stage": 3})])
def test_optimizer_that_takes_no_value_trains_like_one_device_without_it(name, kw, mesh):
  """optax.contrib.sam (transparent mode) takes only grad_fn=, optional there: the step
  calls it without value=, as single-device code does."""
  opt = lambda: sam() if name == "sam" else optax.chain(optax.clip(1.0), sam())
  bs = batches()
  ref_params, ref_state = reference(opt(), init_params(), bs, value=False)
  step = zj.make_sharded_train_step(loss_fn, opt(), mesh=mesh, **kw)
  state = step.init(init_params())
  for b in bs:
    state, _ = step(state, b)
  assert_tree_close(step.get_params(state), ref_params)


def test_sam_in_opaque_mode_is_refused_naming_grad_fn(mesh):
  step = zj.make_sharded_train_step(loss_fn, sam(opaque_mode=True), mesh=mesh)
  state = step.init(init_params())
  with pytest.raises(TypeError, match=r"needs grad_fn=, which the step cannot give.*"
                                      r"sam with its default opaque_mode=False"):
    step(state, batches()[0])
