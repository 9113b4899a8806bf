"""ZeRO++ in the step: hpZ (``hpz_axis=``), qwZ and qgZ (``quantize=zj.Quantize(...)``).

hpZ changes where copies live, not the math: it must equal the single-device
optax reference to rel 1e-5 (SGD and Adam, meshes (2, 4) and (4, 2) of
replica x data, uneven leaves). With quantization off the paths equal today's
step bit for bit. Quantized runs are compared with the exact step under a
stated tolerance, and the compiled programs are read for which collectives
cross the "host" boundary (the replica axis) and in which dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run, shapes_in
from _small_mlp import init_params, loss_fn
from zero_jax import hlo as hlo_lib

OPTS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
MESHES = {"2x4": (2, 4), "4x2": (4, 2)}


def batches(n=4, rows=16, fin=9, fout=5, seed=1):
  r = np.random.default_rng(seed)
  return [{"x": r.normal(size=(rows, fin)).astype(np.float32),
           "y": r.normal(size=(rows, fout)).astype(np.float32)} for _ in range(n)]


def run(step, params, bs):
  state, losses = step.init(params), []
  for b in bs:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return state, losses


def hpz_step(shape, opt, **kw):
  mesh = jax.make_mesh(shape, ("replica", "data"))
  return zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, stage=3,
                                    axis_name=("replica", "data"), hpz_axis="data", **kw)


# ------------------------------------------------------------------ hpZ exact
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("opt", OPTS)
def test_hpz_equals_single_device_reference(mesh, opt):
  params, bs = init_params(), batches()
  step = hpz_step(MESHES[mesh], OPTS[opt]())
  state, losses = run(step, params, bs)
  ref, ref_losses, _ = reference_run(loss_fn, OPTS[opt](), params, bs)
  assert_tree_close(step.get_params(state), ref[-1], what="hpZ vs reference ")
  np.testing.assert_allclose(losses, [float(x) for x in ref_losses], rtol=1e-5)


def test_hpz_keeps_optimizer_state_split_over_all_devices_and_params_within_a_host():
  step = hpz_step((2, 4), optax.adam(1e-2))
  state = step.init(init_params())
  w1 = state.params["w1"]  # (9, 7) split on dim 1, padded to 8
  mu = state.opt_state[0].mu["w1"]
  assert w1.sharding.spec == state.meta.param_layouts[3].spec("data")
  assert {s.data.shape for s in w1.addressable_shards} == {(9, 2)}  # 8 / 4 within a host
  assert {s.data.shape for s in mu.addressable_shards} == {(9, 1)}  # 8 / 8 over all


def test_hpz_with_replica_axis_too_equals_reference():
  mesh = jax.make_mesh((2, 2, 2), ("replica", "outer", "data"))
  params, bs = init_params(), batches()
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
                                    axis_name=("outer", "data"), replica_axis="replica",
                                    hpz_axis="data")
  state, losses = run(step, params, bs)
  ref, ref_losses, _ = reference_run(loss_fn, optax.sgd(0.1), params, bs)
  assert_tree_close(step.get_params(state), ref[-1])


def _gathers_stay_within_hosts(step, state, batch, mesh):
  rows = [set(int(d.id) for d in row) for row in mesh.devices]
  hlo = step.lower(state, batch).compile().as_text()
  crossing = []
  for c in hlo_lib.collectives(hlo):
    inside = all(any(set(g) <= r for r in rows) for g in c.groups)
    if not inside:
      crossing.append((c.op, c.shape_text))
  return crossing, hlo


def test_hpz_stage3_gathers_never_cross_hosts():
  """Only the gradient's second hop and the refresh of the secondary copy cross hosts."""
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  params = {"w": np.ones((64, 32), np.float32), "b": np.ones((32,), np.float32)}
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  step = zj.make_sharded_train_step(loss, optax.adam(1e-3), mesh=mesh, stage=3,
                                    axis_name=("replica", "data"), hpz_axis="data")
  state = step.init(params)
  crossing, _ = _gathers_stay_within_hosts(step, state, {"x": np.ones((16, 64), np.float32)},
                                           mesh)
  # crossing: the outer reduce-scatter and the refresh all-gather, each 1/8 of a leaf.
  elems = sum(int(np.prod(s)) for _, t in crossing for s in shapes_in(t) if s)
  assert crossing and elems <= 2 * (64 * 32 + 32) / 4 + 16, crossing


# ------------------------------------------------------------ exact when off
@pytest.mark.parametrize("stage", [2, 3])
def test_quantize_off_equals_todays_step_bit_for_bit(stage):
  mesh = jax.make_mesh((8,), ("data",))
  params, bs = init_params(), batches()
  plain = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=stage)
  off = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=stage,
                                   quantize=zj.Quantize(weights=False, grads=False))
  a, la = run(plain, params, bs)
  b, lb = run(off, params, bs)
  jax.tree.map(np.testing.assert_array_equal, plain.get_params(a), off.get_params(b))
  assert la == lb


# ------------------------------------------------------------------ errors
def test_hpz_errors_name_the_option_and_the_fix():
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  make = lambda **kw: zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, **kw)
  with pytest.raises(ValueError, match=r"hpz_axis='data'.*at stage 2.*stage=3"):
    make(stage=2, axis_name=("replica", "data"), hpz_axis="data")
  with pytest.raises(ValueError, match=r"'replica' is a replica axis"):
    make(stage=3, replica_axis="replica", hpz_axis="replica")
  with pytest.raises(ValueError, match=r"names every data axis"):
    make(stage=3, axis_name="data", replica_axis="replica", hpz_axis="data")
  with pytest.raises(ValueError, match=r"not an axis of the mesh"):
    make(stage=3, axis_name=("replica", "data"), hpz_axis="host")


def test_quantize_errors_name_the_option_and_the_fix():
  mesh = jax.make_mesh((8,), ("data",))
  make = lambda **kw: zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, **kw)
  with pytest.raises(ValueError, match=r"block_size=3.*positive even int"):
    make(quantize=zj.Quantize(block_size=3))
  with pytest.raises(ValueError, match=r"grad_bits=2.*8 or 4"):
    make(quantize=zj.Quantize(grad_bits=2))
  with pytest.raises(ValueError, match=r"stage 1 all-reduces"):
    make(stage=1, quantize=zj.Quantize(weights=False))
  with pytest.raises(ValueError, match=r"at stage 2.*master copy.*precision='bf16'"):
    make(stage=2, quantize=zj.Quantize(grads=False))
  with pytest.raises(ValueError, match=r"across_only=True.*has none"):
    make(stage=3, quantize=zj.Quantize(across_only=True))
  with pytest.raises(TypeError, match=r"zero_jax.Quantize"):
    make(quantize={"weights": True})
