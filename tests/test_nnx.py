"""Flax NNX: ``step.init(model)``, ``loss_fn(model, batch)``, ``step.get_model(state)``.

The reference is single-device NNX code as users write it: ``nnx.Optimizer(model,
tx, wrt=nnx.Param)`` and ``nnx.value_and_grad`` in ``nnx.jit`` on the whole
global batch. With BatchNorm the step documents per-device statistics averaged
over devices, so that reference splits the batch into the devices' slices (and
micro-batches, in order), as tests/test_model_state.py does for Linen. Dropout
masks are checked against the documented derivation of each device's key.
"""

import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zero_jax as zj
from _feature_helpers import N, assert_tree_close

STEPS = 5
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def mean_tree(trees):
  return jax.tree.map(lambda *xs: sum(xs) / len(xs), *trees)


def host(tree):
  """Numpy copies (key data for keys), to compare states across meshes."""
  data = lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  return jax.tree.map(lambda x: np.asarray(data(x)), tree)


def reference(model, tx, batches, loss_fn, *, wrt=nnx.Param):
  """Single-device NNX training on whole global batches. Returns the losses."""
  optimizer = nnx.Optimizer(model, tx, wrt=wrt)

  @nnx.jit
  def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, batch)
    optimizer.update(model, grads)
    return loss

  return [step(model, optimizer, b) for b in batches]


def train(step, model, batches, **init):
  state = step.init(model, **init)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(metrics["loss"])
  return state, losses


def assert_same_model(step, state, ref_model, **tol):
  """get_model holds the reference's variables (all of them: params, statistics, RNG)."""
  assert_tree_close(host(nnx.state(step.get_model(state))), host(nnx.state(ref_model)),
                    what="get_model ", **tol)
  assert_tree_close(step.get_params(state), nnx.state(ref_model, nnx.Param), what="params ",
                    **tol)


# ----------------------------------------------------------------------- MLP
class MLP(nnx.Module):
  """Every kernel and bias needs padding on 8 devices."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(5, 9, rngs=rngs)
    self.l2 = nnx.Linear(9, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(jnp.tanh(self.l1(x)))


def mlp_loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def mlp_batches(n=STEPS, size=32):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(size, 5)).astype(np.float32),
           "y": r.normal(size=(size, 3)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("stage,opt,k,clip", [
    (1, "sgd", 1, None), (1, "adam", 1, None), (2, "sgd", 1, None), (2, "adam", 1, None),
    (3, "sgd", 1, None), (3, "adam", 1, None), (2, "sgd", 2, 0.05)])
def test_mlp_module_matches_nnx_optimizer_on_one_device(mesh, stage, opt, k, clip):
  batches = mlp_batches()
  step = zj.make_sharded_train_step(mlp_loss, OPTIMIZERS[opt](), mesh=mesh, stage=stage,
                                    grad_accum_steps=k, max_grad_norm=clip)
  state, losses = train(step, MLP(nnx.Rngs(0)), batches)
  ref_model = MLP(nnx.Rngs(0))
  tx = OPTIMIZERS[opt]() if clip is None else optax.chain(optax.clip_by_global_norm(clip),
                                                          OPTIMIZERS[opt]())
  ref_losses = reference(ref_model, tx, batches, mlp_loss)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_same_model(step, state, ref_model)
  assert isinstance(step.get_model(state), MLP)


@pytest.mark.parametrize("option", ["trainable", "wrt"])
def test_filters_freeze_like_nnx_optimizer_wrt(mesh, option):
  # trainable=: l1 stays a frozen parameter; wrt=: l1 is model state. Either way it never
  # changes, and l2 trains as nnx.Optimizer(..., wrt=<the same filter>) trains it.
  batches = mlp_batches(3)
  only_l2 = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("l1")))
  kw = {"trainable": nnx.Not(nnx.PathContains("l1"))} if option == "trainable" else {
      "wrt": only_l2}
  step = zj.make_sharded_train_step(mlp_loss, optax.adam(1e-2), mesh=mesh, **kw)
  state, _ = train(step, MLP(nnx.Rngs(0)), batches)
  ref_model = MLP(nnx.Rngs(0))
  reference(ref_model, optax.adam(1e-2), batches, mlp_loss, wrt=only_l2)
  assert_tree_close(host(nnx.state(step.get_model(state))), host(nnx.state(ref_model)))
  np.testing.assert_array_equal(step.get_model(state).l1.kernel[...],
                                MLP(nnx.Rngs(0)).l1.kernel[...])
  assert sum(state.meta.trainable) == 2  # l2's kernel and bias


def mixed_loss(model, batch):
  """Computes in the parameters' dtype, as a mixed-precision model does; loss in fp32."""
  dt = model.l1.kernel.dtype
  out = model(batch["x"].astype(dt)).astype(jnp.float32)
  return jnp.mean((out - batch["y"]) ** 2)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_modes_equal_the_pure_function_path(mesh, precision):
  # The module path is a thin layer over the params path: the same numbers, bit for bit.
  batches = mlp_batches(2)
  graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
  pure_loss = lambda p, b: mixed_loss(nnx.merge(graphdef, p, copy=True), b)
  make = lambda fn: zj.make_sharded_train_step(fn, optax.adam(1e-2), mesh=mesh,
                                               precision=precision)
  step_m, step_p = make(mixed_loss), make(pure_loss)
  state_m, losses_m = train(step_m, MLP(nnx.Rngs(0)), batches)
  state_p, losses_p = train(step_p, params, batches)
  np.testing.assert_array_equal(losses_m, losses_p)
  assert_tree_close(step_m.get_params(state_m), step_p.get_params(state_p), rtol=0, atol=0)
  half = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[precision]
  assert state_m.params["l1"]["kernel"].dtype == half
  assert step_m.get_model(state_m).l1.kernel.dtype == jnp.float32  # the master copy


# ----------------------------------------------------------------- BatchNorm
class CNN(nnx.Module):
  def __init__(self, rngs):
    # No bias before BatchNorm: its gradient is exactly zero, and Adam would turn the
    # rounding noise in it into full-size steps.
    self.conv = nnx.Conv(2, 4, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(4, momentum=0.8, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(jnp.mean(nnx.relu(self.bn(self.conv(x))), axis=(1, 2)))


def cnn_batches(n=STEPS, size=64):
  r = np.random.default_rng(1)
  # Shifted and scaled inputs, so that the batch statistics differ from the initial ones.
  return [{"x": (r.normal(size=(size, 6, 6, 2)) * 2 + 1).astype(np.float32),
           "y": r.normal(size=(size, 3)).astype(np.float32)} for _ in range(n)]


def reference_bn(model, tx, batches, k):
  """Per-device (and per-micro-batch, in order) statistics, averaged over devices."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    graphdef, params, stats = nnx.split(model, nnx.Param, ...)

    def device(part):  # one device: its micro-batches in order, from the same statistics
      local = nnx.merge(graphdef, params, stats, copy=True)
      out = [nnx.value_and_grad(mlp_loss)(local, jax.tree.map(lambda x: x[j], part))
             for j in range(k)]  # each call updates local's statistics
      return mean_tree([g for _, g in out]), mean_tree([l for l, _ in out]), nnx.state(
          local, nnx.BatchStat)

    parts = jax.tree.map(lambda x: x.reshape((N, k, -1) + x.shape[1:]), batch)
    grads, losses, new_stats = jax.vmap(device)(parts)
    optimizer.update(model, jax.tree.map(lambda x: x.mean(0), grads))
    nnx.update(model, jax.tree.map(lambda x: x.mean(0), new_stats))
    return losses.mean()

  return [step(model, optimizer, b) for b in batches]


@pytest.mark.parametrize("stage,k,opt", [(2, 1, "adam"), (3, 2, "sgd")])
def test_batchnorm_cnn_matches_per_device_statistics_reference(mesh, stage, k, opt):
  batches = cnn_batches()
  step = zj.make_sharded_train_step(mlp_loss, OPTIMIZERS[opt](), mesh=mesh, stage=stage,
                                    grad_accum_steps=k)
  state, losses = train(step, CNN(nnx.Rngs(0)), batches)
  ref_model = CNN(nnx.Rngs(0))
  ref_losses = reference_bn(ref_model, OPTIMIZERS[opt](), batches, k)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_same_model(step, state, ref_model)
  # The statistics of the whole batch would differ: the reference is not trivially met.
  whole = CNN(nnx.Rngs(0))
  whole(batches[0]["x"])
  first = CNN(nnx.Rngs(0))
  reference_bn(first, OPTIMIZERS[opt](), batches[:1], k)
  assert not np.allclose(whole.bn.var[...], first.bn.var[...], rtol=1e-3)
  # Evaluation outside the step, with the averaged statistics.
  model = step.get_model(state)
  model.eval()
  ref_model.eval()
  np.testing.assert_allclose(model(batches[0]["x"]), ref_model(batches[0]["x"]), rtol=1e-5,
                             atol=1e-6)


def test_whole_nnx_state_as_params_is_refused_and_statistics_never_meet_the_optimizer(mesh):
  # adamw moves every leaf it is given (weight decay), even one whose gradient is zero.
  tx = optax.adamw(0.1, weight_decay=0.5)

  def eval_loss(model, batch):  # the statistics are used, not updated
    model.eval()
    return mlp_loss(model, batch)

  step = zj.make_sharded_train_step(eval_loss, tx, mesh=mesh)
  with pytest.raises(ValueError, match=r"params\['bn'\]\['mean'\] \(BatchStat\).*"
                                       r"step\.init\(model\)"):
    step.init(nnx.state(CNN(nnx.Rngs(0))))
  step.init(nnx.state(CNN(nnx.Rngs(0)), nnx.Param))  # only wrt variables: a params tree
  state, _ = train(step, CNN(nnx.Rngs(0)), cnn_batches(2))
  assert not jax.tree.leaves(nnx.state(state.params, nnx.BatchStat))
  model, ref_model = step.get_model(state), CNN(nnx.Rngs(0))
  assert_tree_close(host(nnx.state(model, nnx.BatchStat)),
                    host(nnx.state(ref_model, nnx.BatchStat)), rtol=0, atol=0)
  assert not np.allclose(model.head.kernel[...], ref_model.head.kernel[...])
  # In training mode they change by the module's own update alone: see
  # test_batchnorm_cnn_matches_per_device_statistics_reference.


# ------------------------------------------------------------------- dropout
SIZE, WIDTH, RATE, K = 2 * N, 32, 0.5, 2  # one example per device and micro-batch


class Masker(nnx.Module):
  """Reveals its masks: for a one-hot x_i, d sum(dropout(x_i @ w)) / d w[i] = mask / keep."""

  def __init__(self, rngs=None):
    self.w = nnx.Param(jnp.zeros((SIZE, WIDTH)))
    self.drop = nnx.Dropout(RATE, rngs=rngs)

  def __call__(self, x, rngs=None):
    return self.drop(x @ self.w[...], rngs=rngs)


def masker_loss(model, batch, rng=None):
  rngs = None if rng is None else nnx.Rngs(dropout=rng)  # a user's Rngs from the step's key
  return jnp.mean(jnp.sum(model(batch, rngs=rngs), axis=-1))


def masker_step(mesh):
  return zj.make_sharded_train_step(masker_loss, optax.sgd(1.0), mesh=mesh, grad_accum_steps=K)


def drawn_masks(step, source, steps=2):
  """Each example's mask, per step (SGD with lr 1 reveals it): (steps, SIZE, WIDTH)."""
  if source == "module":
    state = step.init(Masker(nnx.Rngs(7)))
  else:
    state = step.init(Masker(), rng=jax.random.key(7))
  batch, out = np.eye(SIZE, dtype=np.float32), []
  w = np.zeros((SIZE, WIDTH), np.float32)
  for _ in range(steps):
    state, _ = step(state, batch)
    new = np.asarray(step.get_params(state)["w"][...])
    out.append((w - new) * SIZE * (1 - RATE))
    w = new
  return np.stack(out), state


def documented_masks(source, steps=2):
  """fold_in(fold_in(fold_in(key, step), device), micro_batch), then the stream's draw."""
  key = nnx.state(Masker(nnx.Rngs(7)), nnx.RngKey)["drop"]["rngs"]["key"][...]
  out = np.zeros((steps, SIZE, WIDTH), np.float32)
  for s in range(steps):
    for d in range(N):
      for j in range(K):
        base = key if source == "module" else jax.random.key(7)
        k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, s), d), j)
        count = s * K + j if source == "module" else 0  # Rngs(dropout=rng) starts at 0
        draw = jax.random.fold_in(k, count)
        out[s, d * K + j] = jax.random.bernoulli(draw, 1 - RATE, (1, WIDTH))[0]
  return out


@pytest.mark.parametrize("source", ["module", "rng_argument"])
def test_dropout_masks_differ_per_device_micro_batch_and_step_and_are_reproducible(mesh,
                                                                                    source):
  step = masker_step(mesh)
  masks, state = drawn_masks(step, source)
  assert set(np.unique(masks)) == {0.0, 1.0}
  rows = masks.reshape(-1, WIDTH)
  assert len({r.tobytes() for r in rows}) == len(rows)  # 8 devices x 2 micro-batches x 2 steps
  np.testing.assert_array_equal(masks, documented_masks(source))
  np.testing.assert_array_equal(masks, drawn_masks(step, source)[0])  # the same on a rerun
  if source == "module":  # the stored key is kept; the counter counts the calls
    kept = nnx.state(Masker(nnx.Rngs(7)), nnx.RngKey)
    np.testing.assert_array_equal(host(state.model_state["drop"]["rngs"]["key"]),
                                  host(kept["drop"]["rngs"]["key"]))
    assert int(state.model_state["drop"]["rngs"]["count"][...]) == 2 * K


# --------------------------------------------------- scanned stack, stage 3
LAYERS, D = 3, 12  # 12 pads to 16 on 8 devices


class Block(nnx.Module):
  """Transformer-ish: one-head self-attention and an MLP, each with LayerNorm and residual."""

  def __init__(self, rngs):
    self.ln1 = nnx.LayerNorm(D, rngs=rngs)
    self.qkv = nnx.Linear(D, 3 * D, use_bias=False, rngs=rngs)  # a key bias has no gradient
    self.ln2 = nnx.LayerNorm(D, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    q, k, v = jnp.split(self.qkv(self.ln1(x)), 3, axis=-1)
    x = x + jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(D), axis=-1) @ v
    return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class Stack(nnx.Module):
  def __init__(self, rngs, block=Block):
    self.emb = nnx.Linear(5, D, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return block(rngs)

    self.blocks = make(rngs)
    self.head = nnx.Linear(D, 3, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    @nnx.remat  # the backward pass gathers each layer again
    def layer(x, block):
      return zj.gather(block)(x)  # stage 3: this layer's params; else block itself

    return self.head(layer(self.emb(x), self.blocks))


def seq_batches(n=STEPS, size=16):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(size, 4, 5)).astype(np.float32),
           "y": r.normal(size=(size, 4, 3)).astype(np.float32)} for _ in range(n)]


STACKED = nnx.PathContains("blocks")


def test_scanned_stack_stage3_gathers_layer_by_layer_and_matches_reference(mesh):
  batches = seq_batches()
  step = zj.make_sharded_train_step(mlp_loss, optax.adam(1e-2), mesh=mesh, stage=3,
                                    stacked=STACKED)
  state, losses = train(step, Stack(nnx.Rngs(0)), batches)
  ref_model = Stack(nnx.Rngs(0))
  np.testing.assert_allclose(losses, reference(ref_model, optax.adam(1e-2), batches, mlp_loss),
                             rtol=1e-5)
  assert_same_model(step, state, ref_model)
  stacked = [l for l, s in zip(state.meta.param_layouts, state.meta.stacked) if s]
  assert len(stacked) == 9 and all(l.shape[0] == LAYERS for l in stacked)
  # Each layer is gathered on its own (inside the scan): no gather has the layer axis.
  text = step.lower(state, batches[0]).as_text()
  gathered = re.findall(r"all_gather.*-> tensor<([\dx]+)x\w+>", text)
  # Each layer's small leaves move together (buckets): a few gathers, none of the stack.
  assert gathered, text
  assert not [g for g in gathered if g.startswith(f"{LAYERS}x")], gathered


class NormDropBlock(nnx.Module):
  """A block that updates its own variables: BatchNorm statistics and a Dropout stream."""

  def __init__(self, rngs):
    self.bn = nnx.BatchNorm(D, rngs=rngs)
    self.drop = nnx.Dropout(0.3, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(nnx.gelu(self.bn(x)))


def test_scanned_block_keeps_its_own_statistics_and_streams_at_stage3(mesh):
  batches = seq_batches(2)
  runs = {}
  for stage in (2, 3):
    step = zj.make_sharded_train_step(mlp_loss, optax.adam(1e-2), mesh=mesh, stage=stage,
                                      stacked=STACKED, grad_accum_steps=2)
    state, losses = train(step, Stack(nnx.Rngs(0), NormDropBlock), batches)
    runs[stage] = (host(nnx.state(step.get_model(state))), losses)
  assert_tree_close(runs[3][0], runs[2][0], rtol=1e-5)
  np.testing.assert_allclose(runs[3][1], runs[2][1], rtol=1e-6)
  blocks = runs[3][0]["blocks"]
  assert not np.allclose(blocks["bn"]["mean"], 0)  # the statistics moved in every layer
  np.testing.assert_array_equal(blocks["drop"]["rngs"]["count"], [4] * LAYERS)


# ------------------------------------------------ checkpoints and memory
def test_checkpoint_restores_into_a_module_step_on_another_mesh_and_stage(mesh):
  batches = cnn_batches(3)
  abstract = nnx.eval_shape(lambda: CNN(nnx.Rngs(0)))
  step2 = zj.make_sharded_train_step(mlp_loss, optax.adam(1e-2), mesh=mesh)
  state2, _ = train(step2, CNN(nnx.Rngs(0)), batches[:2])
  path = tempfile.mkdtemp()
  with zj.CheckpointManager(path) as mngr:
    mngr.save(state2)
  step3 = zj.make_sharded_train_step(mlp_loss, optax.adam(1e-2), mesh=mesh, stage=3)
  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  step4 = zj.make_sharded_train_step(mlp_loss, optax.adam(1e-2), mesh=mesh4, stage=3)
  with zj.CheckpointManager(path) as mngr:
    state3 = mngr.restore(step3, abstract)
    state4 = mngr.restore(step4, CNN(nnx.Rngs(1)))  # a concrete module: only its shapes count
  for step, state in ((step3, state3), (step4, state4)):
    assert_tree_close(host(nnx.state(step.get_model(state))),
                      host(nnx.state(step2.get_model(state2))), rtol=0, atol=0)
  state2, m2 = step2(state2, batches[2])  # training goes on as if never interrupted
  state3, m3 = step3(state3, batches[2])
  np.testing.assert_allclose(m3["loss"], m2["loss"], rtol=1e-6)
  assert_tree_close(host(nnx.state(step3.get_model(state3))),
                    host(nnx.state(step2.get_model(state2))))


@pytest.mark.parametrize("make,stacked", [(CNN, None), (Stack, STACKED)])
def test_memory_report_of_an_abstract_module_counts_its_params_only(mesh, make, stacked):
  abstract = nnx.eval_shape(lambda: make(nnx.Rngs(0)))
  report = zj.memory_report(abstract, optax.adam(1e-2), n_devices=N, stacked=stacked)
  params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
  assert report.n_params == sum(x.size for x in jax.tree.leaves(params))  # no statistics
  step = zj.make_sharded_train_step(mlp_loss, optax.adam(1e-2), mesh=mesh, stage=3,
                                    stacked=stacked)
  state = step.abstract_state(abstract)
  held = lambda tree: sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                          for x in jax.tree.leaves(tree))
  assert report[3].params == held(state.params)
  assert report[3].optimizer_state == held(state.opt_state)


# ------------------------------------------------------------------- misuse
def test_nnx_optimizer_as_optimizer_says_what_to_do(mesh):
  model = MLP(nnx.Rngs(0))
  with pytest.raises(TypeError) as e:
    zj.make_sharded_train_step(mlp_loss, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),
                               mesh=mesh)
  for needle in ("optimizer.tx", "step.init(model)", "make_sharded_train_step(loss_fn, tx"):
    assert needle in str(e.value)


@pytest.mark.parametrize("kw,call,error,match", [
    ({}, lambda s: s.init(MLP(nnx.Rngs(0)), model_state={}), TypeError, "no model_state="),
    ({"trainable": {"l1": True}}, lambda s: s.init(MLP(nnx.Rngs(0))), TypeError,
     r"trainable=\{'l1': True\} is not an NNX filter"),
    ({"stacked": nnx.Param}, lambda s: s.init({"w": np.ones(3, np.float32)}), TypeError,
     r"stacked=nnx.Param is an NNX filter.*plain pytree"),
    ({"wrt": 3}, None, TypeError, r"wrt=3 is not an NNX filter"),
    ({}, lambda s: s.get_model(s.init({"w": np.ones(3, np.float32)})), TypeError,
     r"step.get_params\(state\)"),
])
def test_misuse_of_the_module_path_is_refused(mesh, kw, call, error, match):
  with pytest.raises(error, match=match):
    step = zj.make_sharded_train_step(mlp_loss, optax.sgd(0.1), mesh=mesh, **kw)
    call(step)


class Recorder(MLP):
  def __call__(self, x):
    h = jnp.tanh(self.l1(x))
    self.hidden = nnx.Variable(h)  # a variable the forward pass adds
    return self.l2(h)


def test_loss_fn_that_adds_variables_names_them(mesh):
  step = zj.make_sharded_train_step(mlp_loss, optax.sgd(0.1), mesh=mesh)
  with pytest.raises(ValueError, match=r"added: \['hidden'\] \(Variable\).*nnx.capture"):
    step(step.init(Recorder(nnx.Rngs(0))), mlp_batches(1)[0])
