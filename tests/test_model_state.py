"""Untrained model state (Flax BatchNorm ``batch_stats``) and per-step PRNG keys.

With ``init(params, model_state=...)`` the loss gets ``model_state=`` and
returns the new one; each device computes it from its own examples (its own
batch statistics), micro-batches chain it, and the step averages it over
devices. The reference computes the statistics the same way on one device:
the global batch split into 8 parts (and each part into k micro-batches, run
in order), each part's loss, gradient and new statistics computed with the
same parameters, then averaged.
"""

import contextlib
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import N, assert_tree_close

STEPS = 3
BATCH = 128


class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    # No bias before BatchNorm: its gradient is exactly zero, and Adam would turn the
    # rounding noise in it into full-size steps.
    x = nn.Dense(7, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
    return nn.Dense(3)(nn.relu(x))


BN = BNNet()


def bn_loss(params, batch, *, model_state):
  out, new = BN.apply({"params": params, "batch_stats": model_state}, batch["x"], train=True,
                      mutable=["batch_stats"])
  return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]


def bn_init():
  v = BN.init(jax.random.key(0), jnp.zeros((1, 5)), train=False)
  return v["params"], v["batch_stats"]


def make_batches(n=STEPS, size=BATCH):
  r = np.random.default_rng(1)
  # Shifted and scaled inputs so that the batch statistics differ from the initial ones.
  return [{"x": (r.normal(size=(size, 5)) * 2 + 1).astype(np.float32),
           "y": r.normal(size=(size, 3)).astype(np.float32)} for _ in range(n)]


def reference_bn(optimizer, params, stats, batches, k):
  """Per-device statistics averaged over devices, computed on one device."""
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, stats, opt_state, batch):
    grads, losses, new_stats = [], [], []
    for d in range(N):
      part = jax.tree.map(lambda x: jnp.split(x, N)[d], batch)
      ms = stats
      for j in range(k):  # the micro-batches of one device run in order
        micro = jax.tree.map(lambda x: jnp.split(x, k)[j], part)
        (loss, ms), g = jax.value_and_grad(bn_loss, has_aux=True)(params, micro, model_state=ms)
        grads.append(g)
        losses.append(loss)
      new_stats.append(ms)
    mean = lambda trees: jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)
    updates, opt_state = optimizer.update(mean(grads), opt_state, params)
    return optax.apply_updates(params, updates), mean(new_stats), opt_state, mean(losses)

  out = []
  for b in batches:
    params, stats, opt_state, loss = step(params, stats, opt_state, b)
    out.append((params, stats, loss))
  return out



@pytest.mark.parametrize("stage,k,accumulate,opt", [
    (2, 1, None, "adam"), (1, 2, "local", "sgd"), (3, 2, "sharded", "adam")])
def test_batchnorm_params_and_stats_match_per_device_statistics_reference(mesh, stage, k,
                                                                          accumulate, opt):
  optimizer = {"sgd": optax.sgd(0.1), "adam": optax.adam(1e-2)}[opt]
  params, stats = bn_init()
  batches = make_batches()
  step = zj.make_sharded_train_step(bn_loss, optimizer, mesh=mesh, stage=stage,
                                    grad_accum_steps=k, accumulate=accumulate)
  state = step.init(params, model_state=stats)
  ref = reference_bn(optimizer, params, stats, batches, k)
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    ref_params, ref_stats, ref_loss = ref[i]
    assert_tree_close(step.get_params(state), ref_params, what=f"step {i} params")
    assert_tree_close(state.model_state, ref_stats, what=f"step {i} batch_stats")
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
  # Statistics of the whole batch would differ from the per-device average: the
  # reference is not trivially satisfied.
  _, whole = bn_loss(params, batches[0], model_state=stats)
  assert not np.allclose(whole["BatchNorm_0"]["var"], ref[0][1]["BatchNorm_0"]["var"], rtol=1e-3)


class BNDropNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.Dense(32)(x))
    x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Dropout(0.2, deterministic=not train)(x)
    return nn.Dense(1)(x)


BND = BNDropNet()


def bnd_loss(params, batch, *, model_state, rng):
  out, new = BND.apply({"params": params, "batch_stats": model_state}, batch["x"], train=True,
                       mutable=["batch_stats"], rngs={"dropout": rng})
  return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]


def test_batchnorm_dropout_model_trains(mesh):
  r = np.random.default_rng(0)
  x = r.normal(size=(64, 4)).astype(np.float32)
  batch = {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True)).astype(np.float32)}
  v = BND.init(jax.random.PRNGKey(0), x[:2], train=False)
  step = zj.make_sharded_train_step(bnd_loss, optax.adam(1e-2), mesh=mesh, grad_accum_steps=2)
  state = step.init(v["params"], model_state=v["batch_stats"], rng=jax.random.PRNGKey(1))
  losses = []
  for _ in range(25):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.5 * losses[0], losses
  stats = state.model_state["BatchNorm_0"]
  assert not np.allclose(stats["mean"], v["batch_stats"]["BatchNorm_0"]["mean"])
  # Evaluation mode with the learnt statistics fits the data too.
  out = BND.apply({"params": step.get_params(state), "batch_stats": state.model_state}, x,
                  train=False)
  assert np.mean((out - batch["y"]) ** 2) < 0.5 * losses[0]


# ---------------------------------------------------------------- PRNG keys
def key_loss(p, b, *, rng):
  # Linear in w: the gradient for example i is x_i * u, with u drawn from the key of
  # the micro-batch that holds example i.
  return jnp.mean(b["x"] @ p["w"]) * jax.random.uniform(rng)


def drawn_uniforms(mesh, rng, steps=2, stage=2):
  """The uniform each example's micro-batch drew, per step (SGD with lr 1 reveals it)."""
  k, size = 2, 2 * N  # one example per micro-batch
  step = zj.make_sharded_train_step(key_loss, optax.sgd(1.0), mesh=mesh, grad_accum_steps=k,
                                    stage=stage)
  state = step.init({"w": np.zeros(size, np.float32)}, rng=rng)
  batch = {"x": np.eye(size, dtype=np.float32)}
  w, out = np.zeros(size, np.float32), []
  for _ in range(steps):
    state, _ = step(state, batch)
    w_new = np.asarray(step.get_params(state)["w"])
    out.append((w - w_new) * size)
    w = w_new
  return np.stack(out)


def test_keys_differ_per_device_micro_batch_and_step(mesh):
  u = drawn_uniforms(mesh, jax.random.key(3))
  assert u.shape == (2, 2 * N) and np.all((u > 0) & (u < 1))
  assert len(np.unique(u)) == u.size, u  # 8 devices x 2 micro-batches x 2 steps
  # Deterministic given the state's key, different for another key.
  np.testing.assert_array_equal(u, drawn_uniforms(mesh, jax.random.key(3)))
  assert not np.any(np.isclose(u, drawn_uniforms(mesh, jax.random.key(4))))


# ------------------------------------- model state with aux, int leaves, k > 1
def counting_loss(p, b, *, model_state):
  err = b["x"] @ p["w"] - b["y"]
  new = {"seen": model_state["seen"] + b["x"].shape[0],
         "ema": 0.5 * model_state["ema"] + 0.5 * jnp.mean(b["x"], axis=0)}
  return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err))}, new


def test_model_state_with_aux_int_leaves_and_micro_batches(mesh):
  r = np.random.default_rng(0)
  batch = {"x": r.normal(size=(32, 3)).astype(np.float32),
           "y": r.normal(size=(32,)).astype(np.float32)}
  step = zj.make_sharded_train_step(counting_loss, optax.sgd(0.1), mesh=mesh, has_aux=True,
                                    grad_accum_steps=2)
  ms = {"seen": np.int32(0), "ema": np.zeros(3, np.float32)}
  state = step.init({"w": np.zeros(3, np.float32)}, model_state=ms)
  state, metrics = step(state, batch)
  assert state.model_state["seen"].dtype == jnp.int32
  assert int(state.model_state["seen"]) == 4  # 2 micro-batches of 2 examples per device
  parts = batch["x"].reshape(N, 2, 2, 3).mean(axis=2)  # device, micro-batch, feature
  ema = (0.25 * parts[:, 0] + 0.5 * parts[:, 1]).mean(axis=0)
  np.testing.assert_allclose(state.model_state["ema"], ema, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(metrics["aux"]["mae"], np.mean(np.abs(batch["y"])), rtol=1e-5)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("has_aux,ret,needle", [
    (False, lambda loss, ms: loss, "(loss, new_model_state)"),
    (True, lambda loss, ms: (loss, ms), "(loss, aux, new_model_state)"),
    (False, lambda loss, ms: (loss, ms, ms), "(loss, new_model_state)"),
    (False, lambda loss, ms: (loss, {"other": ms["seen"]}), "structure"),
])
def test_error_loss_fn_returns_the_wrong_tuple_with_model_state(mesh, has_aux, ret, needle):
  def loss_fn(p, b, *, model_state):
    return ret(jnp.mean(b @ p["w"]), model_state)
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, has_aux=has_aux)
  state = step.init({"w": np.zeros(3, np.float32)}, model_state={"seen": np.int32(0)})
  with pytest.raises(TypeError) as e:
    step(state, np.ones((8, 3), np.float32))
  assert needle in str(e.value)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_skipped_step_leaves_the_model_state_bit_for_bit(mesh, precision):
  params, stats = bn_init()
  step = zj.make_sharded_train_step(bn_loss, optax.adam(1e-2), mesh=mesh, precision=precision)
  state, _ = step(step.init(params, model_state=stats), make_batches(1)[0])
  before = jax.tree.map(np.asarray, state.model_state)
  bad = make_batches(1)[0]
  bad["x"][3, 0] = np.inf  # non-finite statistics and gradients on one device
  skipped = contextlib.nullcontext() if precision == "fp16" else pytest.warns(  # fp16: by design
      RuntimeWarning, match=r"step 1 was skipped because both the loss and the gradient")
  with skipped:
    state, m = step(state, bad)
    assert not bool(m["grads_finite"])
    step.get_params(state)  # delivered here at the latest
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.model_state), before)
  state, m = step(state, make_batches(2)[1])  # and the next good step updates them again
  assert bool(m["grads_finite"])
  assert any(not np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(jax.tree.map(np.asarray, state.model_state)), jax.tree.leaves(before)))
