"""Cross-device BatchNorm: statistics over the whole global batch, as on one device.

Flax's ImageNet ResNet uses ``nn.BatchNorm(axis_name="batch")``: the batch
statistics are ``lax.pmean``-ed over that axis. Inside the step's
``shard_map`` that works when the model names the step's batch axes (a mesh
axis called ``"batch"``, ``axis_name="data"`` in the model, or both axes of
a hybrid mesh as a tuple). Then the statistics, the running averages, the
loss and the gradient (whose cotangents cross devices through the
``pmean``) equal full-batch BatchNorm on one device; the per-device default
(no ``axis_name``) is tested in test_model_state.py.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import assert_tree_close

BATCH, SIZE, CLASSES, STEPS = 32, 6, 5, 3
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


class ConvBN(nn.Module):
  """A ResNet stem in miniature: conv, BatchNorm, relu, pool, classifier."""
  axis_name: str | tuple[str, ...] | None = None

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(4, (3, 3), use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(x)
    x = jnp.mean(nn.relu(x), axis=(1, 2))
    return nn.Dense(CLASSES)(x)


def make_loss(model):
  def loss_fn(params, batch, *, model_state):
    logits, new = model.apply({"params": params, **model_state}, batch["image"],
                              mutable=["batch_stats"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return ce.mean(), new
  return loss_fn


def make_batches(n=STEPS):
  r = np.random.default_rng(1)
  # Rows drawn with a different offset per device block, so that each device's
  # statistics differ from the global ones.
  offset = np.repeat(np.linspace(-2, 2, 8), BATCH // 8)[:, None, None, None]
  return [{"image": (r.normal(size=(BATCH, SIZE, SIZE, 3)) + offset).astype(np.float32),
           "label": r.integers(0, CLASSES, size=BATCH).astype(np.int32)} for _ in range(n)]


def init_variables():
  v = ConvBN().init(jax.random.key(0), jnp.zeros((1, SIZE, SIZE, 3)), train=False)
  return v["params"], {"batch_stats": v["batch_stats"]}


def full_batch_reference(optimizer, batches):
  """One device, BatchNorm over the whole global batch (no axis_name)."""
  params, ms = init_variables()
  loss_fn = make_loss(ConvBN())
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, ms, opt_state, batch):
    (loss, ms), g = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, model_state=ms)
    updates, opt_state = optimizer.update(g, opt_state, params)
    return optax.apply_updates(params, updates), ms, opt_state, loss

  losses = []
  for b in batches:
    params, ms, opt_state, loss = step(params, ms, opt_state, b)
    losses.append(float(loss))
  return params, ms, losses


MESHES = {
    # Flax's ImageNet example: the model says "batch"; name the mesh axis so.
    "batch": lambda: (jax.make_mesh((8,), ("batch",)), "batch", {"axis_name": "batch"}),
    # Or keep the step's default axis and name it in the model.
    "data": lambda: (jax.make_mesh((8,), ("data",)), "data", {}),
    # Hybrid sharding: the batch is split over both axes; the model names both.
    "hybrid": lambda: (jax.make_mesh((2, 4), ("replica", "data")), ("replica", "data"),
                       {"replica_axis": "replica"}),
}


@pytest.mark.parametrize("mesh_kind,stage,opt", [
    ("batch", 2, "sgd"), ("batch", 3, "adam"), ("data", 1, "adam"), ("hybrid", 2, "sgd"),
    ("hybrid", 3, "adam")])
def test_synchronised_batchnorm_equals_full_batch_batchnorm(mesh_kind, stage, opt):
  mesh, model_axes, kw = MESHES[mesh_kind]()
  batches = make_batches()
  step = zj.make_sharded_train_step(make_loss(ConvBN(model_axes)), OPTIMIZERS[opt](), mesh=mesh,
                                    stage=stage, **kw)
  params, ms = init_variables()
  state = step.init(params, model_state=ms)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  ref_params, ref_ms, ref_losses = full_batch_reference(OPTIMIZERS[opt](), batches)
  assert_tree_close(step.get_params(state), ref_params, what="params")
  assert_tree_close(state.model_state, ref_ms, what="batch_stats")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_per_device_statistics_differ_from_the_global_ones():
  # The reference above is not satisfied by per-device statistics: with the
  # default BatchNorm (no axis_name) the running variance is another number.
  mesh = jax.make_mesh((8,), ("data",))
  batches = make_batches(1)
  step = zj.make_sharded_train_step(make_loss(ConvBN()), optax.sgd(0.1), mesh=mesh)
  params, ms = init_variables()
  state, _ = step(step.init(params, model_state=ms), batches[0])
  _, ref_ms, _ = full_batch_reference(optax.sgd(0.1), batches)
  var = lambda m: np.asarray(m["batch_stats"]["BatchNorm_0"]["var"])
  assert not np.allclose(var(state.model_state), var(ref_ms), rtol=1e-2)
