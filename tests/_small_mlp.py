"""A tiny MLP whose leaves all need padding on 8 devices, plus a replicated scalar."""

import jax.numpy as jnp
import numpy as np


def init_params():
  r = np.random.default_rng(0)
  return {"w1": (r.normal(size=(9, 7)) * 0.5).astype(np.float32), "b1": np.zeros(7, np.float32),
          "w2": (r.normal(size=(7, 5)) * 0.5).astype(np.float32),
          "b2": np.full(5, 0.1, np.float32), "s": np.float32(1.5)}


def loss_fn(p, batch):
  """Computes in the params' dtype (as a mixed-precision model does); loss in fp32."""
  dt = p["w1"].dtype
  h = jnp.tanh(batch["x"].astype(dt) @ p["w1"] + p["b1"])
  out = (h @ p["w2"] + p["b2"]) * p["s"]
  return jnp.mean(jnp.square(out - batch["y"].astype(dt)).astype(jnp.float32))
