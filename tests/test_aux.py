"""Auxiliary outputs (``has_aux=True``) equal ``loss_fn``'s aux on the whole global batch
on one device, per rule (``aux_reduce=``), with gradient accumulation, at every stage and on
a replica x data mesh; leaves that cannot be combined are refused, naming them."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run
from _small_mlp import init_params

RULES = {"logits": "concat", "count": "sum", "acc": "mean", "top": "max", "low": "min",
         "any": "max", "all": "min", "hist": "sum"}


def loss_aux(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  out = (h @ p["w2"] + p["b2"]) * p["s"]
  correct = jnp.argmax(out, -1) == jnp.argmax(b["y"], -1)
  aux = {"logits": out, "count": correct.sum(), "acc": correct.mean(), "top": jnp.max(h),
         "low": jnp.min(out, axis=0), "any": jnp.any(h > 0.9), "all": jnp.all(h > -0.999),
         "hist": jnp.zeros(5, jnp.int32).at[jnp.argmax(out, -1)].add(1)}
  return jnp.mean((out - b["y"]) ** 2), aux


def batches(n=2, rows=16):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(rows, 9)).astype(np.float32),
           "y": r.normal(size=(rows, 5)).astype(np.float32)} for _ in range(n)]


MESHES = {"flat8": ((8,), ("data",), {}),
          "replica2_data4": ((2, 4), ("replica", "data"), {"replica_axis": "replica"})}
OPTS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def check(mesh_name, opt="sgd", loss=loss_aux, aux_reduce=RULES, **kw):
  shape, names, extra = MESHES[mesh_name]
  mesh = jax.make_mesh(shape, names)
  step = zj.make_sharded_train_step(loss, OPTS[opt](), mesh=mesh, has_aux=True,
                                    aux_reduce=aux_reduce, **extra, **kw)
  state, bs = step.init(init_params()), batches()
  ref_params, ref_losses, ref_aux = reference_run(loss, OPTS[opt](), init_params(), bs,
                                                  has_aux=True)
  for b, want_loss, want in zip(bs, ref_losses, ref_aux):
    state, m = step(state, b)
    np.testing.assert_allclose(float(m["loss"]), want_loss, rtol=1e-5)
    assert_tree_close(m["aux"], want, rtol=1e-5, atol=1e-6)  # dtypes too
  assert_tree_close(step.get_params(state), ref_params[-1])
  return m["aux"], mesh


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_every_rule_equals_one_device_on_the_global_batch(mesh_name, stage, k):
  aux, mesh = check(mesh_name, stage=stage, grad_accum_steps=k)
  batch_axes = mesh.axis_names  # per-example leaves come back split over the batch axes
  assert aux["logits"].sharding.spec == jax.sharding.PartitionSpec(
      batch_axes if len(batch_axes) > 1 else batch_axes[0])
  assert aux["count"].dtype == jnp.int32 and aux["any"].dtype == jnp.bool_


@pytest.mark.parametrize("opt", sorted(OPTS))
def test_defaults_concat_per_example_mean_floats_sum_ints(opt):
  def loss(p, b):
    value, aux = loss_aux(p, b)
    return value, {k: aux[k] for k in ("logits", "count", "acc", "hist")}
  check("replica2_data4", opt, loss=loss, aux_reduce=None, grad_accum_steps=2)


def test_rules_as_one_string_and_as_a_function_of_path_and_leaf():
  def loss(p, b):
    value, aux = loss_aux(p, b)
    return value, {"a": aux["count"], "b": aux["hist"]}
  check("flat8", loss=loss, aux_reduce="sum")
  by_name = lambda path, leaf: RULES[path[0].key]
  check("flat8", loss=loss_aux, aux_reduce=by_name, grad_accum_steps=2)


# --------------------------------------------------------------------- errors
def step_with(aux, mesh, **kw):
  loss = lambda p, b: (jnp.mean(b["x"] @ p["w1"]), aux(b))
  return zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh, has_aux=True, **kw)


@pytest.mark.parametrize("aux,kw,err,needle", [
    (lambda b: {"name": "run-1"}, {}, TypeError, r"aux\['name'\] as a str.*not an array"),
    (lambda b: {"n": 3}, {}, TypeError, r"aux\['n'\] as a int.*jnp.asarray"),
    (lambda b: {"k": jax.random.key(0)}, {}, TypeError, r"aux\['k'\] as a PRNG key"),
    (lambda b: {"f": jnp.any(b["x"] > 0)}, {}, TypeError,
     r"aux\['f'\] is a bool.*'max'.*'min'.*aux_reduce="),
    (lambda b: {"m": b["x"].mean()}, {"aux_reduce": {"m": "concat"}}, ValueError,
     r"aux\['m'\].*'concat'.*leading per-example dimension of 2"),
    (lambda b: {"m": b["x"].mean()}, {"aux_reduce": lambda path, leaf: "avg"}, ValueError,
     r"aux_reduce\(path, leaf\) for aux\['m'\] returned='avg' is not a rule"),
    (lambda b: {"m": b["x"].mean()}, {"aux_reduce": {"z": "sum"}}, ValueError,
     r"aux_reduce= is not a pytree prefix of the aux"),
])
def test_aux_that_cannot_be_combined_is_refused_naming_the_leaf(aux, kw, err, needle, mesh):
  step = step_with(aux, mesh, **kw)
  with pytest.raises(err, match=needle):
    step(step.init(init_params()), batches(1)[0])


def test_aux_reduce_is_validated_when_the_step_is_built(mesh):
  with pytest.raises(ValueError, match=r"aux_reduce\['acc'\]='avg' is not a rule.*'mean'"):
    step_with(lambda b: {}, mesh, aux_reduce={"acc": "avg"})
  with pytest.raises(ValueError, match=r"aux_reduce= .*has_aux=False"):
    zj.make_sharded_train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh=mesh, aux_reduce="sum")


@pytest.mark.parametrize("kind", ["auto", "explicit_in_set_mesh"])
def test_per_example_aux_on_auto_meshes_and_inside_set_mesh(kind):
  types = (jax.sharding.AxisType.Auto,) if kind == "auto" else None
  mesh = jax.make_mesh((8,), ("data",), **({"axis_types": types} if types else {}))
  step = zj.make_sharded_train_step(loss_aux, optax.sgd(0.1), mesh=mesh, has_aux=True,
                                    aux_reduce=RULES, grad_accum_steps=2)
  state, b = step.init(init_params()), batches(1)[0]
  with jax.set_mesh(mesh):
    state, m = step(state, b)
  assert_tree_close(m["aux"], loss_aux(init_params(), b)[1], rtol=1e-5, atol=1e-6)
  assert m["aux"]["logits"].sharding.spec[0] == "data"


def test_a_loss_without_aux_under_has_aux_is_named_by_what_it_returned(mesh):
  """has_aux=True with a loss returning one array: the message says what it returned as the
  user wrote it (shape and dtype), not the tracer JAX wraps it in."""
  step = zj.make_sharded_train_step(lambda p, b: jnp.mean((b @ p) ** 2), optax.sgd(0.1),
                                    mesh=mesh, has_aux=True)
  state = step.init(jnp.ones((3, 2)))
  with pytest.raises(TypeError, match=r"loss_fn must return \(loss, aux\) \(has_aux=True, "
                                      r"model state not given to init\); it returned one "
                                      r"array of shape \(\) float32\."):
    step(state, np.ones((8, 3), np.float32))
