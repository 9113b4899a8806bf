"""The model of the whole_leaf_update= tests: three matrices of uneven shapes and a bias."""

import jax.numpy as jnp
import numpy as np
import optax

STEPS = 3


def make_params():
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.4).astype(np.float32)
  # Three matrices; 9 and 20 rows split over 8, 4 and 2 devices with other paddings.
  return {"w1": f(12, 20), "b1": f(20), "w2": f(20, 9), "w3": f(9, 3)}


def loss_fn(p, b):
  h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
  h = jnp.tanh(h @ p["w2"])
  return jnp.mean((h @ p["w3"] - b["y"]) ** 2)


def make_batches(n=STEPS):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(16, 12)).astype(np.float32),
           "y": r.normal(size=(16, 3)).astype(np.float32)} for _ in range(n)]


def is_matrix(path, x):
  del path
  return np.ndim(x) == 2


def assert_rel_close(got, want, rtol=1e-6, what=""):
  for k in want:
    a, b = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
    err = np.max(np.abs(a - b)) / np.max(np.abs(b))
    assert err < rtol, (what, k, err)


def muon(**kw):
  """Two Newton-Schulz iterations instead of five: the same program, a quicker compile."""
  return optax.contrib.muon(1e-2, ns_steps=2, **kw)
