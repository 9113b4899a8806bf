"""Row lookups on the split table at stage 3: ``lookup=`` and ``zj.take``.

A small language-model-like loss (an embedding table of 37 rows x 16 features, a dense
layer, an untied or tied output) trained at stage 3 with ``lookup=`` must give what a
single-device optax step gives (plain SGD, which shows a gradient summed twice, and Adam),
on 8 devices and on a (2, 4) mesh with a replica axis or hpZ; and the compiled step must move
only looked-up rows, never the whole table, when the table is only looked up.

Tolerances (fp32): every value is a sum of at most 16 x 6 x 37 products in another order
than the reference's; with unit roundoff u = 2**-24 and values O(1), relative differences of
a few hundred u (1e-5) bound it with a margin, as `_feature_helpers.RTOL` says.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zero_jax as zj
from _feature_helpers import assert_tree_close, collectives, reference_run, shapes_in

V, D, T, BATCH, STEPS = 37, 16, 6, 16, 3
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(1e-2)}
LOOKUP = {"embed": True, "w": False, "b": False, "head": False}


def make_params(d=D):
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.5).astype(np.float32)
  return {"embed": f(V, d), "w": f(d, d), "b": f(d), "head": f(d, V)}


def make_batches(n=STEPS, every_row=False):
  r = np.random.default_rng(1)
  out = []
  for _ in range(n):
    ids = r.integers(0, V, size=(BATCH, T)).astype(np.int32)
    if every_row:  # every row looked up, and rows repeated many times
      ids.reshape(-1)[:V] = np.arange(V)
      ids[:, -1] = 3
    out.append({"ids": ids, "y": r.integers(0, V, size=(BATCH, T)).astype(np.int32)})
  return out


def untied_loss(p, b):
  h = zj.take(p["embed"], b["ids"])                 # [B, T, D]
  h = jnp.tanh(h @ p["w"] + p["b"])
  logits = h @ p["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def tied_loss(p, b):
  table = zj.gather(p["embed"])                     # the whole table, for the logits
  h = jnp.tanh(zj.take(p["embed"], b["ids"]) @ p["w"] + p["b"])
  logits = h @ table.T + 0.0 * p["head"].sum()
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def train(loss_fn, opt, batches, *, mesh_shape=(8,), axes=("data",), params=None, **kw):
  mesh = jax.make_mesh(mesh_shape, axes)
  kw.setdefault("axis_name", axes[-1] if len(axes) > 1 else axes[0])
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, **kw)
  state = step.init(make_params() if params is None else params)
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return step, state, losses


HOSTS = {"mesh_shape": (2, 4), "axes": ("host", "data"), "axis_name": ("host", "data")}
LAYOUTS = {
    "s3": {},
    "s3_replica": {"mesh_shape": (2, 4), "axes": ("replica", "data"), "replica_axis": "replica"},
    "s3_hpz": {**HOSTS, "hpz_axis": "data"},
    "s3_two_axes": HOSTS,
    "s3_accum": {"grad_accum_steps": 2},
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("loss_fn", [untied_loss, tied_loss], ids=["untied", "tied"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_stage3_lookup_equals_single_device_reference(name, loss_fn, opt):
  batches = make_batches(every_row=True)
  step, state, losses = train(loss_fn, OPTIMIZERS[opt](), batches, stage=3, lookup=LOOKUP,
                              **LAYOUTS[name])
  ref, ref_losses, _ = reference_run(loss_fn, OPTIMIZERS[opt](), make_params(), batches)
  assert_tree_close(step.get_params(state), ref[-1], what=f"{name} {opt}")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
