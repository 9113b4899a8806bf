"""Buckets: small leaves share one reduce-scatter / all-gather; results are unchanged.

Bucketed (the default) and unbucketed (``bucket_bytes=0``) steps both equal the
single-device reference; a model of many small leaves compiles to a handful of
collectives instead of one per leaf; one device needs none.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import zero_jax as zj
from _feature_helpers import assert_tree_close, collectives, reference_run
from _small_mlp import init_params, loss_fn
from zero_jax.comm.collectives import plan_buckets
from zero_jax.comm.layout import leaf_layout

STEPS = 4
OPTS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def batches(n=STEPS, rows=16):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(rows, 9)).astype(np.float32),
           "y": r.normal(size=(rows, 5)).astype(np.float32)} for _ in range(n)]


def run(mesh, bs, **kw):
  step = zj.make_sharded_train_step(loss_fn, kw.pop("opt"), mesh=mesh, **kw)
  state = step.init(init_params())
  for b in bs:
    state, _ = step(state, b)
  return step.get_params(state)


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bucketed_and_unbucketed_steps_equal_the_single_device_reference(stage, opt, mesh):
  bs = batches()
  ref, _, _ = reference_run(loss_fn, OPTS[opt](), init_params(), bs)
  for bucket_bytes in (0, 2**20):
    got = run(mesh, bs, opt=OPTS[opt](), stage=stage, bucket_bytes=bucket_bytes)
    assert_tree_close(got, ref[-1], what=f"bucket_bytes={bucket_bytes} ")


def test_bucketed_bf16_wire_equals_the_unbucketed_one(mesh):
  bs = batches()
  a, b = (run(mesh, bs, opt=optax.adam(1e-2), comm_dtype=jnp.bfloat16, bucket_bytes=bb)
          for bb in (0, 2**20))
  assert_tree_close(a, b, rtol=1e-6, atol=1e-7)


def many_leaves(layers=12, width=32):
  """Each layer: a weight, a bias and two per-feature vectors (a norm's scale and shift)."""
  r = np.random.default_rng(0)
  return {f"l{i:02d}": {"w": (r.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
                        "b": np.zeros(width, np.float32), "g": np.ones(width, np.float32),
                        "s": np.zeros(width, np.float32)} for i in range(layers)}


def many_loss(p, b):
  h = b["x"]
  for name in sorted(p):
    h = h @ p[name]["w"] + p[name]["b"]
    h = jax.nn.gelu((h - h.mean(-1, keepdims=True)) * p[name]["g"] + p[name]["s"])
  return jnp.mean((h - b["y"]) ** 2)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_many_leaf_model_compiles_to_a_handful_of_collectives(stage, mesh):
  params = many_leaves()  # 48 leaves
  b = {"x": np.ones((16, 32), np.float32), "y": np.ones((16, 32), np.float32)}
  counts = {}
  for bucket_bytes in (0, zj.make_sharded_train_step.__kwdefaults__["bucket_bytes"]):
    step = zj.make_sharded_train_step(many_loss, optax.adamw(1e-3), mesh=mesh, stage=stage,
                                      bucket_bytes=bucket_bytes)
    hlo = step.lower(step.init(params), b).compile().as_text()
    ops = [c[0] for c in collectives(hlo)]
    counts[bucket_bytes] = (ops.count("reduce-scatter"), ops.count("all-gather"))
  per_leaf, bucketed = counts.values()
  assert per_leaf[0] >= 48 and per_leaf[1] >= 48, counts
  assert bucketed[0] <= 3 and bucketed[1] <= 3 * (1 if stage == 2 else 2), counts


def test_plan_puts_small_leaves_of_one_dtype_together_and_large_ones_alone():
  n = 8
  shapes = [(9, 7), (5,), (64, 64), (3,), (), (7,)]
  dtypes = [jnp.float32, jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32, jnp.float32]
  layouts = [leaf_layout(s, n) for s in shapes]
  model = leaf_layout((8, 16), n, model=((), ("model",)), model_size=(1, 2))
  groups = plan_buckets(layouts + [model], dtypes + [jnp.float32], bucket_bytes=1024)
  # (64, 64) f32 is 16 KiB: alone; the scalar is replicated: alone; the model-split leaf
  # alone; the bf16 leaf in its own bucket; the small f32 leaves share one.
  assert sorted(groups) == sorted([(0, 1, 5), (2,), (3,), (4,), (6,)]), groups
  assert plan_buckets(layouts, dtypes, bucket_bytes=0) == tuple((i,) for i in range(6))
  # A full bucket starts a new one.
  assert len(plan_buckets([leaf_layout((64,), n)] * 5, [jnp.float32] * 5, bucket_bytes=600)) == 3


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_device_step_has_no_gradient_or_parameter_collectives(stage):
  mesh1 = Mesh(np.array(jax.devices()[:1]), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh1, stage=stage)
  hlo = step.lower(step.init(init_params()), batches(1)[0]).compile().as_text()
  big = [c for c in collectives(hlo) if c[0] in ("reduce-scatter", "all-gather")]
  assert big == [], big
