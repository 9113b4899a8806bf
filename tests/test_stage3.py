"""ZeRO-3: parameters sharded at rest, gathered where used and gathered again for the backward pass.

Stage 3 must give the stage-2 result and the single-device optax result
(rtol 1e-5) on uneven leaves, keep each parameter as a padded 1/N block per
device between steps, and return full parameters from ``get_params``. The
lowered program must gather each parameter twice per micro-batch: once in the
forward pass and once more in the backward pass instead of keeping the full
copy alive in between (``jax.checkpoint`` with a policy that refuses to save
the gathered values).

Note: XLA's CPU compiler removes optimization barriers before its CSE pass
and so merges the two gathers; the GPU and TPU compilers remove them only
after scheduling. The re-gather is therefore checked in the lowered
StableHLO, which is what every backend receives. That stage 3's compiled
memory falls with N is pinned in test_stacked.py, where a loop over stacked
layers orders the gathers.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import N, assert_stage3_equals_stage2_equals_reference, assert_tree_close

STEPS = 3
BATCH = 16
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def make_params():
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.4).astype(np.float32)
  # Uneven leaves: padded along their best dimension; a scalar stays replicated.
  return {"emb": f(37, 6), "w": f(6, 7), "b": f(7), "head": f(7, 5), "hb": f(5),
          "temp": np.float32(0.8), "ids": np.arange(5, dtype=np.int32)}


def loss_fn(p, b):
  h = jnp.tanh(p["emb"][b["tok"]] @ p["w"] + p["b"])
  logits = (h @ p["head"] + p["hb"]) * p["temp"] + 0.01 * p["ids"].astype(jnp.float32)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]))


def make_batches():
  r = np.random.default_rng(1)
  return [{"tok": r.integers(0, 37, size=(BATCH,)).astype(np.int32),
           "y": r.integers(0, 5, size=(BATCH,)).astype(np.int32)} for _ in range(STEPS)]



@pytest.fixture(scope="module")
def batches():
  return make_batches()


def run(mesh, batches, opt_name, stage):
  step = zj.make_sharded_train_step(loss_fn, OPTIMIZERS[opt_name](), mesh=mesh, stage=stage)
  state = step.init(make_params())
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(m["loss"])
  return step, state, losses


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_stage3_equals_stage2_equals_single_device(mesh, batches, opt_name):
  assert_stage3_equals_stage2_equals_reference(
      run(mesh, batches, opt_name, 3), run(mesh, batches, opt_name, 2),
      loss_fn, OPTIMIZERS[opt_name](), make_params(), batches)


def test_stage3_params_are_padded_blocks_at_rest_and_get_params_is_full(mesh, batches):
  step, state, _ = run(mesh, batches[:1], "adam", 3)
  init = make_params()
  for x, l in zip(jax.tree.leaves(state.params), state.meta.param_layouts):
    assert x.shape == l.storage_shape
    assert x.sharding.spec == l.spec("data") or (l.dim is None and not any(x.sharding.spec))
    shard = x.addressable_shards[0].data
    expect = list(l.storage_shape)
    if l.dim is not None:
      expect[l.dim] //= N
    assert shard.shape == tuple(expect)
  full = step.get_params(state)
  chex.assert_trees_all_equal_shapes_and_dtypes(full, init)   # and the same tree structure
  assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(full))
  np.testing.assert_array_equal(full["ids"], init["ids"])


# ------------------------------------------------------------- re-gathering
def regularised_loss(p, b):
  # The squared-norm terms make every parameter needed by the backward pass, through
  # a value derived from it (2 * w); w2 is used through its transpose.
  h = jnp.tanh(b["x"] @ p["w1"])
  reg = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))
  return jnp.mean((h @ p["w2"].T + p["b2"] - b["y"]) ** 2) + 1e-3 * reg


def lowered_gathers(mesh, k, params, bucket_bytes=0):
  step = zj.make_sharded_train_step(regularised_loss, optax.sgd(0.1), mesh=mesh, stage=3,
                                    grad_accum_steps=k, bucket_bytes=bucket_bytes)
  state = step.init(params)
  r = np.random.default_rng(0)
  batch = {"x": r.normal(size=(16, 5)).astype(np.float32),
           "y": r.normal(size=(16, 3)).astype(np.float32)}
  text = step.lower(state, batch).as_text()
  return text.count("stablehlo.all_gather"), text.count("stablehlo.optimization_barrier")


@pytest.mark.parametrize("k", [1, 2])
def test_stage3_gathers_each_param_again_for_the_backward_pass(mesh, k):
  r = np.random.default_rng(0)
  # (5, 9), (3, 9) and (3,) are all padded on 8 devices.
  params = {"w1": r.normal(size=(5, 9)).astype(np.float32),
            "w2": r.normal(size=(3, 9)).astype(np.float32),
            "b2": r.normal(size=(3,)).astype(np.float32)}
  gathers, barriers = lowered_gathers(mesh, k, params)
  # Forward + backward, per micro-batch: with k=2 the first micro-batch runs before the
  # scan and the loop body holds the second, so each is traced twice.
  assert gathers == 2 * 3 * min(k, 2), gathers
  assert barriers >= min(k, 2)
  # Small leaves bucketed: one gather (and re-gather) for the three of them.
  gathers, _ = lowered_gathers(mesh, k, params, bucket_bytes=2**20)
  assert gathers == 2 * 1 * min(k, 2), gathers


# ---------------------------------------------------------------- complex values
def fft_loss(p, b):
  h = jnp.fft.rfft(b["x"] @ p["w"], axis=-1) * p["f"]  # complex activations of real params
  return jnp.mean((jnp.fft.irfft(h, n=8, axis=-1)[:, :3] - b["y"]) ** 2)


def complex_param_loss(p, b):
  pred = (b["x"].astype(jnp.complex64) @ p["c"]).real + p["b"]
  return jnp.mean((pred[:, :3] - b["y"]) ** 2)


COMPLEX_CASES = {
    "fft-activations": (fft_loss, lambda r: {"w": r.normal(size=(5, 8)) * 0.4,
                                             "f": r.normal(size=(5,))}),
    "complex-params": (complex_param_loss,
                       lambda r: {"c": r.normal(size=(5, 9)) * 0.4 + 1j * r.normal(size=(5, 9)),
                                  "b": r.normal(size=(9,))}),
}


@pytest.mark.parametrize("case", sorted(COMPLEX_CASES))
def test_stage3_with_complex_values_equals_stage2_equals_single_device(mesh, case):
  """The re-gather policy saves no complex value (JAX's remat cannot round one): it is
  recomputed in the backward pass, and training is stage 2's and plain optax's."""
  loss, make = COMPLEX_CASES[case]
  r = np.random.default_rng(0)
  params = {k: v.astype(np.complex64 if np.iscomplexobj(v) else np.float32)
            for k, v in make(r).items()}
  bs = [{"x": r.normal(size=(16, 5)).astype(np.float32),
         "y": r.normal(size=(16, 3)).astype(np.float32)} for _ in range(STEPS)]

  @jax.jit
  def one(p, s, b):  # plain optax on one device, every leaf trained (complex included)
    u, s = optax.adam(1e-2).update(jax.grad(loss)(p, b), s, p)
    return optax.apply_updates(p, u), s
  ref = jax.tree.map(jnp.asarray, params)
  opt_state = optax.adam(1e-2).init(ref)
  for b in bs:
    ref, opt_state = one(ref, opt_state, b)
  got = {}
  for stage in (2, 3):
    step = zj.make_sharded_train_step(loss, optax.adam(1e-2), mesh=mesh, stage=stage)
    state = step.init(params)
    for b in bs:
      state, _ = step(state, b)
    got[stage] = step.get_params(state)
  assert_tree_close(got[3], got[2], rtol=1e-6, what="stage 3 vs 2")
  assert_tree_close(got[3], ref, what="stage 3 vs reference")


# ----------------------------------------------------------------- gather_once
@pytest.mark.parametrize("accumulate", ["sharded", "local"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_gather_once_equals_the_single_device_reference_with_accumulation(
    mesh, batches, opt_name, accumulate):
  from _feature_helpers import assert_tree_close, reference_run
  step = zj.make_sharded_train_step(loss_fn, OPTIMIZERS[opt_name](), mesh=mesh, stage=3,
                                    grad_accum_steps=2, gather_once=True,
                                    accumulate=accumulate)
  state = step.init(make_params())
  for b in batches:
    state, _ = step(state, b)
  ref, _, _ = reference_run(loss_fn, OPTIMIZERS[opt_name](), make_params(), batches)
  assert_tree_close(step.get_params(state), ref[-1], what="gather_once ")
  assert state.params["w"].sharding.spec != jax.sharding.PartitionSpec()  # still 1/N at rest


def test_gather_once_asks_for_one_gather_per_step_not_two_per_micro_batch(mesh, batches):
  # Counted in the lowered program (XLA:CPU hoists loop-invariant gathers out of the
  # micro-batch loop by itself; other backends need not).
  counts = {}
  for once in (False, True):
    step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=3,
                                      grad_accum_steps=2, gather_once=once)
    text = step.lower(step.init(make_params()), batches[0]).as_text()
    counts[once] = text.count("stablehlo.all_gather")
  # Per micro-batch a forward gather and a backward re-gather of the trainable bucket,
  # traced for the first micro-batch and for the loop body; once per step: one gather
  # of each bucket (trainable floats, frozen ints).
  assert counts[True] == 2 and counts[False] >= 2 * counts[True], counts


def test_error_gather_once_below_stage_three(mesh):
  with pytest.raises(ValueError, match=r"gather_once=True.*stage 2.*stage=3"):
    zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=2, gather_once=True)
