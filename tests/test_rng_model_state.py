"""PRNG keys held as model state: one stream per step, device and micro-batch.

A module may keep its own key as state (here a Linen variable collection
``"rng_state"`` holding a ``jax.random.key``, passed as
``init(params, model_state=...)``). The step treats every key-typed leaf of
the model state as it treats ``rng=``: ``loss_fn`` sees
``fold_in(fold_in(fold_in(key, step), device), micro_batch)``, and the stored
key stays as it was. The references below derive the keys the same way on
one device, device by device and micro-batch by micro-batch.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import N, assert_tree_close

FEATURES, RATE = 32, 0.5  # 32 mask bits per example: no two alike by chance


class KeyedDropout(nn.Module):
  """Dropout drawing from a key the module keeps in the collection "rng_state"."""

  @nn.compact
  def __call__(self, x):
    key = self.variable("rng_state", "key", lambda: self.make_rng("params"))
    keep = jax.random.bernoulli(key.value, 1 - RATE, x.shape)
    return jnp.where(keep, x / (1 - RATE), 0.0)


def device_key(key, step, device, micro):
  """The key the step gives ``loss_fn`` (the README's derivation)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, step), device), micro)


def with_keys(model_state, step, device, micro):
  """The model state as ``loss_fn`` sees it on ``device`` for ``micro``."""
  is_key = lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  return jax.tree.map(lambda x: device_key(x, step, device, micro) if is_key(x) else x,
                      model_state)


def make_loss(model):
  def loss_fn(params, batch, *, model_state):
    out, new = model.apply({"params": params, **model_state}, batch["x"],
                           mutable=["rng_state"])
    return jnp.mean(jnp.sum((out - batch["y"]) ** 2, axis=-1)), new
  return loss_fn


# ------------------------------------------------------- the masks themselves
class MaskProbe(nn.Module):
  """One weight row per example, dropped: SGD's update reveals each example's mask."""
  rows: int

  @nn.compact
  def __call__(self, idx):
    w = self.param("w", nn.initializers.zeros, (self.rows, FEATURES))
    return KeyedDropout()(w[idx])


def test_keys_in_model_state_give_each_device_micro_batch_and_step_its_own_mask(mesh):
  k, rows = 2, 2 * N  # one example per micro-batch
  model = MaskProbe(rows)
  v = model.init(jax.random.key(7), jnp.zeros(1, jnp.int32))
  stored = v["rng_state"]["KeyedDropout_0"]["key"]
  # loss = mean over rows of sum(dropout(w[i])): d loss / d w[i] = keep_i / (1 - RATE) / rows,
  # so SGD with this learning rate moves w[i] by exactly -keep_i.
  loss_fn = lambda p, b, *, model_state: (
      lambda out: (jnp.mean(out[0].sum(-1)), out[1]))(
          model.apply({"params": p, **model_state}, b, mutable=["rng_state"]))
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(rows * (1 - RATE)), mesh=mesh,
                                    grad_accum_steps=k)

  def masks(steps=2):
    state = step.init(v["params"], model_state={"rng_state": v["rng_state"]})
    w, out = np.zeros((rows, FEATURES)), []
    for _ in range(steps):
      state, _ = step(state, np.arange(rows, dtype=np.int32))
      w_new = np.asarray(step.get_params(state)["w"])
      out.append(w - w_new)
      w = w_new
    return np.stack(out), state

  got, state = masks()
  expected = np.stack([[jax.random.bernoulli(device_key(stored, t, i // k, i % k), 1 - RATE,
                                             (1, FEATURES))[0] for i in range(rows)]
                       for t in range(2)])
  np.testing.assert_array_equal(got, expected.astype(np.float64))
  assert len({m.tobytes() for m in got.reshape(-1, FEATURES)}) == got.shape[0] * rows
  np.testing.assert_array_equal(got, masks()[0])  # the same again from the same state
  assert jax.random.key_data(state.model_state["rng_state"]["KeyedDropout_0"]["key"]).tolist() \
      == jax.random.key_data(stored).tolist()  # the stored key is kept


# --------------------------------------------- training against one device
class DropNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(KeyedDropout()(nn.tanh(nn.Dense(16)(x))))


def reference(loss_fn, optimizer, params, model_state, batches, k):
  """Device by device, micro-batch by micro-batch, keys derived as the step derives them."""
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, t, batch):
    grads, losses = [], []
    for d in range(N):
      part = jax.tree.map(lambda x: jnp.split(x, N)[d], batch)
      for j in range(k):
        micro = jax.tree.map(lambda x: jnp.split(x, k)[j], part)
        (loss, _), g = jax.value_and_grad(loss_fn, has_aux=True)(
            params, micro, model_state=with_keys(model_state, t, d, j))
        grads.append(g)
        losses.append(loss)
    mean = lambda trees: jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)
    updates, opt_state = optimizer.update(mean(grads), opt_state, params)
    return optax.apply_updates(params, updates), opt_state, mean(losses)

  losses = []
  for t, b in enumerate(batches):
    params, opt_state, loss = step(params, opt_state, t, b)
    losses.append(float(loss))
  return params, losses


@pytest.mark.parametrize("stage,k", [(2, 2), (3, 1)])
def test_dropout_from_model_state_keys_trains_like_the_single_device_reference(mesh, stage, k):
  r = np.random.default_rng(0)
  batches = [{"x": r.normal(size=(32, 5)).astype(np.float32),
              "y": r.normal(size=(32, 3)).astype(np.float32)} for _ in range(2)]
  v = DropNet().init(jax.random.key(1), batches[0]["x"][:1])
  ms = {"rng_state": v["rng_state"]}
  loss_fn = make_loss(DropNet())
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=stage,
                                    grad_accum_steps=k)
  state = step.init(v["params"], model_state=ms)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  ref_params, ref_losses = reference(loss_fn, optax.adam(1e-2), v["params"], ms, batches, k)
  assert_tree_close(step.get_params(state), ref_params, what=f"stage {stage} k={k}")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_a_key_array_in_model_state_has_each_key_folded(mesh):
  # Two keys (as a scanned model keeps one per layer): each gets its own stream.
  size, k = 2 * N, 2

  def loss_fn(p, b, *, model_state):
    u = jax.vmap(jax.random.uniform)(model_state["keys"])  # (2,)
    return jnp.mean(b @ p["w"] @ u), model_state

  keys = jax.random.split(jax.random.key(5), 2)
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(float(size)), mesh=mesh,
                                    grad_accum_steps=k)
  state = step.init({"w": np.zeros((size, 2), np.float32)}, model_state={"keys": keys})
  state, _ = step(state, np.eye(size, dtype=np.float32))
  got = -np.asarray(step.get_params(state)["w"])  # row i: the uniforms of row i's micro-batch
  expected = [[jax.random.uniform(device_key(keys[c], 0, i // k, i % k)) for c in range(2)]
              for i in range(size)]
  np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-6)


# ------------------------------------------------------------------ errors
def _returns(change):
  def loss_fn(p, b, *, model_state):
    return jnp.mean(b @ p["w"]), change(dict(model_state))
  return loss_fn


@pytest.mark.parametrize("change,match", [
    (lambda ms: {**ms, "ema": ms["ema"].astype(jnp.float16)},
     r"model_state\['ema'\] as float16\[3\]; it was given as float32\[3\].*astype"),
    (lambda ms: {**ms, "key": jax.random.key_data(ms["key"])},
     r"model_state\['key'\] as uint32\[2\]; it was given as key<fry>\[\].*return it unchanged"),
    (lambda ms: {**ms, "ema": jax.random.key(0)},
     r"model_state\['ema'\] as key<fry>\[\]; it was given as float32\[3\]"),
    (lambda ms: {"ema": ms["ema"]}, r"model_state\['key'\] is missing"),
])
def test_a_new_model_state_that_does_not_fit_names_the_leaf(mesh, change, match):
  step = zj.make_sharded_train_step(_returns(change), optax.sgd(0.1), mesh=mesh)
  state = step.init({"w": np.zeros(3, np.float32)},
                    model_state={"ema": np.zeros(3, np.float32), "key": jax.random.key(0)})
  with pytest.raises(TypeError, match=match):
    step(state, np.ones((8, 3), np.float32))


def test_a_model_state_leaf_that_is_not_an_array_is_named_at_init(mesh):
  step = zj.make_sharded_train_step(_returns(lambda ms: ms), optax.sgd(0.1), mesh=mesh)
  with pytest.raises(TypeError, match=r"model_state\['dropout'\]\['mode'\] is a str"):
    step.init({"w": np.zeros(3, np.float32)}, model_state={"dropout": {"mode": "train"}})


@pytest.mark.parametrize("rng,got", [(0, "int 0"), (jnp.zeros((3,), jnp.uint32), r"uint32\[3\]"),
                                     (jax.random.split(jax.random.key(0)), r"key<fry>\[2\]")])
def test_an_rng_that_is_not_one_key_is_refused_at_init(mesh, rng, got):
  step = zj.make_sharded_train_step(lambda p, b, rng: jnp.sum(p["w"] * b), optax.sgd(0.1),
                                    mesh=mesh)
  with pytest.raises(TypeError, match=rf"rng= must be one PRNG key \(jax.random.key\(seed\)\); "
                                      rf"got {got}"):
    step.init({"w": np.zeros(3, np.float32)}, rng=rng)


@pytest.mark.parametrize("key", [jax.random.key(0), jax.random.PRNGKey(0)], ids=["typed", "raw"])
def test_a_typed_or_raw_key_is_accepted(mesh, key):
  step = zj.make_sharded_train_step(
      lambda p, b, rng: jnp.mean((b + jax.random.normal(rng, b.shape)) @ p["w"]), optax.sgd(0.1),
      mesh=mesh)
  _, metrics = step(step.init({"w": np.ones(3, np.float32)}, rng=key), np.ones((8, 3), np.float32))
  assert np.isfinite(float(metrics["loss"]))


def test_a_loss_that_requires_rng_without_one_at_init_says_to_pass_it(mesh):
  step = zj.make_sharded_train_step(lambda p, b, rng: jnp.sum(p["w"] * b), optax.sgd(0.1),
                                    mesh=mesh)
  state = step.init({"w": np.zeros(3, np.float32)})
  with pytest.raises(TypeError, match=r"loss_fn requires rng=, but the state was made without "
                                      r"one.*step.init\(params, rng=jax.random.key\(0\)\)"):
    step(state, np.ones((8, 3), np.float32))
