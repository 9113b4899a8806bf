"""Meshes as users build them: Explicit axes and ``jax.set_mesh``, several data axes,
hybrid sharding (``replica_axis``) and model-parallel axes (``param_specs``).

Each configuration runs 5 steps on 8 CPU devices against the plain single-device
``jax.jit`` + optax reference (rel 1e-5, fp32), with SGD and Adam, at stages 1-3,
on a tree whose leaves all need padding. The optimizer state per device is read
off the shards, and the compiled hybrid step's collectives off its HLO.
"""

import contextlib
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero_jax as zj
from _feature_helpers import (assert_tree_close, collective_groups, reference_run,
                              shapes_in, shard_bytes)
from _small_mlp import init_params, loss_fn
from zero_jax.comm import collectives
from zero_jax.comm.collectives import Comm
from zero_jax.step import batch as batching
from zero_jax.step import spec as spec_lib
from zero_jax.comm.layout import local_storage_shape

STEPS = 5
OPTS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def batches(n=STEPS, rows=16, fin=9, fout=5):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(rows, fin)).astype(np.float32),
           "y": r.normal(size=(rows, fout)).astype(np.float32)} for _ in range(n)]


def train(step, params, bs):
  state, losses = step.init(params), []
  for b in bs:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return state, losses


def check_against_reference(step, state, losses, loss, opt, params, bs):
  ref, ref_losses, _ = reference_run(loss, opt, params, bs)
  assert_tree_close(step.get_params(state), ref[-1], what="params ")
  np.testing.assert_allclose(losses, [float(x) for x in ref_losses], rtol=1e-5)


def opt_bytes_per_device(state, n_state):
  """Per device: (bytes held, the padded replicated state's bytes / n_state, scalars)."""
  held = shard_bytes(state.opt_state, jax.devices()[0])
  padded = sum(int(np.prod(l.storage_shape)) * x.dtype.itemsize
               for l, x in zip(state.meta.opt_layouts, jax.tree.leaves(state.opt_state)))
  scalars = sum(x.dtype.itemsize for x in jax.tree.leaves(state.opt_state) if x.ndim == 0)
  return held, (padded - scalars) / n_state + scalars


# ------------------------------------------------------------------ Explicit
@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_explicit_mesh_inside_and_outside_set_mesh_equals_single_device(stage, opt):
  mesh = jax.make_mesh((8,), ("data",))  # Explicit axes, as jax.make_mesh makes them
  assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
  params, bs = init_params(), batches()
  step = zj.make_sharded_train_step(loss_fn, OPTS[opt](), mesh=mesh, stage=stage)
  state, losses = train(step, params, bs)
  check_against_reference(step, state, losses, loss_fn, OPTS[opt](), params, bs)
  with jax.set_mesh(mesh):  # the same user code inside a mesh context
    step = zj.make_sharded_train_step(loss_fn, OPTS[opt](), mesh=mesh, stage=stage)
    state_in, losses_in = train(step, params, bs)
    got = step.get_params(state_in)
    # What the user does next in that context works: arrays live on their mesh.
    _ = float(jnp.sum(got["w1"]) + state_in.step) * 2
  assert losses_in == losses
  assert_tree_close(got, step.get_params(state), rtol=0, atol=0)


def test_batch_already_on_the_users_mesh_is_used_without_a_copy():
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, replica_axis="replica")
  b = jax.device_put(batches(1)[0], NamedSharding(mesh, P(("replica", "data"))))
  buffers = lambda x: [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
  for context in (jax.set_mesh(mesh), contextlib.nullcontext()):
    with context:
      placed = batching.place_batch(step.spec, b)
    for k in b:  # the same device buffers (outside a context: re-typed, not copied)
      assert buffers(placed[k]) == buffers(b[k]), k
  with jax.set_mesh(mesh):
    assert all(batching.place_batch(step.spec, b)[k] is b[k] for k in b)
  host = batching.place_batch(step.spec, batches(1)[0])  # host arrays are split the same way
  assert host["x"].sharding.spec[0] == ("replica", "data")


def test_loss_closing_over_an_explicit_array_gets_an_error_with_the_fix():
  mesh = jax.make_mesh((8,), ("data",))
  with jax.set_mesh(mesh):
    scale = jnp.ones((5,))  # an array typed on the Explicit mesh
    step = zj.make_sharded_train_step(lambda p, b: loss_fn(p, b) * scale.sum(), optax.sgd(0.1),
                                      mesh=mesh)
    state = step.init(init_params())
    with pytest.raises(ValueError, match=r"closes over an array.*Explicit.*trainable=False.*"
                                         r"np\.asarray"):
      step(state, batches(1)[0])


# --------------------------------------- several data axes, and hybrid (HSDP)
ROLES = {  # name: (options, devices the optimizer state is split over)
    "two_data_axes": ({"axis_name": ("replica", "data")}, 8),
    "hybrid": ({"replica_axis": "replica"}, 4),
}


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("roles", sorted(ROLES))
def test_data_and_replica_axes_equal_single_device_with_state_split_over_data(roles, stage, opt):
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  options, n_state = ROLES[roles]
  params, bs = init_params(), batches()
  step = zj.make_sharded_train_step(loss_fn, OPTS[opt](), mesh=mesh, stage=stage, **options)
  state, losses = train(step, params, bs)
  check_against_reference(step, state, losses, loss_fn, OPTS[opt](), params, bs)
  held, share = opt_bytes_per_device(state, n_state)  # 1/8 or 1/4 (plus padding)
  assert held == share


def test_hybrid_collectives_stay_in_groups_and_only_blocks_cross_replicas():
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  rows = [set(int(d.id) for d in row) for row in mesh.devices]
  params = {"w": np.ones((64, 32), np.float32), "b": np.ones((32,), np.float32)}
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  step = zj.make_sharded_train_step(loss, optax.adam(1e-3), mesh=mesh, replica_axis="replica")
  state = step.init(params)
  hlo = step.lower(state, {"x": np.ones((16, 64), np.float32)}).compile().as_text()
  colls = collective_groups(hlo)
  crossing = 0
  for op, shape, groups in colls:
    inside_a_row = all(any(set(g) <= r for r in rows) for g in groups)
    if op in ("reduce-scatter", "all-gather"):
      assert inside_a_row, (op, shape, groups)
      assert all(len(g) == 4 for g in groups), (op, groups)
    elif op == "all-reduce" and not inside_a_row:
      crossing += sum(int(np.prod(s)) for s in shapes_in(shape) if s)
  assert any(op == "reduce-scatter" for op, _, _ in colls)
  grad_elems = 64 * 32 + 32
  # Only each device's 1/4 block of the gradient crosses the replica axis (plus scalars).
  assert 0 < crossing <= grad_elems / 4 + 8, crossing


# ---------------------------------------------------------- model parallel
def megatron_params():
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.4).astype(np.float32)
  return {"w1": f(6, 16), "b1": f(16), "w2": f(16, 5), "b2": f(5)}


def megatron_loss(p, b):
  h = jax.nn.gelu(b["x"] @ p["w1"] + p["b1"])  # column-parallel: hidden split over "model"
  return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)  # row-parallel, then an all-reduce


MEGATRON_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_specs_on_data_by_model_mesh_equal_single_device(stage, opt):
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  params, bs = megatron_params(), batches(fin=6)
  step = zj.make_sharded_train_step(megatron_loss, OPTS[opt](), mesh=mesh, stage=stage,
                                    param_specs=MEGATRON_SPECS)
  state, losses = train(step, params, bs)
  check_against_reference(step, state, losses, megatron_loss, OPTS[opt](), params, bs)
  got = step.get_params(state)
  assert got["w1"].sharding.spec == P(None, "model")  # the user's split is kept
  if opt == "adam":  # each model-split moment is 1/(4 x 2) of the leaf per device
    mu = state.opt_state[0].mu
    for k in ("w1", "b1", "w2"):
      layout = dict(zip(["b1", "b2", "w1", "w2"], state.meta.param_layouts))[k]
      shard = mu[k].addressable_shards[0].data
      assert shard.shape == local_storage_shape(layout, 4)
      assert shard.size * 8 == int(np.prod(layout.storage_shape)), k


def test_param_specs_are_read_from_params_that_arrive_sharded():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  params = {k: jax.device_put(v, NamedSharding(mesh, MEGATRON_SPECS[k]))
            for k, v in megatron_params().items()}
  bs = batches(2, fin=6)
  step = zj.make_sharded_train_step(megatron_loss, optax.adam(1e-2), mesh=mesh)
  state, losses = train(step, params, bs)
  check_against_reference(step, state, losses, megatron_loss, optax.adam(1e-2),
                          megatron_params(), bs)
  assert state.params["w2"].sharding.spec == P("model", None)


# ------------------------------------------------------- bf16 beside model axes
FLAG_CASES = {  # (stage, mesh shape and axes, options): every path the flag changes
    "stage1": (1, (8,), ("data",), {}),
    "stage2_bf16_wire": (2, (8,), ("data",), {"comm_dtype": jnp.bfloat16}),
    "stage3_scan_prefetch0": (3, (8,), ("data",), {"prefetch": 0}),
    "stage3_scan_prefetch1": (3, (8,), ("data",), {"prefetch": 1}),
    "stage3_hybrid": (3, (2, 4), ("replica", "data"), {"replica_axis": "replica"}),
    "stage3_hpz": (3, (2, 4), ("hosts", "data"), {"axis_name": ("hosts", "data"),
                                                  "hpz_axis": "data"}),
    "stage3_gather_in_lax_scan": (3, (8,), ("data",), {"prefetch": None}),
}


def lax_scan_loss(p, b):
  """`gained_loss` written as the stage 3 guide's pattern: ``lax.scan`` over the layers,
  each gathered by `zj.gather` under ``jax.checkpoint`` (JAX differentiates the gathers)."""
  @jax.checkpoint
  def layer(h, lp):
    lp = zj.gather(lp)
    return jnp.tanh(h @ lp["w"] + lp["b"]) * lp["g"], None
  w_in, w_out = zj.gather(p["w_in"]), zj.gather(p["w_out"])
  h, _ = jax.lax.scan(layer, b["x"].astype(w_in.dtype) @ w_in, p["layers"])
  return jnp.mean(jnp.square((h @ w_out).astype(jnp.float32) - b["y"]))


@pytest.mark.parametrize("case", sorted(FLAG_CASES))
def test_bf16_sums_in_float32_change_no_bit_where_xla_cpu_compiles_both(case, monkeypatch):
  """On a mesh without model axes XLA:CPU compiles bfloat16 sums, so the step can run
  both ways: its own float32 sums (`Comm.bf16_sums_in_f32` forced on) and JAX's bfloat16
  ones. Every number is the same, bit for bit: gradients through stage 3's own transpose
  of the gather, a stacked leaf kept whole (its gradient summed by the step, not by
  JAX), the hops of hybrid and hpZ, stages 1 and 2."""
  import _forward_model as fm  # pylint: disable=import-outside-toplevel
  from test_master_in_params import gained_loss  # pylint: disable=import-outside-toplevel
  stage, shape, names, kw = FLAG_CASES[case]
  mesh = jax.make_mesh(shape, names)
  params = fm.init_params()
  params["layers"]["g"] = np.linspace(0.8, 1.1, 4).astype(np.float32)  # kept whole at stage 3
  prefetch = kw.pop("prefetch", 1)

  loss = lax_scan_loss if prefetch is None else functools.partial(gained_loss, prefetch=prefetch)

  def run(flag):
    monkeypatch.setattr(spec_lib, "_cpu_with_model_axes", lambda mesh, model: flag)
    step = zj.make_sharded_train_step(
        loss, optax.adam(1e-2), mesh=mesh,
        stage=stage, precision="bf16", stacked=fm.STACKED if stage == 3 else None, **kw)
    assert step.spec.comm.bf16_sums_in_f32 == flag
    state, losses = train(step, params, [fm.batch(t) for t in range(3)])
    return losses, fm.host((step.get_params(state), state.opt_state))

  ours, jaxs = run(True), run(False)
  assert ours[0] == jaxs[0]
  fm.assert_bitwise_equal(ours[1], jaxs[1])


def bf16_run(mesh, stage, opt, **kw):
  step = zj.make_sharded_train_step(megatron_loss, OPTS[opt](), mesh=mesh, stage=stage,
                                    precision="bf16", **kw)
  state, losses = train(step, megatron_params(), batches(1, fin=6) * 3)  # one batch, 3 steps
  return step, state, losses


def test_bf16_sums_beside_a_model_axis_give_xla_cpus_own_bits():
  """XLA:CPU aborts compiling a bfloat16 sum inside a ``shard_map`` that leaves axes to the
  compiler (a step on a mesh with model axes: "Invalid binary instruction opcode copy", and
  the process dies). The step's sums there (`Comm.bf16_sums_in_f32`) go in float32 and round
  back, which is what XLA:CPU does with every bfloat16 sum: bit for bit the sums a shard_map
  over every axis gives, on values spread over 2**-12 to 2**12."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  comm = Comm.over("data", bf16_sums_in_f32=True)
  r = np.random.default_rng(0)
  x = (r.normal(size=(4 * 64, 8)) * np.exp2(r.integers(-12, 12, size=(4 * 64, 8))))
  x = jnp.asarray(x, jnp.bfloat16)
  ours = lambda v: (collectives.psum_scatter(v, "data", comm, scatter_dimension=0, tiled=True),
                    collectives.psum(v, "data", comm))
  xlas = lambda v: (jax.lax.psum_scatter(v, "data", scatter_dimension=0, tiled=True),
                    jax.lax.psum(v, "data"))
  run = lambda f, **kw: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                              out_specs=(P("data"), P()), **kw))(x)
  got, want = run(ours, axis_names={"data"}), run(xlas)
  for g, w in zip(got, want):
    assert g.dtype == w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))


def bf16_run(mesh, stage, opt, **kw):
  step = zj.make_sharded_train_step(megatron_loss, OPTS[opt](), mesh=mesh, stage=stage,
                                    precision="bf16", **kw)
  state, losses = train(step, megatron_params(), batches(1, fin=6) * 3)  # one batch, 3 steps
  return step, state, losses


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_on_a_model_split_lowers_every_sum_in_float32_on_cpu(stage, opt):
  """The Megatron split in bf16 runs (it aborted the process before) and learns, and the
  program it lowers has no bfloat16 all-reduce or reduce-scatter left: the float32 ones
  carry the gradients, whose sums the test above pins bit for bit (compile-only GPU
  programs keep them in bfloat16: tests/gpu/test_targets.py)."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  step, state, losses = bf16_run(mesh, stage, opt, param_specs=MEGATRON_SPECS)
  assert step.spec.comm.bf16_sums_in_f32
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  mlir = step.lower(state, batches(1, fin=6)[0]).as_text()
  sums = re.findall(r'"stablehlo.(all_reduce|reduce_scatter)".*?\}\) : \((tensor<[^)]*>)\)',
                    mlir, flags=re.S)
  assert sums and not [t for t in sums if "bf16" in t[1]], sums
  assert any(op == ("all_reduce" if stage == 1 else "reduce_scatter") and "f32" in t
             for op, t in sums), sums


class BoxedMegatron(nn.Module):
  """The Megatron MLP written in Linen with nn.with_partitioning boxes."""

  @nn.compact
  def __call__(self, x):
    dense = lambda n, names: nn.Dense(n, kernel_init=nn.with_partitioning(
        nn.initializers.lecun_normal(), names), bias_init=nn.with_partitioning(
            nn.initializers.normal(0.1), names[-1:]))
    h = jax.nn.gelu(dense(16, (None, "model"))(x))
    return dense(5, ("model", None))(h)


def test_param_specs_are_read_from_linen_partitioned_boxes():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  model = BoxedMegatron()
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]
  loss = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
  bs = batches(2, fin=6)
  step = zj.make_sharded_train_step(loss, optax.adam(1e-2), mesh=mesh)  # no param_specs=
  state, losses = train(step, params, bs)
  check_against_reference(step, state, losses, loss, optax.adam(1e-2), params, bs)
  kernel = state.opt_state[0].mu["Dense_0"]["kernel"].value  # (6, 16), split 16 = 2 x 8
  assert kernel.addressable_shards[0].data.size * 8 == kernel.size
  w2 = step.get_params(state)["Dense_1"]["kernel"].value
  assert w2.sharding.is_equivalent_to(NamedSharding(mesh, P("model", None)), 2)


# --------------------------------------------------------------------- errors
def test_error_mesh_axis_with_no_role_names_it_and_the_three_roles():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh)
  with pytest.raises(ValueError, match=r"mesh axis 'model' \(size 2\) has no role.*"
                                       r"axis_name=.*replica_axis=.*param_specs="):
    step.init(init_params())


def test_error_replica_axis_overlapping_axis_name():
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  with pytest.raises(ValueError, match=r"replica_axis=.*axis_name=.*both name \['data'\]"):
    zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh,
                               axis_name=("replica", "data"), replica_axis="data")


def test_error_param_specs_naming_the_data_axis():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  step = zj.make_sharded_train_step(megatron_loss, optax.sgd(0.1), mesh=mesh,
                                    param_specs={**MEGATRON_SPECS, "w1": P("data", "model")})
  with pytest.raises(ValueError, match=r"params\['w1'\].*names 'data'.*model axes"):
    step.init(megatron_params())


# ------------------------------------------------------- checkpoints, memory
MESHES = {  # name: (mesh shape, axis names, step options)
    "flat8": ((8,), ("data",), {}),
    "hybrid2x4": ((2, 4), ("replica", "data"), {"replica_axis": "replica"}),
    "data4_model2": ((4, 2), ("data", "model"), {"param_specs": MEGATRON_SPECS}),
}


def megatron_step(name, stage=2):
  shape, axes, kw = MESHES[name]
  return zj.make_sharded_train_step(megatron_loss, optax.adam(1e-2),
                                    mesh=jax.make_mesh(shape, axes), stage=stage, **kw)


@pytest.mark.parametrize("saved,restored", [("flat8", "hybrid2x4"), ("flat8", "data4_model2"),
                                            ("data4_model2", "flat8"), ("hybrid2x4", "flat8")])
def test_checkpoint_restores_across_mesh_shapes_and_continues_like_an_unbroken_run(
    saved, restored, tmp_path):
  bs = batches(4, fin=6)
  step_a = megatron_step(saved)
  state = step_a.init(megatron_params())
  for b in bs[:2]:
    state, _ = step_a(state, b)
  with zj.CheckpointManager(tmp_path) as mngr:
    mngr.save(state)
  step_b = megatron_step(restored, stage=3 if restored == "hybrid2x4" else 2)
  with zj.CheckpointManager(tmp_path) as mngr:
    state_b = mngr.restore(step_b, megatron_params())
  for b in bs[2:]:
    state_b, _ = step_b(state_b, b)
  ref, _, _ = reference_run(megatron_loss, optax.adam(1e-2), megatron_params(), bs)
  assert_tree_close(step_b.get_params(state_b), ref[-1], what=f"{saved} -> {restored} ")


@pytest.mark.parametrize("name", ["hybrid2x4", "data4_model2"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_report_on_hybrid_and_model_meshes_equals_the_real_shards(name, stage):
  shape, axes, kw = MESHES[name]
  step = megatron_step(name, stage)
  state = step.init(megatron_params())
  report = zj.memory_report(megatron_params(), optax.adam(1e-2), mesh=step.mesh,
                            axis_name="data", stages=(stage,), **kw)[stage]
  dev = jax.devices()[0]
  assert report.optimizer_state == shard_bytes(state.opt_state, dev)
  assert report.params == shard_bytes(state.params, dev)
  # Planning for a size this machine does not have: an abstract mesh.
  big = jax.sharding.AbstractMesh((16, 8) if name == "hybrid2x4" else (64, 8), axes)
  planned = zj.memory_report(megatron_params(), optax.adam(1e-2), mesh=big, axis_name="data",
                             stages=(stage,), **kw)[stage]
  assert planned.optimizer_state < report.optimizer_state
