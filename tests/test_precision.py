"""Mixed precision: bf16, fp16 (fp32 master + loss scaling), memory-efficient fp16, comm_dtype.

Every sharded run (8 CPU devices, 20 steps) is compared with a single-device
``jax.jit`` + optax reference that applies the same policy by hand, written
here without zero_jax: the fp32 master cast to the compute dtype for the loss,
the loss multiplied by the same loss scale, the gradient upcast to fp32 and
divided by the scale, the fp32 optax update applied to the fp32 master (in the
memory-efficient mode, to the fp16 params upcast, and rounded back to fp16),
the step skipped when the gradient is not finite, the dynamic scale adjusted.

Tolerances are in units of the compute dtype's unit roundoff ``u`` (bf16 2**-8,
fp16 2**-11). Both runs do the same arithmetic except for how the gradient is
rounded: the reference rounds the gradient of the whole batch to the compute
dtype once; the sharded step rounds each device's partial gradient and then
their sum (the reduce-scatter runs in the compute dtype). So each step's
gradients agree to a few ``u`` (relative to the gradient), not to fp32
precision, and the parameter trajectories agree to about ``u``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _small_mlp import init_params, loss_fn

N = 8
STEPS = 20
F32 = jnp.dtype(jnp.float32)
COMPUTE = {"bf16": jnp.dtype(jnp.bfloat16), "fp16": jnp.dtype(jnp.float16),
           "fp16_memory_efficient": jnp.dtype(jnp.float16)}
UNIT_ROUNDOFF = {jnp.dtype(jnp.bfloat16): 2.0**-8, jnp.dtype(jnp.float16): 2.0**-11}
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
MESH = jax.make_mesh((N,), ("data",))






def make_batches(steps=STEPS):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(16, 9)).astype(np.float32),
           "y": r.normal(size=(16, 5)).astype(np.float32)} for _ in range(steps)]


BATCHES = make_batches()


def rel_err(got, want):
  """Normwise relative error over a whole tree (as float32)."""
  got, want = jax.tree.leaves(got), jax.tree.leaves(want)
  num = sum(np.sum((np.asarray(a, np.float32) - np.asarray(b, np.float32)) ** 2)
            for a, b in zip(got, want))
  den = sum(np.sum(np.asarray(b, np.float32) ** 2) for b in want)
  return float(np.sqrt(num / den))


def logical(x, shape):
  """The logical view of a (possibly padded) storage array: padding is at the end."""
  return np.asarray(x)[tuple(slice(0, d) for d in shape)]


# ------------------------------------------------------------------ reference
@functools.lru_cache(maxsize=None)
def reference_run(compute, opt_name, master=True, scale0=1.0, dynamic=False):
  """A single-device run applying the policy by hand (no zero_jax).

  Returns:
    (final fp32 params, one (finite, scale used, loss, grad_norm) per step).
  """
  compute = jnp.dtype(compute)
  opt = OPTIMIZERS[opt_name]()

  @jax.jit
  def one(src, opt_state, scale, batch):
    params = jax.tree.map(lambda x: x.astype(compute), src)
    scaled = lambda q: loss_fn(q, batch).astype(jnp.float32) * scale
    loss, grads = jax.value_and_grad(scaled)(params)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    updates, new_opt = opt.update(grads, opt_state, src)
    new_src = optax.apply_updates(src, updates)
    if not master:  # fp16 storage: the fp32 update is rounded back every step
      new_src = jax.tree.map(lambda x: x.astype(compute).astype(jnp.float32), new_src)
    keep = lambda new, old: jnp.where(finite, new, old)
    return (jax.tree.map(keep, new_src, src), jax.tree.map(keep, new_opt, opt_state), finite,
            loss / scale, optax.tree.norm(grads))

  src = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), init_params())
  if not master:
    src = jax.tree.map(lambda x: x.astype(compute).astype(jnp.float32), src)
  opt_state = opt.init(src)
  scale, good, out = scale0, 0, []
  for batch in BATCHES:
    src, opt_state, finite, loss, gnorm = one(src, opt_state, jnp.float32(scale), batch)
    out.append((bool(finite), scale, float(loss), float(gnorm)))
    if dynamic:  # defaults: x0.5 on overflow (min 1), x2 after 2000 finite steps
      good = good + 1 if finite else 0
      scale = scale * 2 if good >= 2000 else (scale if finite else max(scale / 2, 1.0))
      good = 0 if good >= 2000 else good
  return jax.device_get(src), out


# -------------------------------------------------------------------- sharded
@functools.lru_cache(maxsize=None)
def sharded_run(precision, stage, opt_name, loss_scale=None):
  """20 steps of the sharded step; compiled once per configuration."""
  seen = set()

  def recording_loss(p, batch):
    seen.update(str(x.dtype) for x in jax.tree.leaves(p))  # at trace time
    return loss_fn(p, batch)

  step = zj.make_sharded_train_step(recording_loss, OPTIMIZERS[opt_name](), mesh=MESH,
                                    stage=stage, precision=precision, loss_scale=loss_scale)
  state = step.init(init_params())
  metrics = []
  for batch in BATCHES:
    state, m = step(state, batch)
    metrics.append(jax.device_get(m))
  return step, state, metrics, seen


# (precision, stage, optimizer, loss_scale): every stage, optimizer and policy at
# least once; fp16 stage 1 uses a static scale so it can also be compared with fp32.
CONFIGS = [
    ("bf16", 1, "sgd", None), ("bf16", 2, "adam", None), ("bf16", 3, "sgd", None),
    ("fp16", 1, "adam", 2.0**10), ("fp16", 2, "sgd", None), ("fp16", 3, "adam", None),
    ("fp16_memory_efficient", 2, "adam", None), ("fp16_memory_efficient", 3, "sgd", None),
]
IDS = ["-".join(str(c) for c in cfg[:3]) for cfg in CONFIGS]


def reference_for(precision, opt_name, loss_scale):
  dynamic = precision.startswith("fp16") and loss_scale is None
  scale0 = 2.0**15 if dynamic else (loss_scale or 1.0)
  return reference_run(str(COMPUTE[precision]), opt_name,
                       master=precision != "fp16_memory_efficient", scale0=scale0,
                       dynamic=dynamic)


@pytest.mark.parametrize("precision", sorted(COMPUTE))
@pytest.mark.parametrize("stage", [2, 3])
def test_state_dtypes_and_fp32_master_sharded_one_nth_per_device(precision, stage):
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=MESH, stage=stage,
                                    precision=precision)
  state = step.init(init_params())
  cdt = COMPUTE[precision]
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {cdt}
  if precision == "fp16_memory_efficient":
    assert state.master is None  # no fp32 copy at all
  else:
    layouts = state.meta.param_layouts
    assert len(state.master) == len(layouts)
    for m, lay in zip(state.master, layouts):
      assert m.dtype == F32 and m.shape == lay.storage_shape
      for shard in m.addressable_shards:  # 1/N of the padded leaf on every device
        expect = list(lay.storage_shape)
        if lay.dim is not None:
          expect[lay.dim] //= N
        assert shard.data.shape == tuple(expect), (lay, shard.data.shape)
  for x in jax.tree.leaves(state.opt_state):
    if jnp.issubdtype(x.dtype, jnp.floating):
      assert x.dtype == F32  # optimizer state is fp32 in every policy
  want = cdt if precision == "fp16_memory_efficient" else F32
  got = step.get_params(state)
  assert {x.dtype for x in jax.tree.leaves(got)} == {want}
  # get_params returns the master itself: the initial fp32 values, not a rounding.
  for k, v in init_params().items():
    np.testing.assert_array_equal(np.asarray(got[k], np.float32),
                                  np.asarray(jnp.asarray(v).astype(want), np.float32))
  assert state.loss_scale.dynamic == precision.startswith("fp16")
  if precision.startswith("fp16"):
    assert float(state.loss_scale.scale) == 2.0**15


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_mixed_precision_matches_single_device_reference_of_same_policy(cfg):
  precision, stage, opt_name, loss_scale = cfg
  step, state, metrics, seen = sharded_run(*cfg)
  ref_params, ref_steps = reference_for(precision, opt_name, loss_scale)
  u = UNIT_ROUNDOFF[COMPUTE[precision]]
  assert seen == {str(COMPUTE[precision])}  # the loss saw compute-dtype params only
  # Same overflow/skip decisions and the same loss scale at every step.
  assert [bool(m["grads_finite"]) for m in metrics] == [r[0] for r in ref_steps]
  assert [float(m["loss_scale"]) for m in metrics] == [r[1] for r in ref_steps]
  assert any(r[0] for r in ref_steps)
  for m, (finite, _, loss, gnorm) in zip(metrics, ref_steps):
    if finite:
      # The gradient differs only by where it is rounded to the compute dtype:
      # the whole batch's once, vs. each of the N=8 partial gradients and their
      # sum, i.e. up to (N + 1)u of sum|g_i| per element, about u in norm
      # (measured up to 3.1u): 8u.
      np.testing.assert_allclose(m["grad_norm"], gnorm, rtol=8 * u)
      # The loss itself is fp32 arithmetic on params that agree to ~u.
      np.testing.assert_allclose(m["loss"], loss, rtol=2 * u)
  # Each step's gradient differs by about u of itself (measured grad_norm: up
  # to 3.1u, loss 0.9u), so each update differs by about u of itself and the
  # trajectories drift apart by about u times how far the params moved:
  # measured 0.3-0.45 u * movement, bound 2. The memory-efficient mode also
  # rounds the params to fp16 every step, and one flipped ulp is u of that
  # element: + u (measured 0.76u in all). An update done in the compute dtype
  # instead of fp32 gives 4.6 u * movement and fails here.
  movement = rel_err(init_params(), ref_params)
  tol = 2 * u * movement + (u if precision == "fp16_memory_efficient" else 0)
  assert rel_err(step.get_params(state), ref_params) < tol


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] != "fp16_memory_efficient"],
                         ids=[i for c, i in zip(CONFIGS, IDS) if c[0] != "fp16_memory_efficient"])
def test_compute_params_are_the_rounded_fp32_master(cfg):
  step, state, _, _ = sharded_run(*cfg)
  cdt = COMPUTE[cfg[0]]
  master = step.get_params(state)
  n_exact = n_total = 0
  for k, stored in state.params.items():
    want = jnp.asarray(master[k]).astype(cdt)
    # Bit for bit: the compute copy is the master rounded, nothing else.
    np.testing.assert_array_equal(logical(stored, want.shape).view(np.uint16),
                                  np.asarray(want).view(np.uint16))
    if cfg[1] == 3:  # stored padded and sharded: the padding is zero
      assert np.count_nonzero(np.asarray(stored)) == np.count_nonzero(np.asarray(want))
    m_np = np.asarray(master[k])
    n_exact += np.sum(m_np.astype(cdt).astype(np.float32) == m_np)
    n_total += m_np.size
  # The update is done in fp32: the master holds values the compute dtype cannot.
  assert n_exact < 0.2 * n_total


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] == "bf16" or c[3] is not None],
                         ids=[i for c, i in zip(CONFIGS, IDS) if c[0] == "bf16" or c[3] is not None])
def test_fp32_master_tracks_pure_fp32_run(cfg):
  precision, stage, opt_name, _ = cfg
  step, state, metrics, _ = sharded_run(*cfg)
  assert all(bool(m["grads_finite"]) for m in metrics)
  fp32_params, _ = reference_run("float32", opt_name)
  # The only difference from fp32 is the rounding of the params the loss sees
  # and of its activations and gradient (about u each), so, as above, the fp32
  # master drifts from the fp32 run by about u times how far the params moved:
  # measured 0.43-0.76 u * movement, bound 2.
  u = UNIT_ROUNDOFF[COMPUTE[precision]]
  movement = rel_err(init_params(), fp32_params)
  assert rel_err(step.get_params(state), fp32_params) < 2 * u * movement


# ---------------------------------------------------------- comm_dtype=bf16
@functools.lru_cache(maxsize=None)
def comm_steps(stage):
  make = lambda comm: zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=MESH,
                                                 stage=stage, comm_dtype=comm, donate=False)
  return make(jnp.bfloat16), make(None)


def local_gradients(params, batch):
  """Each device's gradient of its slice's loss divided by N (what it sends), fp32."""
  sliced = jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), batch)
  grad = lambda b: jax.tree.map(lambda g: g / N, jax.grad(loss_fn)(params, b))
  return jax.jit(jax.vmap(grad))(sliced)


@pytest.mark.parametrize("stage", [1, 2])  # all-reduce, reduce-scatter
def test_comm_dtype_bf16_rounds_the_wire_and_stays_close_to_fp32(stage):
  bf16_step, f32_step = comm_steps(stage)
  p0 = jax.tree.map(jnp.asarray, init_params())
  s_bf, s_32 = bf16_step.init(p0), f32_step.init(p0)
  s_bf, _ = bf16_step(s_bf, BATCHES[0])
  s_32, _ = f32_step(s_32, BATCHES[0])
  g_bf = jax.tree.map(lambda a, b: (a - b) / 0.1, p0, bf16_step.get_params(s_bf))
  g_32 = jax.tree.map(lambda a, b: (a - b) / 0.1, p0, f32_step.get_params(s_32))
  local = local_gradients(p0, BATCHES[0])
  u = UNIT_ROUNDOFF[jnp.dtype(jnp.bfloat16)]
  worst = 0.0
  for k in p0:
    sum_abs = np.sum(np.abs(np.asarray(local[k])), axis=0)
    err = np.abs(np.asarray(g_bf[k]) - np.asarray(g_32[k]))
    # Rounding N partial gradients to bf16 and their sum: error <= (N + 1) u sum|g_i|
    # (that also covers a backend that adds in bf16); 1e-5 for the fp32 (p - p')/lr.
    assert np.all(err <= (N + 1) * u * sum_abs + 1e-5), k
    worst = max(worst, float(np.max(err / (sum_abs + 1e-30))))
  assert worst > u / 8  # the gradient really went through bf16 (an fp32 wire: ~1e-7)
  for batch in BATCHES[1:5]:
    s_bf, _ = bf16_step(s_bf, batch)
    s_32, _ = f32_step(s_32, batch)
  # 5 SGD steps, each gradient off by about u (measured < 0.5u): the params
  # stay within u of the fp32-wire run.
  assert rel_err(bf16_step.get_params(s_bf), f32_step.get_params(s_32)) < u


def reduce_scatters(hlo_text):
  return [line for line in hlo_text.splitlines() if re.search(r"\breduce-scatter\(", line)]


def collective_types(mlir, op):
  """(operand type, result type) of every ``stablehlo.<op>`` in a lowered module."""
  return re.findall(rf'"stablehlo.{op}".*?\}}\) : \((tensor<[^)]*>)\) -> (tensor<[^>]*>)',
                    mlir, flags=re.S)


def test_comm_dtype_bf16_all_reduce_in_lowered_stage1():
  bf16_step, _ = comm_steps(1)
  mlir = bf16_step.lower(bf16_step.init(init_params()), BATCHES[0]).as_text()
  ops = [t for t in collective_types(mlir, "all_reduce") if "bf16" in t[0]]
  assert len(ops) == 5, ops  # one per parameter leaf: the gradient all-reduce


def test_comm_dtype_bf16_reduce_scatter_in_compiled_hlo():
  bf16_step, f32_step = comm_steps(2)
  p0 = init_params()
  lowered = bf16_step.lower(bf16_step.init(p0), BATCHES[0])
  # What the step asks for: every reduce-scatter operand and result is bf16.
  ops = collective_types(lowered.as_text(), "reduce_scatter")
  assert len(ops) >= 1  # w1, b1, w2, b2 in one bucket (the scalar s is all-reduced)
  assert all("bf16" in a and "bf16" in r for a, r in ops), ops
  # What XLA compiled. A GPU/TPU backend keeps bf16[...] reduce-scatter. The CPU
  # backend has no bf16 reductions and promotes them: the instruction becomes an
  # f32 reduce-scatter whose reducer is named *_promoted, fed with bf16-rounded
  # values (see the numeric test above).
  compiled = reduce_scatters(lowered.compile().as_text())
  assert len(compiled) == len(ops), compiled
  for line in compiled:
    assert (re.search(r"= bf16\[[^]]*\]\S* reduce-scatter\(", line) or
            (jax.default_backend() == "cpu" and "_promoted" in line)), line
  # The fp32 wire is a plain f32 reduce-scatter, never promoted.
  plain = reduce_scatters(f32_step.lower(f32_step.init(p0), BATCHES[0]).compile().as_text())
  assert len(plain) == len(ops) and all("= f32[" in l and "_promoted" not in l for l in plain), plain
