"""Weighted losses (``zj.WeightedLoss``): the global weighted mean, as on one device.

A sequence model's loss is the sum of the per-token losses over non-padding
tokens divided by their number. The step must use sum(total) / sum(weight)
over every device and micro-batch, i.e. exactly what single-device code
computes on the whole global batch, not the mean of each device's ratio. The
batches here pad unevenly: devices and micro-batches hold very different
numbers of real tokens (and some none at all), so averaging ratios gives
another loss and another gradient, and these tests fail (rel 1e-5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import N, assert_tree_close, reference_run
from _rounding import check_update, opt_state_of

VOCAB, DIM, LENGTH, BATCH = 11, 7, 6, 32  # 11 and 7 are padded on 8 devices
STEPS = 2
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(1e-2)}
# (stage, grad_accum_steps, accumulate): every combination the step allows.
MODES = [(1, 1, None), (1, 2, "local"), (2, 1, None), (2, 2, "local"), (2, 2, "sharded"),
         (3, 1, None), (3, 2, "sharded")]
# SGD on every mode; Adam (nearly blind to the gradient's scale) on one per stage.
CASES = ([(*m, "sgd") for m in MODES] +
         [(*m, "adam") for m in [(1, 2, "local"), (2, 2, "sharded"), (3, 2, "sharded")]])


def make_params():
  r = np.random.default_rng(0)
  return {"embed": (r.normal(size=(VOCAB, DIM)) * 0.5).astype(np.float32),
          "out": (r.normal(size=(DIM, VOCAB)) * 0.5).astype(np.float32),
          "bias": np.zeros(VOCAB, np.float32)}


def token_losses(p, b):
  """Per-token cross-entropy, (rows, LENGTH), computed in float32."""
  h = jnp.tanh(p["embed"][b["inputs"]])
  logits = (h @ p["out"] + p["bias"]).astype(jnp.float32)
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, b["targets"][..., None], axis=-1)[..., 0]


def loss_fn(p, b):
  """lm1b-style: the summed loss of the real tokens and their number."""
  mask = b["mask"]
  return zj.WeightedLoss(total=(token_losses(p, b) * mask).sum(), weight=mask.sum())


def global_mean(p, b):
  """The single-device loss: sum over the whole batch / its total weight."""
  out = loss_fn(p, b)
  return out.total / out.weight


def make_batches(n=STEPS, size=BATCH, length=LENGTH, seed=1, lengths=None):
  """Batches whose rows hold between 0 and ``length`` real tokens (padding at the end)."""
  r = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    n_real = r.integers(0, length + 1, size=size) if lengths is None else np.asarray(lengths)
    mask = (np.arange(length)[None, :] < n_real[:, None]).astype(np.float32)
    out.append({"inputs": r.integers(0, VOCAB, size=(size, length)).astype(np.int32),
                "targets": r.integers(0, VOCAB, size=(size, length)).astype(np.int32),
                "mask": mask})
  return out


def per_device_ratio_mean(p, b, parts=N):
  """What averaging each device's total / weight would give (the wrong answer)."""
  split = [jax.tree.map(lambda x: np.split(x, parts)[d], b) for d in range(parts)]
  return np.mean([float(global_mean(p, s)) for s in split])


def train(mesh, batches, *, optimizer, stage=2, k=1, accumulate=None, fn=loss_fn, **kw):
  step = zj.make_sharded_train_step(fn, optimizer, mesh=mesh, stage=stage, grad_accum_steps=k,
                                    accumulate=accumulate, **kw)
  state = step.init(make_params())
  metrics = []
  for b in batches:
    state, m = step(state, b)
    metrics.append(m)
  return step, state, metrics


@pytest.fixture(scope="module")
def batches():
  out = make_batches()
  # Uneven enough that the mean of per-device ratios is another number.
  wrong, right = per_device_ratio_mean(make_params(), out[0]), global_mean(make_params(), out[0])
  assert abs(wrong - right) > 1e-3 * abs(right), (wrong, right)
  return out


@pytest.fixture(scope="module")
def references(batches):
  return {name: reference_run(global_mean, make(), make_params(), batches)
          for name, make in OPTIMIZERS.items()}


@pytest.mark.parametrize("stage,k,accumulate,opt", CASES)
def test_weighted_loss_equals_single_device_global_mean(mesh, batches, references, stage, k,
                                                        accumulate, opt):
  step, state, metrics = train(mesh, batches, optimizer=OPTIMIZERS[opt](), stage=stage, k=k,
                               accumulate=accumulate)
  ref_params, ref_losses, _ = references[opt]
  assert_tree_close(step.get_params(state), ref_params[-1], what=f"stage {stage} k={k}")
  np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref_losses, rtol=1e-5)


def aux_loss_fn(p, b):
  mask = b["mask"]
  losses = token_losses(p, b)
  aux = {"tokens": mask.sum(), "max_loss": jnp.max(losses * mask)}
  return zj.WeightedLoss((losses * mask).sum(), mask.sum()), aux


def test_weighted_loss_with_aux_trains_like_single_device(mesh, batches, references):
  step, state, metrics = train(mesh, batches, optimizer=OPTIMIZERS["adam"](), k=2,
                               fn=aux_loss_fn, has_aux=True)
  ref_params, ref_losses, _ = references["adam"]
  assert_tree_close(step.get_params(state), ref_params[-1], what="has_aux")
  np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref_losses, rtol=1e-5)
  # aux is averaged over devices and micro-batches like any aux (it is not weighted).
  mask = batches[-1]["mask"].reshape(N * 2, -1)
  np.testing.assert_allclose(metrics[-1]["aux"]["tokens"], mask.sum(axis=1).mean(), rtol=1e-6)


def test_devices_and_micro_batches_with_only_padding(mesh):
  # Device 3 has no real token; with k=2 the second micro-batch of every device is
  # padding too (its global weight is 0), and device 5 has a single real token.
  rows = BATCH // N
  lengths = np.random.default_rng(2).integers(1, LENGTH + 1, size=BATCH)
  lengths.reshape(N, 2, rows // 2)[:, 1] = 0
  lengths[3 * rows:4 * rows] = 0
  lengths[5 * rows:6 * rows] = [1] + [0] * (rows - 1)
  batches = make_batches(n=1, lengths=lengths)
  ref_params, ref_losses, _ = reference_run(global_mean, optax.sgd(0.5), make_params(), batches)
  for stage, k, accumulate in [(2, 1, None), (2, 2, "local"), (3, 2, "sharded")]:
    step, state, metrics = train(mesh, batches, optimizer=optax.sgd(0.5), stage=stage, k=k,
                                 accumulate=accumulate)
    assert all(bool(m["grads_finite"]) for m in metrics)
    assert_tree_close(step.get_params(state), ref_params[-1], what=f"stage {stage} k={k}")
    np.testing.assert_allclose([float(m["loss"]) for m in metrics], ref_losses, rtol=1e-5)


def test_a_step_without_any_real_token_changes_nothing(mesh):
  # Weight 0: the loss is the single-device 0/0 = NaN and the step is skipped (counted).
  batches = make_batches(n=1, lengths=[0] * BATCH)
  for k in (1, 2):
    with pytest.warns(RuntimeWarning, match=r"step 0 was skipped: its WeightedLoss weight"):
      step, state, metrics = train(mesh, batches, optimizer=optax.adam(1e-2), k=k)
      params = step.get_params(state)  # delivered here at the latest
    assert bool(metrics[0]["grads_finite"]) and np.isnan(float(metrics[0]["loss"])), k
    assert int(metrics[0]["skipped_steps"]) == 1, k
    assert_tree_close(params, make_params(), rtol=0, atol=0, what=f"k={k}")


def fp16_bounds(params, batch, *, rows_per_sum):
  """Bounds on |fp16 step - fp32 step| at the same fp32 ``params``: elementwise on the
  gradient, and on the loss, for any order of XLA's arithmetic (the model of
  test_precision.sharded_vs_reference_bounds: each op rounds once, a sum of n terms is
  within gamma_n of the sum of their absolute values, first order relative to each
  token's own gradient g_t).

  The fp16 step rounds each parameter to fp16 and runs token_losses' fp16 part: a logit
  comes from the params rounded (u each), tanh (4u: an approximation within 4u),
  h @ out (DIM = 7 terms) and + bias, so it is within C_F u m of itself, C_F = 14,
  m = |h| @ |out| + |bias|. Log-softmax (fp32) is 2-Lipschitz in the largest logit error,
  so the token's loss is within 2 C_F u max_j m_j, and so is its softmax - one-hot (the
  logits' cotangent) relative to itself. Backward in fp16: the cotangent's cast (1),
  @ out.T (VOCAB = 11 terms), tanh' as (1 - h)(1 + h) (4), the params' rounding where
  they are used (4) and the last product (1): C_B = 21. Then the sums: each device sums
  its ``rows_per_sum`` rows' tokens (gamma_(rows_per_sum LENGTH), in fp16), the k = 2
  micro-batches (2) and the N devices (N + 1) add up their partials; the fp32 step sums
  all its tokens in fp32 (tokens u32). So, elementwise,

    |g_fp16 - g_fp32| <= sum_t ((C_B + rows_per_sum LENGTH + 2 + N + 1 + 2 C_F max_j m_tj) u
                                + tokens u32) |g_t|.
  """
  u, u32 = 2.0**-11, 2.0**-24
  c_f, c_b = 14, 21
  tokens = batch["mask"].size
  flat = {k: v.reshape(tokens, *v.shape[2:]) for k, v in batch.items()}
  weight = float(batch["mask"].sum())

  def token(p, b):  # one token's share of global_mean, and its logits' magnitude
    one = jax.tree.map(lambda x: x[None, None], b)
    h = jnp.tanh(p["embed"][one["inputs"]])
    mag = jnp.max(jnp.abs(h) @ jnp.abs(p["out"]) + jnp.abs(p["bias"]))
    return (token_losses(p, one) * one["mask"]).sum() / weight, mag

  g, mag = jax.jit(jax.vmap(jax.grad(token, has_aux=True), in_axes=(None, 0)))(params, flat)
  mag = np.asarray(mag, np.float64)
  c = (c_b + rows_per_sum * LENGTH + 2 + N + 1 + 2 * c_f * mag) * u + tokens * u32
  grad_err = {k: np.einsum("t,t...->...", c, np.abs(np.asarray(v, np.float64)))
              for k, v in g.items()}
  per_token = 2 * c_f * u * mag * np.asarray(flat["mask"], np.float64)
  loss_err = float(per_token.sum() / weight) + tokens * u32 * float(global_mean(params, batch))
  return grad_err, loss_err


@pytest.mark.parametrize("stage,k,accumulate", [(2, 2, "local"), (3, 2, "sharded")])
def test_fp16_weighted_loss_with_dynamic_scaling_matches_fp32(mesh, stage, k, accumulate):
  """Each step of the fp16 run against an fp32 Adam step from the same state, to within the
  rounding bound of `fp16_bounds` (`_rounding.check_update`)."""
  # 64 tokens per row: each micro-batch's summed gradient times the initial scale
  # (2**15) is far beyond fp16's range, while the gradient of the mean is not. A
  # step that rescaled micro-batches in fp16 would overflow and skip steps here.
  batches = make_batches(n=3, length=64)
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=stage,
                                    grad_accum_steps=k, accumulate=accumulate,
                                    precision="fp16")
  state = step.init(make_params())
  fp32_grad = jax.jit(jax.value_and_grad(global_mean))
  for t, b in enumerate(batches):
    params, opt_before = jax.device_get(step.get_params(state)), opt_state_of(state)
    state, m = step(state, b)
    assert bool(m["grads_finite"]) and float(m["loss_scale"]) == 2.0 ** 15, t
    loss, grads = fp32_grad(params, b)
    grad_err, loss_err = fp16_bounds(params, b, rows_per_sum=BATCH // N // k)
    assert abs(float(m["loss"]) - float(loss)) <= loss_err, (t, float(m["loss"]), float(loss))
    check_update("adam", 1e-2, params, opt_before, grads, grad_err,
                 jax.device_get(step.get_params(state)), opt_state_of(state))
