"""Mixed precision: bf16, fp16 (fp32 master + loss scaling), memory-efficient fp16, comm_dtype.

Every step of a sharded run (8 CPU devices, 20 steps) is compared with a
single-device ``jax.jit`` + optax reference step from the same state, written
here without zero_jax, that applies the same policy by hand: the fp32 master
cast to the compute dtype for the loss, the loss multiplied by the same loss
scale, the gradient upcast to fp32 and divided by the scale, the fp32 optax
update applied to the fp32 master (in the memory-efficient mode, to the fp16
params upcast, and rounded back to fp16), the step skipped when the gradient is
not finite, the dynamic scale adjusted.

Tolerances are bounds on rounding that hold for any order and vector width of
XLA's arithmetic (x86-64 SSE4/AVX2/AVX-512/AMX, GPUs), derived in
`sharded_vs_reference_bounds` and `check_update` from the step's own data, in
units of the compute dtype's unit roundoff ``u`` (bf16 2**-8, fp16 2**-11) times
the sum over examples of the absolute per-example gradients. Both runs do the
same arithmetic except where the gradient is rounded: the reference rounds the
gradient of the whole batch to the compute dtype once; the sharded step rounds
each device's partial gradient and then their sum (the reduce-scatter runs in
the compute dtype). Runs are compared step by step, not as two 20-step
trajectories: how rounding differences grow along a trajectory depends on the
training dynamics, which no rounding bound controls.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from zero_jax.checkpoint import master_form
from _rounding import U32, check_update, logical, opt_state_of
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


# ------------------------------------------------------------------ reference
LR = {"sgd": 0.1, "adam": 1e-2}


def scaled_loss(q, batch, scale, n=1):
  """What is differentiated: the mean loss over ``batch`` in fp32, times the loss scale, / n
  (each sharded device: its slice, n = N; the reference: the whole batch, n = 1)."""
  return loss_fn(q, batch).astype(jnp.float32) * scale / n


@functools.lru_cache(maxsize=None)
def reference_step(compute, opt_name, master=True):
  """One step of the policy applied by hand on one device (no zero_jax), from the fp32
  ``src`` (the master, or the fp16 params upcast when there is none).

  Returns:
    (new src, new optimizer state, finite, loss, grad_norm, fp32 unscaled gradient).
  """
  compute = jnp.dtype(compute)
  opt = OPTIMIZERS[opt_name]()

  @jax.jit
  def one(src, opt_state, scale, batch):
    params = jax.tree.map(lambda x: x.astype(compute), src)
    loss, grads = jax.value_and_grad(scaled_loss)(params, batch, scale)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
    updates, new_opt = opt.update(grads, opt_state, src)
    new_src = optax.apply_updates(src, updates)
    if not master:  # fp16 storage: the fp32 update is rounded back every step
      new_src = jax.tree.map(lambda x: x.astype(compute).astype(jnp.float32), new_src)
    keep = lambda new, old: jnp.where(finite, new, old)
    return (jax.tree.map(keep, new_src, src), jax.tree.map(keep, new_opt, opt_state), finite,
            loss / scale, optax.tree.norm(grads), grads)
  return one


def expected_scales(finite, scale0, dynamic):
  """The loss scale used at each step: x0.5 on overflow (min 1), x2 after 2000 finite steps."""
  scales, scale, good = [], scale0, 0
  for f in finite:
    scales.append(scale)
    if dynamic:
      good = good + 1 if f else 0
      scale = scale * 2 if good >= 2000 else (scale if f else max(scale / 2, 1.0))
      good = 0 if good >= 2000 else good
  return scales


def device_slices(batch):
  return [jax.tree.map(lambda x, d=d: x[d * 16 // N:(d + 1) * 16 // N], batch) for d in range(N)]


# Roundings on the longest path from the params to one example's gradient element, each op
# counted once per rounding it may do (a length-n dot product: n; tanh: 4, an approximation
# within 4u of its dtype): x @ w1 (9), + b1 (1), tanh (4), @ w2 (7), + b2, * s, - y (3), the
# cotangent's cast to the compute dtype and its products (3), * s (1), @ w2.T (5),
# * (1 - h) and * (1 + h) with 1 - h and their sum (4), the last product (1).
C_PATH = 38
# The same for the loss's residual out - y: the first 24 of them.
C_FORWARD = 24


@functools.lru_cache(maxsize=None)
def _per_example():
  """Jitted: per-example gradients / 16, and residuals out - y with |out| + |y|, in fp32."""
  grad = jax.vmap(lambda p, b: jax.tree.map(lambda g: g / 16, jax.grad(loss_fn)(p, b)),
                  in_axes=(None, 0))

  def residual(p, b):
    out = (jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]) * p["s"]
    return out - b["y"], jnp.abs(out) + jnp.abs(b["y"])
  one = lambda b: jax.tree.map(lambda x: x[:, None], b)
  return jax.jit(lambda p, b: grad(p, one(b))), jax.jit(residual)


def leaf_norm(tree):
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree.leaves(tree))))


def sharded_vs_reference_bounds(params, batch, compute, *, cast=False):
  """Elementwise bounds on |sharded gradient - reference gradient| (both unscaled) and a bound
  on |sharded loss - reference loss|, at the same fp32 ``params``.

  Model (Higham, Accuracy and Stability of Numerical Algorithms, ch. 2-3): each op rounds its
  result at most once to the compute dtype (a wider accumulator or a fused op only rounds
  less); a sum of n terms in any order is within gamma_n ~ n u of the sum of their absolute
  values. One example's gradient g_i is computed to within C_PATH u |g_i| in either run
  (first order, relative to the example's own gradient: a cancellation inside one example's
  forward and backward pass is not covered; a worst case through it, propagated op by op
  with absolute values, is 1000-2900 u here, which no test could use). The reference then
  sums the 16 examples (gamma_16); each sharded device sums its 2 (gamma_2), rounds its
  partial gradient, and the N partials are summed (gamma_(N+1)), each within that many u of
  sum_i |g_i|. So, elementwise,

    |g_sharded - g_ref| <= (2 C_PATH + 16 + 2 + N + 1) u sum_i |g_i|.

  With ``cast`` the reference is a pure fp32 step on the fp32 ``params``: the sharded step's
  rounding of each parameter to the compute dtype adds u for each of the 6 parameter uses
  on the path; the fp32 step's own error is (C_PATH + 16) u32.

  The loss: the residual r = out - y is within e = C_FORWARD u (|out| + |y|) of itself, its
  square within 2 |r| e + e**2 + u r**2, in each run; the fp32 means (the step's over devices,
  the reference's unscaling by a power of two) add 4 u32 of the loss.
  """
  u = UNIT_ROUNDOFF[jnp.dtype(compute)]
  if not cast:  # the magnitudes where both runs compute: at the params rounded
    params = jax.tree.map(lambda x: jnp.asarray(x).astype(compute).astype(jnp.float32), params)
  grad_fn, residual_fn = _per_example()
  sum_abs = jax.tree.map(lambda g: np.sum(np.abs(np.asarray(g, np.float64)), axis=0),
                         grad_fn(params, batch))
  if cast:
    c = (C_PATH + 6 + 2 + N + 1) * u + (C_PATH + 16) * U32
  else:
    c = (2 * C_PATH + 16 + 2 + N + 1) * u
  grad_err = jax.tree.map(lambda a: c * a, sum_abs)
  r, mag = (np.asarray(x, np.float64) for x in residual_fn(params, batch))
  e = C_FORWARD * u * mag
  loss_err = np.mean(2 * (2 * np.abs(r) * e + e**2 + u * r**2) + 4 * U32 * r**2)
  return grad_err, float(loss_err)


# -------------------------------------------------------------------- sharded
@functools.lru_cache(maxsize=None)
def sharded_run(precision, stage, opt_name, loss_scale=None):
  """20 steps of the sharded step; compiled once per configuration.

  Returns:
    (step, final state, metrics per step, dtypes the loss saw, (params, optimizer state)
    before each step and after the last: params as `get_params` returns them).
  """
  seen = set()

  def recording_loss(p, batch):
    seen.update(str(x.dtype) for x in jax.tree.leaves(p))  # at trace time
    return loss_fn(p, batch)

  step = zj.make_sharded_train_step(recording_loss, OPTIMIZERS[opt_name](), mesh=MESH,
                                    stage=stage, precision=precision, loss_scale=loss_scale)
  state = step.init(init_params())
  metrics, states = [], []
  for batch in BATCHES:
    states.append((jax.device_get(step.get_params(state)), opt_state_of(state)))
    state, m = step(state, batch)
    metrics.append(jax.device_get(m))
  states.append((jax.device_get(step.get_params(state)), opt_state_of(state)))
  return step, state, metrics, seen, states


# (precision, stage, optimizer, loss_scale): every stage, optimizer and policy at
# least once; fp16 stage 1 uses a static scale so it can also be compared with fp32.
CONFIGS = [
    ("bf16", 1, "sgd", None), ("bf16", 2, "adam", None), ("bf16", 3, "sgd", None),
    ("fp16", 1, "adam", 2.0**10), ("fp16", 2, "sgd", None), ("fp16", 3, "adam", None),
    ("fp16_memory_efficient", 2, "adam", None), ("fp16_memory_efficient", 3, "sgd", None),
]
IDS = ["-".join(str(c) for c in cfg[:3]) for cfg in CONFIGS]


@pytest.mark.parametrize("precision", sorted(COMPUTE))
@pytest.mark.parametrize("stage", [2, 3])
def test_state_dtypes_and_fp32_master_sharded_one_nth_per_device(precision, stage):
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=MESH, stage=stage,
                                    precision=precision)
  state = step.init(init_params())
  cdt = COMPUTE[precision]
  # Stage 3 keeps no half-precision copy: the split fp32 master is the parameter.
  single = stage == 3 and precision != "fp16_memory_efficient"
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {F32 if single else cdt}
  if precision == "fp16_memory_efficient" or single:
    assert state.master is None  # no fp32 copy at all, or no copy beside the parameters
  if precision != "fp16_memory_efficient":
    layouts = state.meta.param_layouts
    masters = jax.tree.leaves(state.params) if single else state.master
    assert len(masters) == len(layouts)
    for m, lay in zip(masters, layouts):
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


def reference_for(precision, loss_scale):
  """(master?, first loss scale, dynamic?) of a policy, as the step's defaults make them."""
  dynamic = precision.startswith("fp16") and loss_scale is None
  scale0 = 2.0**15 if dynamic else (loss_scale or 1.0)
  return precision != "fp16_memory_efficient", scale0, dynamic


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_mixed_precision_matches_single_device_reference_of_same_policy(cfg):
  """Each of the 20 steps, from the sharded run's own state, against the reference step from
  that same state: every difference is rounding, bounded for any order of XLA's arithmetic
  (`sharded_vs_reference_bounds`, `check_update`). A run-against-run comparison would
  compound 20 steps of rounding through the training dynamics, which no bound controls."""
  precision, stage, opt_name, loss_scale = cfg
  step, state, metrics, seen, states = sharded_run(*cfg)
  master, scale0, dynamic = reference_for(precision, loss_scale)
  compute = COMPUTE[precision]
  one = reference_step(str(compute), opt_name, master)
  assert seen == {str(compute)}  # the loss saw compute-dtype params only
  finite = [bool(m["grads_finite"]) for m in metrics]
  assert [float(m["loss_scale"]) for m in metrics] == expected_scales(finite, scale0, dynamic)
  assert any(finite)
  for t, (m, batch) in enumerate(zip(metrics, BATCHES)):
    (params, opt_before), (new_params, new_opt) = states[t], states[t + 1]
    src = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    scale = float(m["loss_scale"])
    _, _, ref_finite, loss, gnorm, grads = one(src, opt_before, jnp.float32(scale), batch)
    assert finite[t] == bool(ref_finite), t  # the same overflow decision
    if not finite[t]:  # a skipped step changes nothing
      jax.tree.map(np.testing.assert_array_equal, (params, opt_before), (new_params, new_opt))
      continue
    grad_err, loss_err = sharded_vs_reference_bounds(src, batch, compute)
    # |norm(g_s) - norm(g_ref)| <= norm(g_s - g_ref) <= norm(grad_err), and each norm is
    # computed in fp32 from squares of 111 elements: within (111 + 2) u32 of itself.
    gn_bound = leaf_norm(grad_err) + 113 * U32 * (float(gnorm) + float(m["grad_norm"]))
    assert abs(float(m["grad_norm"]) - float(gnorm)) <= gn_bound, t
    assert abs(float(m["loss"]) - float(loss)) <= loss_err, t
    check_update(opt_name, LR[opt_name], src, opt_before, grads, grad_err,
                 new_params, new_opt, round_to=None if master else np.float16)


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[0] != "fp16_memory_efficient"],
                         ids=[i for c, i in zip(CONFIGS, IDS) if c[0] != "fp16_memory_efficient"])
def test_compute_params_are_the_rounded_fp32_master(cfg):
  step, state, _, _, _ = sharded_run(*cfg)
  cdt = COMPUTE[cfg[0]]
  master = step.get_params(state)
  n_exact = n_total = 0
  # Stage 3 keeps the master only, rounded before each gather: what a checkpoint of it
  # holds (`zero_jax.checkpoint.master_form.saved_form`) is that rounding.
  params = master_form.saved_form(state).params if cfg[1] == 3 else state.params
  for k, stored in params.items():
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
  """Each step of the fp32 master, from the sharded run's own state, against a pure fp32 step
  from that state: the step rounds the master to the compute dtype for the loss, and
  computes and reduces in it; the fp32 step does not. `sharded_vs_reference_bounds` with
  ``cast`` bounds both against exact arithmetic on the fp32 master, for any rounding order."""
  precision, _, opt_name, _ = cfg
  _, _, metrics, _, states = sharded_run(*cfg)
  assert all(bool(m["grads_finite"]) for m in metrics)
  fp32_step = reference_step("float32", opt_name)
  for t, (m, batch) in enumerate(zip(metrics, BATCHES)):
    (params, opt_before), (new_params, new_opt) = states[t], states[t + 1]
    *_, gnorm, grads = fp32_step(params, opt_before, jnp.float32(1.0), batch)
    grad_err, _ = sharded_vs_reference_bounds(params, batch, COMPUTE[precision], cast=True)
    gn_bound = leaf_norm(grad_err) + 113 * U32 * (float(gnorm) + float(m["grad_norm"]))
    assert abs(float(m["grad_norm"]) - float(gnorm)) <= gn_bound, t
    check_update(opt_name, LR[opt_name], params, opt_before, grads, grad_err, new_params,
                 new_opt)


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
  """Five steps of the bf16 wire, each against the fp32 wire from the same params."""
  bf16_step, f32_step = comm_steps(stage)
  s_bf = bf16_step.init(jax.tree.map(jnp.asarray, init_params()))
  u = UNIT_ROUNDOFF[jnp.dtype(jnp.bfloat16)]
  worst = 0.0
  for batch in BATCHES[:5]:
    p0 = bf16_step.get_params(s_bf)
    s_bf, _ = bf16_step(s_bf, batch)
    s_32, _ = f32_step(f32_step.init(p0), batch)
    g_bf = jax.tree.map(lambda a, b: (a - b) / 0.1, p0, bf16_step.get_params(s_bf))
    g_32 = jax.tree.map(lambda a, b: (a - b) / 0.1, p0, f32_step.get_params(s_32))
    local = local_gradients(p0, batch)
    for k in p0:
      sum_abs = np.sum(np.abs(np.asarray(local[k])), axis=0)
      err = np.abs(np.asarray(g_bf[k]) - np.asarray(g_32[k]))
      # Rounding N partial gradients to bf16 and their sum, in any order: error <= (N + 1) u
      # sum|g_i| (that also covers a backend that adds in bf16). The fp32 parts: each local
      # gradient in either program within 64 u32 of sum|g_i| (its backward pass: C_PATH and
      # the sums); each (p - p') / lr read back within u32 (|p'| / lr + 2 |g|) of the g the
      # step applied (p' = p - lr g rounded; p - p' exact by Sterbenz; / lr rounded): twice.
      u32 = 2.0**-24
      bound = ((N + 1) * u + 64 * u32) * sum_abs + 2 * u32 * (
          np.abs(np.asarray(p0[k])) / 0.1 + 2 * np.abs(np.asarray(g_32[k])))
      assert np.all(err <= bound), k
      worst = max(worst, float(np.max(err / (sum_abs + 1e-30))))
  assert worst > u / 8  # the gradient really went through bf16 (an fp32 wire: ~1e-7)


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
