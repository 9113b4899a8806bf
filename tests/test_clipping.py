"""Global-norm clipping when each device holds a slice, against optax on one device.

`zj.global_norm` / `zj.clip_by_global_norm` are checked alone (with and without
``axis_name``, inside our own ``jax.shard_map`` on zero-padded slices plus a
replicated leaf) and inside the step (``max_grad_norm=``), where the reported
norm must be that of the averaged, unscaled gradient of the whole batch and the
update must be ``optax.clip_by_global_norm`` followed by SGD on one device.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import zero_jax as zj
from zero_jax.comm import layout
from _small_mlp import init_params, loss_fn

N = 8
LR = 0.1
MAX_NORM = 2.5
STEPS = 4


def full_tree():
  """Uneven leaves (all padded on 8 devices) and a scalar."""
  r = np.random.default_rng(3)
  return {"w": r.normal(size=(9, 7)).astype(np.float32), "b": r.normal(size=(5,)).astype(np.float32),
          "s": np.float32(-1.75), "v": r.normal(size=(3,)).astype(np.float32)}


def optax_clip(tree, max_norm):
  return optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())[0]


@pytest.mark.parametrize("max_norm", [1.0, 100.0])  # clipping, and a no-op
def test_outside_shard_map_equals_optax(max_norm):
  tree = full_tree()
  norm = zj.global_norm(tree)
  np.testing.assert_allclose(norm, optax.tree.norm(tree), rtol=1e-6)
  clipped, norm2 = jax.jit(zj.clip_by_global_norm, static_argnums=1)(tree, max_norm)
  assert float(norm2) == float(norm)
  want = optax_clip(tree, max_norm)
  for k in tree:
    np.testing.assert_allclose(clipped[k], want[k], rtol=1e-6, atol=1e-7)
  if max_norm > norm:
    for k in tree:  # a no-op is exact
      np.testing.assert_array_equal(clipped[k], tree[k])


@functools.lru_cache(maxsize=None)
def sharded_norm_fn(max_norm):
  """w, b, s as each device's zero-padded block (layout.py); v replicated."""
  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  lays = {k: layout.leaf_layout(np.shape(x), N) for k, x in full_tree().items() if k != "v"}

  def body(blocks, v):
    tree = dict(blocks, v=v)
    clipped, norm = zj.clip_by_global_norm(tree, max_norm, axis_name="data")
    return clipped, norm, zj.global_norm(tree, axis_name="data")

  specs = {k: l.spec("data") for k, l in lays.items()}
  out_specs = ((dict(specs, v=P())), P(), P())  # out P(): every device has one norm
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=out_specs))

  def run(tree):
    blocks = {k: layout.pad(jnp.asarray(tree[k]), l) for k, l in lays.items()}
    clipped, norm, norm2 = fn(blocks, tree["v"])
    clipped = dict({k: layout.unpad(clipped[k], l) for k, l in lays.items()}, v=clipped["v"])
    return clipped, norm, norm2, blocks
  return run


@pytest.mark.parametrize("max_norm", [1.0, 100.0])
def test_in_shard_map_each_element_counted_once(max_norm):
  tree = full_tree()
  clipped, norm, norm2, blocks = sharded_norm_fn(max_norm)(tree)
  assert blocks["w"].shape == (9, 8) and blocks["b"].shape == (8,)  # zero padding present
  assert blocks["s"].shape == ()  # replicated scalar: counted once, not N times
  want = optax.tree.norm(tree)
  np.testing.assert_allclose(norm, want, rtol=1e-6)
  np.testing.assert_allclose(norm2, want, rtol=1e-6)
  assert {float(s.data) for s in norm.addressable_shards} == {float(norm)}
  want_clipped = optax_clip(tree, max_norm)
  for k in tree:
    np.testing.assert_allclose(clipped[k], want_clipped[k], rtol=1e-6, atol=1e-7)


def test_in_shard_map_without_vma_tracking_raises():
  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  fn = jax.shard_map(lambda x: zj.global_norm({"x": x}, axis_name="data"), mesh=mesh,
                     in_specs=P("data"), out_specs=P(), check_vma=False)
  with pytest.raises(ValueError, match="check_vma"):
    jax.jit(fn)(jnp.ones(16))


# ----------------------------------------------------------------- in the step




BATCHES = [{"x": np.random.default_rng(10 + i).normal(size=(16, 9)).astype(np.float32),
            "y": np.random.default_rng(20 + i).normal(size=(16, 5)).astype(np.float32)}
           for i in range(STEPS)]


@functools.lru_cache(maxsize=None)
def reference():
  """One device: the gradient's optax norm, then clip_by_global_norm + SGD."""
  opt = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.sgd(LR))

  @jax.jit
  def one(p, opt_state, batch):
    g = jax.grad(loss_fn)(p, batch)
    updates, opt_state = opt.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, optax.tree.norm(g)

  p = jax.tree.map(jnp.asarray, init_params())
  opt_state, out = opt.init(p), []
  for batch in BATCHES:
    p, opt_state, norm = one(p, opt_state, batch)
    out.append((jax.device_get(p), float(norm)))
  return out


@pytest.mark.parametrize("stage,loss_scale", [(1, None), (2, 2.0**10), (3, None)])
def test_step_clips_by_global_norm_of_averaged_unscaled_gradient(stage, loss_scale):
  mesh = jax.make_mesh((N,), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(LR), mesh=mesh, stage=stage,
                                    max_grad_norm=MAX_NORM, loss_scale=loss_scale)
  state = step.init(init_params())
  clipped = []
  for batch, (want_params, want_norm) in zip(BATCHES, reference()):
    state, m = step(state, batch)
    # The norm before clipping, of the whole batch's mean gradient, unscaled.
    np.testing.assert_allclose(m["grad_norm"], want_norm, rtol=1e-6)
    assert float(m["loss_scale"]) == (loss_scale or 1.0)
    clipped.append(want_norm > MAX_NORM)
    got = step.get_params(state)
    for k in want_params:  # fp32 sums in another order: a few ulps
      np.testing.assert_allclose(got[k], want_params[k], rtol=1e-6, atol=1e-7, err_msg=k)
  assert any(clipped) and not all(clipped)  # both branches ran
