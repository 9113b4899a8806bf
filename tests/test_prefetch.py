"""`zj.scan`: stacked layers with the next layer gathered while this one computes.

The numbers of ``prefetch=1`` must equal those of ``prefetch=0`` (today's
checkpointed ``lax.scan`` that gathers inside its body) bit for bit where the
order of operations is unchanged, and the single-device optax reference (which
runs the same ``loss_fn``: outside the step ``zj.scan`` is ``lax.scan``), with
SGD and Adam, uneven leaves (12 padded to 16 on 8 devices, a replicated
per-layer gain), a closed-over parameter and 1, 2 and 7 layers, in each
combination the step offers. XLA:CPU runs collectives synchronously, so the
schedule is checked in the compiled program: what each loop carries and where
each collective's operand comes from.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run
from zero_jax.comm import hlo as hlo_lib

W, STEPS = 12, 2
STACKED = {"emb": False, "layers": True, "head": False}


def make_params(layers):
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.4).astype(np.float32)
  return {"emb": f(5, W),
          "layers": {"w": f(layers, W, W), "b": f(layers, W),
                     "gain": (1 + f(layers)).astype(np.float32)},  # (L,): replicated
          "head": f(W, 3)}


def make_loss(prefetch, kind="mean"):
  """The layers close over ``p["emb"]`` (its gradient flows through the closure) and
  emit a per-layer output (ys); ``kind`` picks a mean, weighted or (loss, aux) loss."""
  def loss_fn(p, b):
    def layer(h, lp):
      h = jnp.tanh(h @ lp["w"] + lp["b"] + p["emb"][0]) * lp["gain"]
      return h, jnp.mean(h, axis=-1)
    h, ys = zj.scan(layer, b["x"] @ p["emb"], p["layers"], prefetch=prefetch)
    per_row = jnp.mean((h @ p["head"] - b["y"]) ** 2, axis=-1) + 0.1 * jnp.mean(ys, axis=0)
    if kind == "weighted":
      return zj.WeightedLoss(total=jnp.sum(per_row * b["m"]), weight=jnp.sum(b["m"]))
    return (jnp.mean(per_row), {"rows": per_row}) if kind == "aux" else jnp.mean(per_row)
  return loss_fn


def reference_loss(kind):
  """The single-device loss: a weighted loss is its global ratio."""
  if kind != "weighted":
    return make_loss(0, kind)
  return lambda p, b: (lambda out: out.total / out.weight)(make_loss(0, kind)(p, b))


def make_batches():
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(16, 5)).astype(np.float32),
           "y": r.normal(size=(16, 3)).astype(np.float32),
           "m": (r.random(16) < 0.7).astype(np.float32)} for _ in range(STEPS)]


def run(prefetch, *, layers, opt, mesh_shape=(8,), axes=("data",), kind="mean", **kw):
  mesh = jax.make_mesh(mesh_shape, axes)
  step = zj.make_sharded_train_step(make_loss(prefetch, kind), opt, mesh=mesh,
                                    has_aux=kind == "aux", stacked=STACKED, **kw)
  state, losses = step.init(make_params(layers)), []
  for b in make_batches():
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return step, state, losses


SGD, ADAM = lambda: optax.sgd(0.1), lambda: optax.adam(1e-2)
Q = zj.Quantize(block_size=64)
# name: (layers, optimizer, run options, compare with the reference?, rtol vs prefetch=0: 0
# where the order of operations is unchanged; 1e-6 where a closed-over leaf's gradient is
# summed over layers in another order)
CASES = {
    "s3_sgd_7layers": (7, SGD, {"stage": 3}, True, 0),
    "s3_adam_1layer_offload": (1, ADAM, {"stage": 3, "offload": "optimizer"}, True, 0),
    "s2_sgd_2layers_weighted": (2, SGD, {"stage": 2, "kind": "weighted"}, True, 0),
    "s2_adam_hybrid_accum": (3, ADAM, {"stage": 2, "mesh_shape": (2, 4),
                                       "axes": ("replica", "data"), "replica_axis": "replica",
                                       "grad_accum_steps": 2}, True, 1e-6),
    "s3_sgd_hpz_aux": (2, SGD, {"stage": 3, "mesh_shape": (2, 4), "axes": ("replica", "data"),
                                "axis_name": ("replica", "data"), "hpz_axis": "data",
                                "kind": "aux"}, True, 0),
    "s3_adam_replica_accum": (3, ADAM, {"stage": 3, "mesh_shape": (2, 4),
                                        "axes": ("replica", "data"), "replica_axis": "replica",
                                        "grad_accum_steps": 2}, True, 0),
    "s3_sgd_gather_once": (3, SGD, {"stage": 3, "grad_accum_steps": 2, "gather_once": True},
                           True, 0),
    "s3_sgd_param_specs": (2, SGD, {"stage": 3, "mesh_shape": (4, 2), "axes": ("data", "model"),
                                    "param_specs": {"emb": P(), "head": P(),
                                                    "layers": {"w": P(None, None, "model"),
                                                               "b": P(), "gain": P()}}},
                           True, 0),
    "s3_adam_bf16_qwz_qgz": (2, ADAM, {"stage": 3, "precision": "bf16", "quantize": Q}, False, 0),
    "s3_sgd_fp16": (3, SGD, {"stage": 3, "precision": "fp16",
                             "loss_scale": zj.static_loss_scale(2.0 ** 8)}, False, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_prefetch_equals_no_prefetch_and_the_single_device_reference(case):
  layers, opt, kw, exact, tol = CASES[case]
  step1, state1, losses1 = run(1, layers=layers, opt=opt(), **kw)
  step0, state0, losses0 = run(0, layers=layers, opt=opt(), **kw)
  p1, p0 = step1.get_params(state1), step0.get_params(state0)
  assert_tree_close(p1, p0, rtol=tol, atol=0, what=f"{case}: prefetch 1 vs 0 ")
  assert losses1 == losses0
  if exact:
    kind = kw.get("kind", "mean")
    ref, ref_losses, _ = reference_run(reference_loss(kind), opt(), make_params(layers),
                                       make_batches(), has_aux=kind == "aux")
    assert_tree_close(p1, ref[-1], what=f"{case}: prefetch 1 vs reference ")
    np.testing.assert_allclose(losses1, [float(x) for x in ref_losses], rtol=1e-5)
  else:  # half precision: it trained, and moved every leaf
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), p1, make_params(layers))
    assert min(jax.tree.leaves(moved)) > 0
