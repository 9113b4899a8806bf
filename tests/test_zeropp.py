"""ZeRO++ in the step: hpZ (``hpz_axis=``), qwZ and qgZ (``quantize=zj.Quantize(...)``).

hpZ changes where copies live, not the math: it must equal the single-device
optax reference to rel 1e-5 (SGD and Adam, meshes (2, 4) and (4, 2) of
replica x data, uneven leaves). With quantization off the paths equal today's
step bit for bit. Quantized runs are compared with the exact step under a
stated tolerance, and the compiled programs are read for which collectives
cross the "host" boundary (the replica axis) and in which dtype.
"""

import contextlib
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run, shapes_in
from _small_mlp import init_params, loss_fn
from test_meshes import batches, train as run
from zero_jax.comm import hlo as hlo_lib
from zero_jax.comm.collectives import DEFAULT_BUCKET_BYTES

OPTS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
MESHES = {"2x4": (2, 4), "4x2": (4, 2)}


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
  for empty in ((), []):   # a whole copy of the parameters on every device
    with pytest.raises(ValueError, match=r"names no axis.*hpz_axis='data'"):
      make(stage=3, axis_name=("replica", "data"), hpz_axis=empty)


def test_quantize_errors_name_the_option_and_the_fix():
  mesh = jax.make_mesh((8,), ("data",))
  make = lambda **kw: zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, **kw)
  with pytest.raises(ValueError, match=r"block_size=3.*positive even int"):
    make(quantize=zj.Quantize(block_size=3))
  for big in (2**31, 2**16 + 2):   # was accepted, and 2**31 died in XLA with out-of-memory
    with pytest.raises(ValueError, match=rf"block_size={big}\): at most 65536.*256 to 4096"):
      make(quantize=zj.Quantize(block_size=big))
  make(quantize=zj.Quantize(block_size=2**16, weights=False))   # the bound itself is fine
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
  one = jax.make_mesh((1, 8), ("data", "model"))
  with pytest.raises(ValueError, match=r"one device: nothing is sent"):
    zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=one, quantize=zj.Quantize())


def test_hpz_with_stacked_layers_equals_single_device_reference():
  import test_stacked as ts
  bs = ts.make_batches(3)
  step = zj.make_sharded_train_step(ts.loss_fn, optax.sgd(0.1), mesh=_mesh((2, 4)), stage=3,
                                    axis_name=("replica", "data"), hpz_axis="data",
                                    stacked=ts.STACKED)
  state, losses = run(step, ts.make_params(), bs)
  ref, ref_losses, _ = reference_run(ts.loss_fn, optax.sgd(0.1), ts.make_params(), bs)
  assert_tree_close(step.get_params(state), ref[-1])
  np.testing.assert_allclose(losses, [float(x) for x in ref_losses], rtol=1e-5)


def test_memory_report_counts_the_secondary_copy_like_the_real_shards():
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  params = init_params()
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=3,
                                    axis_name=("replica", "data"), hpz_axis="data")
  state = step.init(params)
  rep = zj.memory_report(params, optax.adam(1e-2), mesh=mesh, axis_name=("replica", "data"),
                         hpz_axis="data")[3]
  dev = jax.devices()[0]
  held = lambda tree: sum(s.data.nbytes for x in jax.tree.leaves(tree)
                          for s in x.addressable_shards if s.device == dev)
  assert rep.params == held(state.params)        # 1/4: the secondary copy
  assert rep.optimizer_state == held(state.opt_state)  # 1/8
  flat = zj.memory_report(params, optax.adam(1e-2), mesh=mesh,
                          axis_name=("replica", "data"))[3]
  assert rep.params > flat.params and rep.optimizer_state == flat.optimizer_state


# ------------------------------------------------------------ quantized steps
Q = zj.Quantize(block_size=64)
QUANT_CASES = {  # name: (mesh shape, step options)
    "s2_qgZ_fp32": ((8,), dict(stage=2, quantize=zj.Quantize(weights=False, block_size=64))),
    "s2_both_bf16": ((8,), dict(stage=2, precision="bf16", quantize=Q)),
    "s3_both_fp32": ((8,), dict(stage=3, quantize=Q)),
    "s3_hybrid_both": ((2, 4), dict(stage=3, axis_name="data", replica_axis="replica",
                                    quantize=Q)),
    "s3_hpz_both_bf16": ((2, 4), dict(stage=3, axis_name=("replica", "data"), hpz_axis="data",
                                      precision="bf16", quantize=Q)),
    "s3_hpz_across_only": ((2, 4), dict(stage=3, axis_name=("replica", "data"),
                                        hpz_axis="data", precision="bf16",
                                        quantize=zj.Quantize(block_size=64, across_only=True))),
}


def _mesh(shape):
  return jax.make_mesh(shape, ("data",) if len(shape) == 1 else ("replica", "data"))


def _exact_options(kw):
  return {k: v for k, v in kw.items() if k not in ("quantize",)}


def _sgd_grads(step, params, batch, lr=0.1):
  """The gradient a step applied, read back from one SGD step: (p0 - p1) / lr."""
  state = step.init(params)
  state, m = step(state, batch)
  new = step.get_params(state)
  return {k: (np.asarray(params[k], np.float64) - np.asarray(new[k], np.float64)) / lr
          for k in params}, m


@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_gradient_is_within_the_stated_bound_of_the_exact_one(case):
  """SGD: the applied gradient of a quantized step vs the exact step's, per leaf.

  Bound (docs, ZeRO++ guide): int8 with blocks of B rounds each value by at most
  absmax(block) / 254, so a hop's relative error per block is at most
  sqrt(B) / 254 (6.3e-2 at B=64 in the worst case, ~4e-3 for Gaussian values); two
  hops at most add. Asserted: 2e-2 per leaf for qgZ alone; with qwZ the forward pass
  also sees weights rounded by up to absmax/254, which moves this small model's
  gradient by up to ~3%: 5e-2.
  """
  shape, kw = QUANT_CASES[case]
  params, b = init_params(), batches(1)[0]
  exact = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=_mesh(shape),
                                     **_exact_options(kw))
  quant = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=_mesh(shape), **kw)
  g_exact, m_exact = _sgd_grads(exact, params, b)
  g_quant, m_quant = _sgd_grads(quant, params, b)
  for k in params:
    err = np.linalg.norm(g_quant[k] - g_exact[k]) / max(np.linalg.norm(g_exact[k]), 1e-12)
    assert err < (5e-2 if kw["quantize"].weights else 2e-2), (k, err)
  assert bool(m_quant["grads_finite"])
  np.testing.assert_allclose(float(m_quant["grad_norm"]), float(m_exact["grad_norm"]),
                             rtol=5e-2 if kw["quantize"].weights else 2e-2)


@pytest.mark.parametrize("case", ["s2_both_bf16", "s3_both_fp32", "s3_hpz_both_bf16"])
def test_quantized_weights_never_feed_back_into_the_exact_copy(case):
  """With a zero learning rate, many qwZ steps leave the parameters bit for bit: only the
  copies the forward pass sees are rounded, never the master or the stage-3 blocks."""
  shape, kw = QUANT_CASES[case]
  params = init_params()
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.0), mesh=_mesh(shape), **kw)
  state = step.init(params)
  start = jax.tree.map(np.asarray, step.get_params(state))
  for b in batches(6):
    state, m = step(state, b)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, step.get_params(state)),
               start)


@pytest.mark.parametrize("case", ["s3_both_fp32", "s3_hpz_both_bf16"])
def test_quantized_adam_training_tracks_the_exact_run(case):
  shape, kw = QUANT_CASES[case]
  params, bs = init_params(), batches(8)
  exact = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=_mesh(shape),
                                     **_exact_options(kw))
  quant = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=_mesh(shape), **kw)
  _, le = run(exact, params, bs)
  _, lq = run(quant, params, bs)
  np.testing.assert_allclose(lq, le, rtol=1e-2)


def test_quantized_collectives_are_int8_in_the_compiled_program():
  mesh = _mesh((2, 4))
  params = {"w": np.ones((64, 32), np.float32), "b": np.ones((32,), np.float32)}
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  step = zj.make_sharded_train_step(loss, optax.adam(1e-3), mesh=mesh, stage=3,
                                    axis_name=("replica", "data"), hpz_axis="data",
                                    precision="bf16", quantize=zj.Quantize())
  state = step.init(params)
  colls = hlo_lib.collectives(step.lower(state, {"x": np.ones((16, 64), np.float32)})
                              .compile().as_text())
  int8 = {c.op for c in colls if "s8[" in c.shape_text or "u8[" in c.shape_text}
  assert {"all-gather", "all-to-all"} <= int8, [(c.op, c.shape_text) for c in colls]


POISON_CASES = {  # name: (mesh shape, step options, the poisoned gradient value)
    "s2_qgZ_fp32_nan": ((8,), dict(stage=2, quantize=zj.Quantize(weights=False, block_size=64)),
                        np.nan),
    "s3_hpz_both_bf16_nan": ((2, 4), dict(stage=3, axis_name=("replica", "data"),
                                          hpz_axis="data", precision="bf16",
                                          quantize=zj.Quantize(block_size=64)), np.nan),
    "s3_hybrid_int4_inf": ((2, 4), dict(stage=3, axis_name="data", replica_axis="replica",
                                        quantize=zj.Quantize(block_size=64, grad_bits=4)),
                           -np.inf),
    "s3_hpz_fp16_inf": ((2, 4), dict(stage=3, axis_name=("replica", "data"), hpz_axis="data",
                                     precision="fp16", quantize=zj.Quantize(block_size=64)),
                        np.inf),
}


def poisoned_loss(p, b):
  """The small MLP plus a (512, 64) leaf (64 to 128 blocks of 64 per device: XLA:CPU's max
  drops a NaN in a reduction of 64 blocks or more) whose gradient gets ``b["pv"][i]`` at
  flat index ``b["pi"][i]`` from example ``i`` (0 for the clean ones)."""
  return loss_fn(p, b) + 1e-3 * jnp.sum(jnp.square(p["w3"])) + jnp.sum(
      b["pv"] * p["w3"].reshape(-1)[b["pi"]].astype(jnp.float32))


def poisoned(value):
  params = {**init_params(), "w3": np.random.default_rng(5).normal(size=(512, 64))
            .astype(np.float32)}
  b = batches(1)[0]
  b["pv"], b["pi"] = np.zeros(16, np.float32), np.full(16, 333 * 64 + 17, np.int32)
  b["pv"][10] = value   # example 10 sits on device 5: the second "host"
  return params, b


@pytest.mark.parametrize("case", POISON_CASES)
def test_a_nonfinite_gradient_skips_the_quantized_step_bit_for_bit(case):
  """A NaN or inf in one element of one device's gradient (the middle of a later block of
  its leaf, in a bucket with the other leaves) is seen by the finite check: the step is
  skipped, params, master and optimizer state unchanged bit for bit; with fp16 the loss
  scale backs off exactly as in the exact step."""
  shape, kw, value = POISON_CASES[case]
  params, b = poisoned(value)
  step = zj.make_sharded_train_step(poisoned_loss, optax.adam(1e-2), mesh=_mesh(shape), **kw)
  state = step.init(params)
  read = lambda s: jax.tree.map(np.asarray, (s.params, s.master, s.opt_state))
  before = read(state)
  # No loss scale to back off: a skipped step is news, said once the step's metrics are read
  # (at the call when the step is already done, else at the next call into zero_jax).
  said = (pytest.warns(RuntimeWarning, match="step 0 was skipped")
          if kw.get("precision") != "fp16" else contextlib.nullcontext())
  with said:
    state, m = step(state, b)
    step.get_params(state)
  assert not bool(m["grads_finite"]) and not np.isfinite(float(m["grad_norm"]))
  jax.tree.map(np.testing.assert_array_equal, read(state), before)
  assert int(state.loss_scale.skipped_steps) == 1
  if kw.get("precision") == "fp16":
    exact = zj.make_sharded_train_step(poisoned_loss, optax.adam(1e-2), mesh=_mesh(shape),
                                       **_exact_options(kw))
    e_state, e_m = exact(exact.init(params), b)
    assert not bool(e_m["grads_finite"])
    assert float(state.loss_scale.scale) == float(e_state.loss_scale.scale) \
        == float(m["loss_scale"]) / 2


def test_a_nan_weight_the_batch_never_reads_skips_qwz_steps_and_the_warning_names_its_leaf():
  """A NaN in an embedding row no example reads: the exact step trains (as on one device),
  the qwZ step's gather spreads it over its block, which rows the batch reads share, so
  every step is skipped; the skip warning names the leaf and the block size."""
  r = np.random.default_rng(0)
  params = {"emb": r.normal(size=(64, 16)).astype(np.float32),
            "w": r.normal(size=(16, 4)).astype(np.float32)}
  params["emb"][63, 5] = np.nan  # the last device's last block: rows 60-63 at B = 64
  loss = lambda p, b: jnp.mean((p["emb"][b] @ p["w"]) ** 2)
  b = np.tile(np.array([0, 1, 2, 3, 4, 5, 6, 62]), 2)  # row 62 shares row 63's block
  mesh = _mesh((8,))
  exact = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh, stage=3)
  state, m = exact(exact.init(params), b)
  assert int(m["skipped_steps"]) == 0 and np.isfinite(float(m["loss"]))
  ref, _, _ = reference_run(loss, optax.sgd(0.1), params, [b])
  np.testing.assert_allclose(np.asarray(exact.get_params(state)["w"]), ref[-1]["w"], rtol=1e-5)
  quant = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh, stage=3,
                                     quantize=zj.Quantize(block_size=64))
  with pytest.warns(RuntimeWarning, match=r"step 0 was skipped.*non-finite weights: "
                                          r"params\['emb'\] \(1 of 1024 values\).*whole block of "
                                          r"64 values.*never reads the bad value"):
    state, m = quant(quant.init(params), b)
    state, m = quant(state, b)
    quant.get_params(state)
  assert int(m["skipped_steps"]) == 2


def test_quantized_step_with_accumulation_clipping_and_weighted_loss():
  def wloss(p, b):
    per = jnp.mean(jnp.square(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
                              - b["y"]), axis=-1) * p["s"]
    return zj.WeightedLoss(jnp.sum(per * b["m"]), jnp.sum(b["m"]))
  params, bs = init_params(), batches(3)
  for b in bs:
    b["m"] = (np.arange(16) % 3 != 0).astype(np.float32)
  kw = dict(stage=2, grad_accum_steps=2, max_grad_norm=0.5)
  exact = zj.make_sharded_train_step(wloss, optax.sgd(0.1), mesh=_mesh((8,)), **kw)
  quant = zj.make_sharded_train_step(wloss, optax.sgd(0.1), mesh=_mesh((8,)),
                                     quantize=zj.Quantize(weights=False, block_size=64), **kw)
  se, le = run(exact, params, bs)
  sq, lq = run(quant, params, bs)
  np.testing.assert_allclose(lq, le, rtol=1e-3)
  for k, v in exact.get_params(se).items():
    np.testing.assert_allclose(np.asarray(quant.get_params(sq)[k]), np.asarray(v),
                               rtol=2e-2, atol=2e-3, err_msg=k)


def test_stage3_gather_once_local_accumulation_quantizes_the_gradient_once(full_compile):
  """accumulate="local" with gather_once sums the micro-batches' gradients in float32 and
  reduce-scatters them once (it reduce-scattered, and so quantized, each micro-batch): the
  qgZ gradient is stage 2's local one, not its sharded one, and within the bound of the
  exact step, which equals the single-device reference."""
  params, b = init_params(), batches(1)[0]
  q = zj.Quantize(weights=False, block_size=64)
  make = lambda **kw: zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=_mesh((8,)),
                                                 grad_accum_steps=2, **kw)
  once = dict(stage=3, gather_once=True, accumulate="local")
  g_once, _ = _sgd_grads(make(quantize=q, **once), params, b)
  g_local, _ = _sgd_grads(make(quantize=q, stage=2, accumulate="local"), params, b)
  g_sharded, _ = _sgd_grads(make(quantize=q, stage=2, accumulate="sharded"), params, b)
  g_exact, _ = _sgd_grads(make(**once), params, b)
  ref, _, _ = reference_run(loss_fn, optax.sgd(0.1), params, [b])
  rel = lambda a, e: np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-12)
  for k in params:
    np.testing.assert_allclose(g_once[k], g_local[k], rtol=1e-6, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(params[k] - 0.1 * g_exact[k], ref[-1][k], rtol=1e-5, atol=1e-6)
    assert rel(g_once[k], g_exact[k]) < 2e-2, k
  assert max(rel(g_sharded[k], g_local[k]) for k in params) > 1e-4  # another rounding


def test_checkpoint_restores_with_or_without_quantization(tmp_path):
  """They change the wire, not the state."""
  params, bs = init_params(), batches(2)
  mesh = _mesh((2, 4))
  kw = dict(stage=3, axis_name=("replica", "data"), precision="bf16")
  quant = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, hpz_axis="data",
                                     quantize=Q, **kw)
  plain = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, **kw)
  state, _ = run(quant, params, bs)
  with zj.CheckpointManager(tmp_path / "q", async_save=False) as mngr:
    mngr.save(state, force=True)
    back = mngr.restore(plain, params)
  jax.tree.map(np.testing.assert_array_equal, plain.get_params(back), quant.get_params(state))
  with zj.CheckpointManager(tmp_path / "p", async_save=False) as mngr:
    mngr.save(back, force=True)
    again = mngr.restore(quant, params)
  jax.tree.map(np.testing.assert_array_equal, quant.get_params(again), quant.get_params(state))


# ------------------------------------------------- combined with other features
def test_quantized_stacked_layers_track_the_exact_step():
  """zj.gather in a scanned loss: stage 3 gathers one layer at a time in int8."""
  import test_stacked as ts
  bs = ts.make_batches(4)
  for stage, precision in ((3, "fp32"), (2, "bf16")):
    kw = dict(stage=stage, precision=precision, stacked=ts.STACKED)
    mesh = _mesh((8,))
    exact = zj.make_sharded_train_step(ts.loss_fn, optax.adam(1e-2), mesh=mesh, **kw)
    quant = zj.make_sharded_train_step(ts.loss_fn, optax.adam(1e-2), mesh=mesh, quantize=Q, **kw)
    _, le = run(exact, ts.make_params(), bs)
    _, lq = run(quant, ts.make_params(), bs)
    np.testing.assert_allclose(lq, le, rtol=1e-2, err_msg=f"stage {stage}")


def test_quantized_step_with_offload_equals_it_without():
  shape, kw = QUANT_CASES["s3_hpz_both_bf16"]
  params, bs = init_params(), batches(3)
  a = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=_mesh(shape), **kw)
  b = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=_mesh(shape),
                                 offload="optimizer", **kw)
  sa, la = run(a, params, bs)
  sb, lb = run(b, params, bs)
  np.testing.assert_allclose(lb, la, rtol=1e-6)
  assert_tree_close(b.get_params(sb), a.get_params(sa), rtol=1e-6)


def test_quantized_gradients_with_tensor_parallel_param_specs():
  from jax.sharding import PartitionSpec as P
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  params = {k: v for k, v in init_params().items()}
  params["w1"] = np.random.default_rng(3).normal(size=(9, 8)).astype(np.float32) * 0.5
  params["b1"] = np.zeros(8, np.float32)
  params["w2"] = np.random.default_rng(4).normal(size=(8, 5)).astype(np.float32) * 0.5
  specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P(),
           "s": P()}
  bs = batches(3)
  kw = dict(stage=2, param_specs=specs)
  exact = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, **kw)
  quant = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh,
                                     quantize=zj.Quantize(weights=False, block_size=64), **kw)
  _, le = run(exact, params, bs)
  _, lq = run(quant, params, bs)
  np.testing.assert_allclose(lq, le, rtol=1e-3)


def test_flax_mnist_cnn_trains_with_zeropp_within_tolerance_of_the_exact_step():
  """The CNN of Flax's MNIST example (Linen) on two "hosts": int8 weights and gradients
  against the exact step (stage 3, hybrid, fp32).

  Stated tolerances: the applied gradient of one SGD step within 2% (qgZ alone; measured
  1.2%) and 8% (qwZ + qgZ; measured 5.1%: rounded weights flip which ReLUs are active) of
  the exact one, all leaves together; 5 momentum steps' losses within 1%.
  """
  import flax.linen as nn

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(32, (3, 3))(x))
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
      x = nn.relu(nn.Conv(64, (3, 3))(x))
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
      x = nn.relu(nn.Dense(256)(x.reshape((x.shape[0], -1))))
      return nn.Dense(10)(x)

  model = CNN()
  r = np.random.default_rng(0)
  data = [{"x": r.normal(size=(16, 28, 28, 1)).astype(np.float32),
           "y": r.integers(0, 10, size=(16,))} for _ in range(5)]
  params = model.init(jax.random.key(0), data[0]["x"][:1])["params"]

  def loss(p, b):
    logits = model.apply({"params": p}, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                   for x in jax.tree.leaves(t)])
  make = lambda opt, q: zj.make_sharded_train_step(
      loss, opt, mesh=_mesh((2, 4)), stage=3, axis_name="data", replica_axis="replica",
      quantize=q)

  def applied(q):
    step = make(optax.sgd(1.0), q)
    state, _ = step(step.init(params), data[0])
    return flat(params) - flat(step.get_params(state))

  exact = applied(None)
  for q, tol in ((zj.Quantize(weights=False), 2e-2), (zj.Quantize(), 8e-2)):
    err = np.linalg.norm(applied(q) - exact) / np.linalg.norm(exact)
    assert err < tol, (q, err)
  _, le = run(make(optax.sgd(0.05, momentum=0.9), None), params, data)
  _, lq = run(make(optax.sgd(0.05, momentum=0.9), zj.Quantize()), params, data)
  np.testing.assert_allclose(lq, le, rtol=1e-2)


@pytest.mark.parametrize("kw", [dict(axis_name=("replica", "data"), hpz_axis="data"),
                                dict(axis_name="data", replica_axis="replica")],
                         ids=["hpz", "hybrid"])
def test_stage3_across_hosts_with_accumulation_equals_reference(kw):
  """The explicit cross-host reduction runs once per micro-batch (sharded accumulation)."""
  params, bs = init_params(), batches(3)
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=_mesh((2, 4)), stage=3,
                                    grad_accum_steps=2, **kw)
  state, losses = run(step, params, bs)
  ref, ref_losses, _ = reference_run(loss_fn, optax.sgd(0.1), params, bs)
  assert_tree_close(step.get_params(state), ref[-1])
  np.testing.assert_allclose(losses, [float(x) for x in ref_losses], rtol=1e-5)


# ------------------------------------------------ bytes and collectives, from the HLO
HOSTS = ({0, 1, 2, 3}, {4, 5, 6, 7})   # the (2, 4) mesh's rows: the replica axis crosses


def _crosses(c) -> bool:
  return bool(c.groups) and any(not (set(g) <= HOSTS[0] or set(g) <= HOSTS[1])
                                for g in c.groups)


def _sent(c) -> float:
  """Bytes one device sends for ``c`` with ring algorithms (as benchmarks/bench_meshes.py)."""
  g = len(c.groups[0]) if c.groups else 1
  per = {"reduce-scatter": g - 1, "all-gather": (g - 1) / g, "all-to-all": (g - 1) / g,
         "all-reduce": 2 * (g - 1) / g}
  return per.get(c.op, 1.0) * c.nbytes if g > 1 else 0.0


def _collectives(step, params, batch):
  return hlo_lib.collectives(step.lower(step.init(params), batch).compile().as_text())


@pytest.mark.parametrize("q", [None, zj.Quantize(weights=False, block_size=64)],
                         ids=["exact", "int8"])
def test_hpz_cross_host_gradient_hop_goes_through_the_buckets(q):
  """Issue 29: stage 3's reduction across hosts (hpZ's outer reduce-scatter, exact or an
  int8 all-to-all) moves a bucket of leaves at once, as the other hops do; with
  ``bucket_bytes=0`` it is one collective per leaf, as before the buckets."""
  params, b = init_params(), batches(1)[0]
  count = {}
  for bucket in (0, DEFAULT_BUCKET_BYTES):
    step = hpz_step((2, 4), optax.sgd(0.1), quantize=q, bucket_bytes=bucket)
    count[bucket] = sum(1 for c in _collectives(step, params, b)
                        if _crosses(c) and c.op in ("reduce-scatter", "all-to-all"))
  split = sum(1 for x in params.values() if np.ndim(x))   # every leaf but the scalar
  assert count == {0: split, DEFAULT_BUCKET_BYTES: 1}, count


def _lm39():
  import test_scanned_layers as tsl
  model = tsl.LM(scanned=False, box=lambda init, names: init)   # 39 plain leaves
  tokens = tsl.make_batches(1)[0]
  params = jax.tree.map(np.asarray, model.init(jax.random.key(0), tokens["inputs"][:1])["params"])
  def loss(p, batch):
    logits = model.apply({"params": p}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  return loss, params, {k: tokens[k] for k in ("inputs", "targets")}


def _mlp6x24():
  r = np.random.default_rng(0)
  params = {f"l{i}": {"w": r.normal(size=(24, 24)).astype(np.float32) / 5,
                      "b": np.zeros(24, np.float32)} for i in range(6)}
  def loss(p, batch):
    x = batch["x"]
    for i in range(6):
      x = jnp.tanh(x.astype(p[f"l{i}"]["w"].dtype) @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean(jnp.square(x.astype(jnp.float32) - batch["y"]))
  b = {"x": r.normal(size=(16, 24)).astype(np.float32), "y": r.normal(size=(16, 24))
       .astype(np.float32)}
  return loss, params, b


@pytest.mark.parametrize("model", [_mlp6x24, _lm39], ids=["mlp_6x24", "lm_39_leaves"])
def test_quantized_steps_never_send_more_than_the_exact_step(model):
  """Models of many small leaves (the issue's 2.5x and 3.0x cases): with int8 weights and
  gradients (and, for the MLP, int4 gradients) each device sends at most the exact step's bytes,
  across hosts and within them (hpZ, bf16, stage 3, the default bucket and block size)."""
  loss, params, b = model()
  kw = dict(stage=3, axis_name=("replica", "data"), hpz_axis="data", precision="bf16")
  sent = {}
  variants = (("exact", None), ("int8", zj.Quantize()), ("int4", zj.Quantize(grad_bits=4)))
  for name, q in variants[:3 if model is _mlp6x24 else 2]:   # the transformer compiles slowly
    step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=_mesh((2, 4)), quantize=q,
                                      **kw)
    colls = [c for c in _collectives(step, params, b) if c.nbytes > 64]   # not the scalars
    sent[name] = (sum(_sent(c) for c in colls if _crosses(c)),
                  sum(_sent(c) for c in colls if not _crosses(c)))
  for name in set(sent) - {"exact"}:
    assert sent[name][0] <= sent["exact"][0] and sent[name][1] <= sent["exact"][1], sent
