"""``step.init`` from a function and from arrays split on the mesh (issue 26, item 1).

A function runs under ``jit`` with the state's shardings; split arrays are used where they
lie. Either way the state equals the one ``step.init`` makes from the eager values, bitwise,
and training from it equals a single-device optax (or ``nnx.Optimizer``) reference. The peak
host memory of both paths is read in a subprocess (``VmHWM``) by tests/test_safetensors.py.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zero_jax as zj
from _compile import QUICK_COMPILE, rerun_with_full_compile
from zero_jax.step import init as init_lib
from zero_jax.comm.layout import local_storage_shape
from _feature_helpers import assert_tree_close, reference_run
from _small_mlp import loss_fn as mlp_loss

def init_fn():
  """Leaves that need padding on 8 devices, some that split evenly (emb: two ways), a scalar."""
  k = jax.random.split(jax.random.key(0), 3)
  return {"w1": jax.random.normal(k[0], (9, 8)) * 0.5, "b1": jnp.zeros(8),
          "w2": jax.random.truncated_normal(k[1], -2.0, 2.0, (8, 5)) * 0.5,
          "b2": jnp.full(5, 0.1), "s": jnp.float32(1.5),
          "emb": jax.random.uniform(k[2], (16, 8), minval=-1.0)}


def loss_fn(p, batch):
  return mlp_loss(p, batch) + jnp.mean(p["emb"][batch["x"][:, 0].astype(jnp.int32) % 16] ** 2)


def batches(n=2, size=16):
  r = np.random.default_rng(0)
  return [{"x": r.normal(size=(size, 9)).astype(np.float32),
           "y": r.normal(size=(size, 5)).astype(np.float32)} for _ in range(n)]


def leaves_equal(a, b, what=""):
  """Same structure; every leaf bitwise equal, with the same sharding and memory kind."""
  assert jax.tree.structure(a) == jax.tree.structure(b), what
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
    where = what + jax.tree_util.keystr(path)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x, y = jax.random.key_data(x), jax.random.key_data(y)
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (where, x.sharding, y.sharding)
    assert x.sharding.memory_kind == y.sharding.memory_kind, where
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=where)


@pytest.fixture
def one_leaf_per_jit(monkeypatch):
  """Small models are made inside the init jit; this makes them as big ones are: one jit
  per group of leaves (here one leaf each), then the state built from their outputs."""
  monkeypatch.setattr(init_lib, "MIN_GROUP_BYTES", 0)
  monkeypatch.setattr(init_lib, "INIT_GROUPS", 10**6)


def mesh2(names):
  return jax.make_mesh((4, 2) if names[1] == "model" else (2, 4), names)


CONFIGS = {  # "grouped": made one leaf per jit (see one_leaf_per_jit)
    "stage1": dict(stage=1),
    "stage2_grouped": dict(stage=2),
    "stage3": dict(stage=3),
    "stage3_bf16_master_grouped": dict(stage=3, precision="bf16"),
    "stage2_offload": dict(stage=2, precision="bf16", offload="optimizer"),
    "stage3_hpz_grouped": dict(stage=3, mesh=("outer", "inner"), axis_name=("outer", "inner"),
                       hpz_axis="inner"),
    "stage3_param_specs": dict(stage=3, mesh=("data", "model"),
                               param_specs={"w1": P(None, "model"), "b1": P("model"),
                                            "w2": P("model"), "b2": None, "s": None,
                                            "emb": P(None, "model")}),
}


NO_SPECS = dict.fromkeys(["w1", "b1", "w2", "b2", "s", "emb"])


def make_step(mesh, tx, config):
  kw = dict(config)
  m = mesh2(kw.pop("mesh")) if "mesh" in kw else mesh
  return zj.make_sharded_train_step(loss_fn, tx, mesh=m, **kw)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_init_from_a_function_equals_the_eager_init_bitwise(mesh, name, request):
  if name.endswith("grouped"):
    request.getfixturevalue("one_leaf_per_jit")
  if QUICK_COMPILE and name == "stage2_offload":
    # The suite's quicker XLA:CPU kernels (tests/_compile.py) compute this init a few ulp
    # apart fused (from_fn) and op by op (eager): bitwise is checked as users compile.
    return rerun_with_full_compile(request)
  step = make_step(mesh, optax.adam(1e-2), CONFIGS[name])
  from_fn = step.init(init_fn)
  eager = step.init(init_fn())  # whole on one device, then placed
  leaves_equal(from_fn, eager, what=f"{name}: state")
  assert from_fn.meta == eager.meta
  if step.spec.stage == 3:  # each device holds its own block of every split leaf only
    for x, l in zip(jax.tree.leaves(from_fn.params), from_fn.meta.param_layouts):
      assert x.addressable_shards[0].data.shape == local_storage_shape(l, step.spec.n_gather)
  abstract = step.abstract_state(init_fn)  # traced, not run
  as_struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  assert jax.tree.map(as_struct, from_fn) == abstract


@pytest.mark.parametrize("stage,grouped", [(2, False), (3, False), (3, True)])
def test_a_python_number_returned_by_an_init_function_is_the_array_it_makes(
    mesh, stage, grouped, request):
  """``lambda: {**params, "scale": 2.0}`` gives the state of ``jnp.asarray(2.0)`` given
  directly, and trains alike (it failed inside the state code: a weak-typed literal)."""
  if grouped:
    request.getfixturevalue("one_leaf_per_jit")
  loss = lambda p, b: loss_fn(p, b) * p["scale"]
  step = zj.make_sharded_train_step(loss, optax.adam(1e-2), mesh=mesh, stage=stage)
  from_fn = step.init(lambda: {**init_fn(), "scale": 2.0})
  direct = step.init({**init_fn(), "scale": jnp.asarray(2.0)})
  leaves_equal(from_fn, direct, what="state")
  for b in batches():
    from_fn, _ = step(from_fn, b)
    direct, _ = step(direct, b)
  leaves_equal(step.get_params(from_fn), step.get_params(direct), what="trained")


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_training_from_a_function_matches_the_single_device_reference(mesh, opt):
  tx = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}[opt]
  step = zj.make_sharded_train_step(loss_fn, tx(), mesh=mesh, stage=3)
  state = step.init(init_fn)
  data = batches()
  losses = []
  for b in data:
    state, metrics = step(state, b)
    losses.append(metrics["loss"])
  ref_params, ref_losses, _ = reference_run(loss_fn, tx(), init_fn(), data)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  assert_tree_close(step.get_params(state), ref_params[-1])


# --------------------------------------------------------------------- NNX
class Net(nnx.Module):
  """BatchNorm statistics and Dropout's RNG state are model state; kernels need padding."""

  def __init__(self, rngs):
    self.lin1 = nnx.Linear(9, 12, rngs=rngs)
    self.bn = nnx.BatchNorm(12, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.lin2 = nnx.Linear(12, 5, rngs=rngs)

  def __call__(self, x):
    return self.lin2(self.drop(nnx.relu(self.bn(self.lin1(x)))))


def net_loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_module_from_a_function_equals_the_eager_module_and_trains_alike(mesh, stage,
                                                                          one_leaf_per_jit):
  step = zj.make_sharded_train_step(net_loss, optax.adam(1e-2), mesh=mesh, stage=stage)
  from_fn = step.init(lambda: Net(nnx.Rngs(0)))
  eager = step.init(Net(nnx.Rngs(0)))
  assert from_fn.meta == eager.meta  # the same graphdef, layouts and signature
  leaves_equal(from_fn, eager, what="state")
  assert jax.tree.leaves(from_fn.model_state)  # statistics and RNG state made, replicated
  for b in batches(1):
    from_fn, _ = step(from_fn, b)
    eager, _ = step(eager, b)
  leaves_equal(from_fn, eager, what="after a step: ")
  assert isinstance(step.get_model(from_fn), Net)


class Mlp(nnx.Module):
  def __init__(self, rngs):
    self.l1, self.l2 = nnx.Linear(9, 12, rngs=rngs), nnx.Linear(12, 5, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def test_module_from_a_function_trains_as_nnx_optimizer_does(mesh):
  step = zj.make_sharded_train_step(net_loss, optax.sgd(0.1), mesh=mesh, stage=3)
  state = step.init(lambda: Mlp(nnx.Rngs(3)))
  model = Mlp(nnx.Rngs(3))
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit
  def ref_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(net_loss)(model, batch)
    optimizer.update(model, grads)
    return loss

  for b in batches():
    state, metrics = step(state, b)
    np.testing.assert_allclose(metrics["loss"], ref_step(model, optimizer, b), rtol=1e-6)
  assert_tree_close(step.get_params(state), nnx.state(model, nnx.Param))


def test_abstract_module_given_split_arrays_is_used_where_they_lie(mesh):
  """An abstract module (nothing allocated) updated with split arrays, as loaded weights
  would be: init uses them where they lie, and refuses a variable left abstract."""
  step = zj.make_sharded_train_step(net_loss, optax.sgd(0.1), mesh=mesh, stage=3)
  model = nnx.eval_shape(lambda: Mlp(nnx.Rngs(3)))
  values = nnx.state(Mlp(nnx.Rngs(3)), nnx.Param)
  split = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(
      mesh, P(*[None] * (x.ndim - 1), "data") if x.shape[-1] % 8 == 0 else P())), values)
  nnx.update(model, split)
  leaves_equal(step.init(model), step.init(lambda: Mlp(nnx.Rngs(3))), what="state")
  net = nnx.eval_shape(lambda: Net(nnx.Rngs(0)))
  nnx.update(net, nnx.state(Net(nnx.Rngs(0)), nnx.Param))
  with pytest.raises(TypeError, match=r"init got model_state\['bn'\]\['mean'\]\S*, a jax.Shape"):
    step.init(net)  # its BatchNorm statistics and RNG state are still shapes


# ------------------------------------------------------------- split arrays
def split_arrays(m, specs):
  """init_fn's values placed on mesh ``m`` as ``specs`` say (None: replicated)."""
  return {k: jax.device_put(v, NamedSharding(m, specs.get(k) or P()))
          for k, v in init_fn().items()}


SPLITS = {  # mesh axes (None: the 8-device mesh), how the arrays arrive, which are as stored
    "data": (None, {"w1": P(None, "data"), "b1": P("data"), "w2": P("data"), "emb": P("data")},
             {"w1", "b1", "w2", "emb", "s"}),
    "other_dim": (None, {"emb": P(None, "data")}, {"s"}),  # emb is stored split along dim 0
    "data_and_model": (("data", "model"), {"w1": P(None, ("model", "data")), "b1": P("model"),
                                           "w2": P(("model", "data")), "emb": P("data")},
                       {"w1", "w2", "emb", "s"}),
}


@pytest.mark.parametrize("how", list(SPLITS))
def test_split_arrays_are_used_where_they_lie(mesh, how):
  axes, specs, as_stored = SPLITS[how]
  m = mesh2(axes) if axes else mesh
  make = lambda **kw: zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=m, stage=3, **kw)
  step = make()  # on the 2-D mesh, the model split is read from the arrays
  expected = make(param_specs={**NO_SPECS, "w1": P(None, "model"), "b1": P("model"),
                               "w2": P("model")} if axes else None).init(init_fn())
  split = split_arrays(m, specs)
  kept = jax.tree.map(np.asarray, split)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no unusable-donation warning either
    state = step.init(split)
  leaves_equal(state, expected, what=f"{how}: state")
  for k, x in split.items():  # the user's arrays: alive and unchanged
    np.testing.assert_array_equal(np.asarray(x), kept[k], err_msg=k)
  # donate=True: the leaves already stored as the state keeps them become the state's,
  # without a copy (XLA may reuse the others' memory too: donated arrays are gone)
  split = split_arrays(m, specs)
  buffers = lambda x: [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
  before = {k: buffers(x) for k, x in split.items()}
  state = step.init(split, donate=True)
  leaves_equal(state, expected, what=f"{how}, donated: state")
  assert as_stored == {k for k, x in split.items() if x.shape == state.params[k].shape and
                       x.sharding.is_equivalent_to(state.params[k].sharding, x.ndim)}
  assert as_stored <= {k for k in split if buffers(state.params[k]) == before[k]}
  assert all(split[k].is_deleted() for k in as_stored)


def test_arrays_on_another_device_are_copied_and_left_to_the_user(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3)
  params = jax.device_put(init_fn(), jax.devices()[3])  # device_put may keep device 3's shard
  leaves_equal(step.init(params), step.init(init_fn), what="state")
  assert not any(x.is_deleted() for x in jax.tree.leaves(params))


def test_memory_report_and_abstract_state_take_a_function():
  tx = optax.adamw(1e-3)
  for fn, made in [(init_fn, init_fn()),
                   (lambda: Net(nnx.Rngs(0)), nnx.eval_shape(lambda: Net(nnx.Rngs(0))))]:
    a = zj.memory_report(fn, tx, n_devices=8, precision="bf16")
    assert a.as_dict() == zj.memory_report(made, tx, n_devices=8, precision="bf16").as_dict()


def test_a_checkpoint_restores_into_the_state_of_an_init_function(mesh, tmp_path):
  """``CheckpointManager.restore(step, fn)``: the function is traced for the target, not run;
  the restored state (BatchNorm statistics and RNG state moved by a step) equals the saved one
  bitwise, and a function of other shapes is refused, naming the leaf."""
  step = zj.make_sharded_train_step(net_loss, optax.adam(1e-2), mesh=mesh, stage=3)
  fn = lambda: Net(nnx.Rngs(0))
  state, _ = step(step.init(fn), batches(1)[0])
  kept = jax.tree.map(lambda x: x.copy(), state)
  with zj.CheckpointManager(tmp_path / "net", async_save=False) as mngr:
    mngr.save(state)
    leaves_equal(mngr.restore(step, fn), kept, what="restored: ")
  pytree_step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3)
  with zj.CheckpointManager(tmp_path / "pytree", async_save=False) as mngr:
    mngr.save(pytree_step.init(init_fn))
    with pytest.raises(ValueError, match=r"params\['w1'\]: checkpoint \(9, 8\) float32, "
                                         r"this step's state \(9, 16\)"):
      mngr.restore(pytree_step, lambda: {**init_fn(), "w1": jnp.zeros((9, 16))})


# --------------------------------------------------------------- misuse
def test_init_function_misuse_is_named(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3)
  with pytest.raises(TypeError, match=r"takes arguments.*step.init\(lambda: init"):
    step.init(lambda key: init_fn())
  with pytest.raises(TypeError, match=r"returned params\['name'\] as a str"):
    step.init(lambda: {**init_fn(), "name": "mlp"})
  with pytest.raises(TypeError,
                     match=r"init got params\[.b1.\], a jax.ShapeDtypeStruct.*without values"):
    step.init(jax.eval_shape(init_fn))
  module_step = zj.make_sharded_train_step(net_loss, optax.sgd(0.1), mesh=mesh)
  with pytest.raises(TypeError, match=r"the class Net, whose constructor needs rngs.*"
                                      r"step.init\(lambda: Net\(nnx.Rngs\(0\)\)\)"):
    module_step.init(Net)  # a Module class reports (*args, **kwargs) for itself
  with pytest.raises(TypeError, match="takes no model_state="):
    module_step.init(lambda: Net(nnx.Rngs(0)), model_state={"n": jnp.zeros(())})
  tp = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh2(("data", "model")),
                                  stage=3, param_specs={**NO_SPECS, "w1": P("model")})
  with pytest.raises(ValueError, match=r"param_specs for params\['w1'\].*size 9"):
    tp.init(init_fn)  # 9 rows cannot be split over 2 devices
  for specs, message in [  # the function's leaves against the step's param_specs
      ({**NO_SPECS, "w1": P(None, None, "model")},
       r"param_specs for params\['w1'\] is .* 3 entries, but the leaf has shape \(9, 8\)"),
      ({**NO_SPECS, "emb": P(None, "model"), "w3": None},
       r"param_specs\['w3'\] is at a path that holds no parameter.*Remove the entry")]:
    tp = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh2(("data", "model")),
                                    stage=3, param_specs=specs)
    with pytest.raises(ValueError, match=message):
      tp.init(init_fn)
  big = np.ones((1024, 512), np.float32)  # 2 MiB made outside: a constant in the program
  with pytest.warns(RuntimeWarning, match=r"params\['big'\] \(2 MiB\).*did not compute"):
    step.init(lambda: {**init_fn(), "big": big})
