"""A small stacked model for the forward-pass tests (tests/test_evaluate.py, test_apply.py).

Every leaf needs padding on 8 devices (widths 5, 7, 3); the layers are a stacked
(L, 7, 7) kernel and (L, 7) bias looped with `zero_jax.scan`, which outside the step (the
single-device references) is ``jax.lax.scan``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zero_jax as zj

D_IN, WIDTH, D_OUT, ROWS = 5, 7, 3, 16
STACKED = {"w_in": False, "layers": True, "w_out": False}
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
STEPS = 3


def init_params(layers=4, seed=0):
  r = np.random.default_rng(seed)
  n = lambda *s: (r.normal(size=s) / np.sqrt(s[-2] if len(s) > 1 else 1)).astype(np.float32)
  return {"w_in": n(D_IN, WIDTH), "layers": {"w": n(layers, WIDTH, WIDTH),
                                              "b": n(layers, WIDTH) * 0.1},
          "w_out": n(WIDTH, D_OUT)}


def batch(t=0, rows=ROWS):
  r = np.random.default_rng(100 + t)
  mask = (r.uniform(size=rows) < 0.7).astype(np.float32)
  mask[0] = 1.0
  return {"x": r.normal(size=(rows, D_IN)).astype(np.float32),
          "y": r.normal(size=(rows, D_OUT)).astype(np.float32), "mask": mask}


def forward(p, x, prefetch=1):
  """Logits: the layers looped with zj.scan (one layer gathered at a time at stage 3)."""
  dt = p["w_in"].dtype
  layer = lambda h, lp: (jnp.tanh(h @ lp["w"] + lp["b"]), None)
  h, _ = zj.scan(layer, x.astype(dt) @ p["w_in"], p["layers"], prefetch=prefetch)
  return h @ p["w_out"]


def per_example(p, b, prefetch=1):
  return jnp.sum(jnp.square(forward(p, b["x"], prefetch) - b["y"].astype(p["w_in"].dtype))
                 .astype(jnp.float32), axis=-1)


def loss_fn(p, b, prefetch=1):
  return jnp.mean(per_example(p, b, prefetch))


def weighted_loss(p, b):
  """A WeightedLoss with aux: (sum over kept rows) / (kept rows)."""
  e = per_example(p, b)
  aux = {"sq": jnp.mean(e), "kept": jnp.sum(b["mask"] > 0).astype(jnp.int32), "rows": e,
         "any_big": jnp.any(e > 3.0)}
  return zj.WeightedLoss(total=jnp.sum(e * b["mask"]), weight=jnp.sum(b["mask"])), aux


def weighted_reference(p, b):
  """``weighted_loss`` on one device, reduced as the step documents: the weighted mean, and
  each aux leaf as its rule gives it on the whole batch."""
  (w, aux) = weighted_loss(p, b)
  return w.total / w.weight, aux


AUX_REDUCE = {"sq": None, "kept": None, "rows": None, "any_big": "max"}


def make_step(mesh, *, stage, opt="sgd", prefetch=1, fn=None, **kw):
  fn = fn or functools.partial(loss_fn, prefetch=prefetch)
  return zj.make_sharded_train_step(fn, OPTIMIZERS[opt](), mesh=mesh, stage=stage,
                                    stacked=STACKED if stage == 3 else None, **kw)


def trained(step, params=None, steps=STEPS, **init):
  """The state after ``steps`` training steps on batches 1..steps."""
  state = step.init(init_params() if params is None else params, **init)
  for t in range(1, steps + 1):
    state, _ = step(state, batch(t))
  return state


def trained_step(mesh, **kw):
  """``(step, state)``: `make_step`'s step and its state after `trained`."""
  step = make_step(mesh, **kw)
  return step, trained(step)


def host(tree):
  """Numpy copies of every leaf (key data for keys), to compare states bit for bit."""
  data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  return jax.tree.map(lambda x: np.array(data(x)), tree)


def assert_bitwise_equal(a, b):
  """Same structure and every leaf identical, bit for bit (NaNs compared as bits)."""
  la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


# ----------------------------------------------------------------- a deeper one, for memory
def deep_forward(p, x):
  layer = lambda h, lp: (jax.nn.gelu(h @ lp["w"] + lp["b"]), None)
  return zj.scan(layer, x, p)[0]


def deep_loss(p, b):
  return jnp.mean((deep_forward(p, b["x"]) - b["y"]) ** 2)


def deep_compiled(layers, width, what):
  """The compiled program of ``what`` ("step", "evaluate" or "apply") of a stage-3 step over
  ``layers`` stacked (width x width) layers on 8 devices, from abstract shapes (nothing runs)."""
  mesh = jax.make_mesh((8,), ("data",))
  params = {"w": jax.ShapeDtypeStruct((layers, width, width), jnp.float32),
            "b": jax.ShapeDtypeStruct((layers, width), jnp.float32)}
  step = zj.make_sharded_train_step(deep_loss, optax.adam(1e-3), mesh=mesh, stage=3,
                                    stacked=True)
  state = step.abstract_state(params)
  b = {k: jax.ShapeDtypeStruct((32, width), jnp.float32) for k in ("x", "y")}
  if what == "step":
    return step.lower(state, b).compile()
  fn = (step.evaluate if what == "evaluate" else
        lambda s, b: step.apply(s, deep_forward, b["x"]))
  return jax.jit(fn).lower(state, b).compile()
