"""``step.evaluate(state, batch)``: the step's metrics for a batch, no gradient, no update.

The reference is the loss on one device: ``jax.jit(loss_fn)(step.get_params(state),
whole_batch)`` (plain ``jax.lax.scan`` over the layers, no sharding), after some training
steps with SGD and with Adam. The state must come back unchanged, bit for bit.

Tolerance. The sharded loss and the reference compute every example's loss from the same
float32 parameters and inputs with the same operations; they may differ in (a) the order of the
final mean: 16 rows x 3 outputs = 48 non-negative terms summed per device, then over 8 devices,
against one sum of 48 -- each order is within gamma_47 = 47 * 2^-24 = 2.8e-6 (relative) of the
exact sum of non-negative terms, so the two differ by at most 5.6e-6; (b) the blocking of the
matmuls for 2 rows against 16: a dot of length <= 7 rounds within gamma_7 = 4.2e-7 per value,
and through the 6 matmuls of the model (tanh and the residual-free layers do not amplify:
|tanh'| <= 1, weights of norm ~1) this adds at most ~6 * 2 * 4.2e-7 = 5e-6 relative to each
example's loss. Total < 1.1e-5: RTOL = 2e-5 holds on any IEEE float32 machine.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zero_jax as zj
import _forward_model as M

RTOL = 2e-5


def reference_loss(step, state, b, fn=M.loss_fn):
  return float(jax.jit(fn)(step.get_params(state), b))


def check_evaluate(step, state, b, ref):
  """evaluate's loss equals ``ref`` to RTOL; its step is the state's; the state is unchanged
  bit for bit and still usable (not donated)."""
  before = M.host(state)
  metrics = step.evaluate(state, b)
  np.testing.assert_allclose(float(metrics["loss"]), ref, rtol=RTOL)
  assert int(metrics["step"]) == int(before.step)
  M.assert_bitwise_equal(M.host(state), before)
  return metrics


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_evaluate_equals_the_single_device_loss_after_training(mesh, stage, opt):
  step, state = M.trained_step(mesh, stage=stage, opt=opt)
  b = M.batch(0)
  got = check_evaluate(step, state, b, reference_loss(step, state, b))
  # ... and the loss the training step itself reports for this state and batch.
  _, metrics = step(state, b)
  np.testing.assert_allclose(float(got["loss"]), float(metrics["loss"]), rtol=RTOL)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_stage3_stacked_layers_stay_split_and_loop_one_layer_at_a_time(mesh, prefetch):
  step, state = M.trained_step(mesh, stage=3, opt="adam", prefetch=prefetch)
  b = M.batch(0)
  check_evaluate(step, state, b, reference_loss(step, state, b))
  # The stacked leaves are gathered inside the layer loop, never whole before it.
  text = jax.jit(step.evaluate).lower(state, b).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  shapes = [line for line in entry.splitlines() if "all-gather" in line]
  assert not any("[4,7,7]" in s or "[4,8,7]" in s for s in shapes), shapes


@pytest.mark.parametrize("kind", ["hpz", "replica_stage3", "replica_stage2", "model_axis"])
def test_hpz_replica_and_model_axes_on_a_2d_mesh(kind):
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  split_layers = {"w_in": P(), "layers": {"w": P("replica"), "b": P("replica")}, "w_out": P()}
  kw = {"hpz": dict(stage=3, axis_name=("replica", "data"), hpz_axis="data"),
        "replica_stage3": dict(stage=3, replica_axis="replica"),
        "replica_stage2": dict(stage=2, replica_axis="replica"),
        # "replica" as a model axis: the stacked layers split over it (param_specs=).
        "model_axis": dict(stage=3, param_specs=split_layers)}[kind]
  step, state = M.trained_step(mesh, opt="adam", **kw)
  b = M.batch(0)
  check_evaluate(step, state, b, reference_loss(step, state, b))


@pytest.mark.parametrize("stage,k", [(2, 1), (3, 1), (3, 2), (1, 2)])
def test_weighted_loss_and_aux_are_reduced_as_the_step_reduces_them(mesh, stage, k):
  step = M.make_step(mesh, stage=stage, fn=M.weighted_loss, has_aux=True,
                     aux_reduce=M.AUX_REDUCE, grad_accum_steps=k)
  state = M.trained(step)
  b = M.batch(0)
  ref_loss, ref_aux = jax.jit(M.weighted_reference)(step.get_params(state), b)
  metrics = check_evaluate(step, state, b, float(ref_loss))
  aux = metrics["aux"]
  np.testing.assert_allclose(np.asarray(aux["rows"]), np.asarray(ref_aux["rows"]), rtol=RTOL)
  np.testing.assert_allclose(float(aux["sq"]), float(ref_aux["sq"]), rtol=RTOL)
  assert int(aux["kept"]) == int(ref_aux["kept"]) and aux["kept"].dtype == jnp.int32
  assert bool(aux["any_big"]) == bool(ref_aux["any_big"])
  assert aux["rows"].sharding.spec == jax.sharding.PartitionSpec("data")
  _, step_metrics = step(state, b)
  for name in ("sq", "kept", "any_big"):
    np.testing.assert_allclose(np.asarray(aux[name]), np.asarray(step_metrics["aux"][name]),
                               rtol=RTOL)


@pytest.mark.parametrize("stage,opt,once", [(1, "sgd", False), (2, "adam", False),
                                            (3, "sgd", False), (3, "adam", False),
                                            (3, "adam", True)])
def test_micro_batches_as_grad_accum_steps_splits_them(mesh, stage, opt, once):
  step, state = M.trained_step(mesh, stage=stage, opt=opt, grad_accum_steps=2,
                               gather_once=once)
  b = M.batch(0)
  check_evaluate(step, state, b, reference_loss(step, state, b))
  # A lax.scan over the micro-batches, as the step runs them.
  text = jax.jit(step.evaluate).lower(state, b).as_text()
  assert "while" in text or "scan" in text
  with pytest.raises(ValueError, match=r"batch\['mask'\] has leading dimension 8.*divisible by 16"
                                       r".*grad_accum_steps=2"):
    step.evaluate(state, M.batch(0, rows=8))


def policy_probe(p, b):
  """The loss, and what the loss sees of the parameters: their dtype's epsilon and the sum of
  one leaf's values (which tells the rounded copy from the fp32 master)."""
  return M.loss_fn(p, b), {"eps": jnp.asarray(jnp.finfo(p["w_in"].dtype).eps, jnp.float32),
                           "w_in_sum": jnp.sum(p["w_in"].astype(jnp.float32))}


@pytest.mark.parametrize("precision,dtype", [("bf16", jnp.bfloat16), ("fp16", jnp.float16)])
def test_mixed_precision_evaluates_the_compute_copy_as_the_step_forward_does(mesh, precision,
                                                                             dtype):
  """The loss sees the compute copy: the reference is the same policy by hand (the fp32 master
  cast to the compute dtype, the loss computing in it).

  What the loss sees is checked exactly through aux: the dtype, and the sum of w_in's 35
  values, which two summation orders of the same float32 values give within
  2 * gamma_35 * sum|x| (gamma_35 = 35 * 2^-24), while the fp32 master's values differ from
  the rounded ones by up to 2^-9 (bf16) or 2^-12 (fp16) of each value. The loss: each bf16
  (fp16) operation rounds to 2^-9 (2^-12) relative; the two programs may round each of the ~8
  low-precision values on an example's path differently by one unit, at most 8 * 2^-8 = 3.1e-2
  relative (bf16) per example before the float32 mean: rtol 3.2e-2 (4e-3 for fp16)."""
  step, state = M.trained_step(mesh, stage=3, opt="adam", precision=precision,
                               fn=policy_probe, has_aux=True)
  b = M.batch(0)
  master = step.get_params(state)
  compute = jax.tree.map(lambda x: x.astype(dtype), master)
  ref, ref_aux = jax.jit(policy_probe)(compute, b)
  metrics = step.evaluate(state, b)
  assert float(metrics["aux"]["eps"]) == float(jnp.finfo(dtype).eps)
  w = np.asarray(master["w_in"], np.float64)
  atol = 2 * 35 * 2.0 ** -24 * np.abs(w).sum()
  np.testing.assert_allclose(float(metrics["aux"]["w_in_sum"]), float(ref_aux["w_in_sum"]),
                             rtol=0, atol=atol)
  assert abs(w.sum() - float(ref_aux["w_in_sum"])) > 2 * atol  # the probe tells them apart
  rtol = 3.2e-2 if dtype == jnp.bfloat16 else 4e-3
  np.testing.assert_allclose(float(metrics["loss"]), float(ref), rtol=rtol)
  _, step_metrics = step(state, b)  # the step's own forward pass sees the same
  np.testing.assert_allclose(float(metrics["loss"]), float(step_metrics["loss"]), rtol=rtol)


def test_quantized_weights_are_evaluated_as_the_step_sees_them(mesh):
  """qwZ: the forward pass sees block-quantized weights; evaluate gives the step's loss."""
  step, state = M.trained_step(mesh, stage=3, opt="sgd", quantize=zj.Quantize(block_size=8))
  b = M.batch(0)
  got = float(step.evaluate(state, b)["loss"])
  # int8 blocks of 8 round each weight by up to 1/254 of its block's largest: the loss of
  # the exact weights is well outside float rounding of the quantized one (here ~1e-3).
  exact = reference_loss(step, state, b)
  assert abs(got - exact) > 10 * RTOL * exact, (got, exact)
  _, metrics = step(state, b)
  np.testing.assert_allclose(got, float(metrics["loss"]), rtol=RTOL)


def test_stage3_evaluate_holds_a_layer_or_two_and_at_most_the_steps_memory():
  width = 256
  layer = (width * width + width) * 4
  temp = {n: M.deep_compiled(n, width, "evaluate").memory_analysis().temp_size_in_bytes
          for n in (8, 16)}
  assert temp[16] - temp[8] < layer, (temp, layer)  # more layers: nothing more held
  assert temp[16] < 4 * layer, (temp, layer)        # the 16-layer model is 16 layers
  step = M.deep_compiled(16, width, "step").memory_analysis().temp_size_in_bytes
  assert temp[16] <= step, (temp, step)


def test_offloaded_optimizer_state_is_not_read():
  step, state = M.trained_step(jax.make_mesh((8,), ("data",)), stage=3, opt="adam",
                               offload="optimizer")
  b = M.batch(0)
  check_evaluate(step, state, b, reference_loss(step, state, b))


def test_explicit_axes_inside_the_users_mesh_context():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  step = M.make_step(mesh, stage=3, opt="sgd", fn=M.weighted_loss, has_aux=True,
                     aux_reduce=M.AUX_REDUCE)
  with jax.set_mesh(mesh):
    state = M.trained(step)
    b = M.batch(0)
    metrics = step.evaluate(state, b)
  ref_loss, _ = jax.jit(M.weighted_reference)(step.get_params(state), b)
  np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=RTOL)


def test_compiled_once_per_shape(mesh):
  traces = []

  def counted(p, b):
    traces.append(1)
    return M.loss_fn(p, b)

  step = M.make_step(mesh, stage=3, fn=counted)
  state = step.init(M.init_params())
  for t in range(3):
    step.evaluate(state, M.batch(t))
  assert len(traces) == 1
  step.evaluate(state, M.batch(0, rows=32))
  assert len(traces) == 2


# ----------------------------------------------------------------- model state and rng
def stats_loss(p, b, *, model_state, rng):
  """A loss with BatchNorm-like running statistics and noise from the step's key."""
  h = M.forward(p, b["x"])
  noise = 1e-3 * jax.random.normal(rng, h.shape)
  new = {"mean": 0.9 * model_state["mean"] + 0.1 * jnp.mean(h, axis=0)}
  loss = jnp.mean(jnp.square(h - model_state["mean"] + noise - b["y"]))
  return loss, new


def test_model_state_is_given_and_the_new_one_dropped_rng_is_the_steps_key(mesh):
  step = M.make_step(mesh, stage=3, opt="sgd", fn=stats_loss)
  ms = {"mean": np.full((M.D_OUT,), 0.25, np.float32)}
  state = M.trained(step, model_state=ms, rng=jax.random.key(3))
  b = M.batch(0)
  before = M.host(state)
  metrics = step.evaluate(state, b)
  M.assert_bitwise_equal(M.host(state), before)
  # Up to the noise (1e-3 of an O(1) loss), the single-device loss with the state's
  # statistics.
  quiet = lambda p, b, ms: stats_loss(p, b, model_state=ms, rng=jax.random.key(0))[0]
  np.testing.assert_allclose(float(metrics["loss"]),
                             float(jax.jit(quiet)(step.get_params(state), b,
                                                  state.model_state)), rtol=1e-2)
  # The key is the one the training step gives for this state's step, device and
  # micro-batch: evaluate's loss is the loss the step reports for the same state.
  _, step_metrics = step(state, b)
  np.testing.assert_allclose(float(metrics["loss"]), float(step_metrics["loss"]), rtol=RTOL)


# ----------------------------------------------------------------------- NNX
class Net(nnx.Module):
  """Linear -> BatchNorm -> Dropout -> Linear; every kernel needs padding on 8 devices."""

  def __init__(self, rngs):
    self.l1 = nnx.Linear(M.D_IN, 9, rngs=rngs)
    self.bn = nnx.BatchNorm(9, momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.l2 = nnx.Linear(9, M.D_OUT, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(jnp.tanh(self.bn(self.l1(x)))))


def net_loss(model, b):
  return jnp.mean((model(b["x"]) - b["y"]) ** 2)


@pytest.mark.parametrize("stage,opt", [(1, "adam"), (2, "sgd"), (3, "sgd"), (3, "adam")])
def test_nnx_module_runs_as_model_eval_sets_it(mesh, stage, opt):
  step = zj.make_sharded_train_step(net_loss, M.OPTIMIZERS[opt](), mesh=mesh, stage=stage)
  state = M.trained(step, Net(nnx.Rngs(0, dropout=1)))
  b = M.batch(0)
  before = M.host(state)
  metrics = step.evaluate(state, b)
  M.assert_bitwise_equal(M.host(state), before)  # BatchNorm statistics and RNG counts too
  model = step.get_model(state)
  model.eval()
  ref = float(jax.jit(net_loss)(model, b))
  np.testing.assert_allclose(float(metrics["loss"]), ref, rtol=RTOL)
  # The statistics are the trained ones, not the initial ones; dropout on would differ.
  fresh = Net(nnx.Rngs(0, dropout=1))
  assert not np.allclose(np.asarray(model.bn.mean[...]), np.asarray(fresh.bn.mean[...]))
  model.train()
  assert abs(float(net_loss(model, b)) - ref) > 1e-3


# ----------------------------------------------------------------------- misuse
def test_a_state_from_another_step_is_refused(mesh):
  step = M.make_step(mesh, stage=3)
  other = M.make_step(mesh, stage=2)
  state = other.init(M.init_params())
  with pytest.raises(ValueError, match=r"not made by this step(.|\n)*ZeRO stage: the state's 2"):
    step.evaluate(state, M.batch(0))


def test_a_batch_leaf_with_other_rows_is_named(mesh):
  step = M.make_step(mesh, stage=2)
  state = step.init(M.init_params())
  b = M.batch(0)
  b["y"] = b["y"][:8]
  with pytest.raises(ValueError, match=r"batch\['y'\]"):
    step.evaluate(state, b)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(9, 9, rngs=rngs)
    self.bn = nnx.BatchNorm(9, momentum=0.5, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(jnp.tanh(self.bn(self.lin(x))))


class Deep(nnx.Module):
  """nnx.vmap-stacked blocks looped with zj.scan (one layer gathered at a time at stage 3)."""

  def __init__(self, rngs, layers=3):
    self.embed = nnx.Linear(M.D_IN, 9, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(rngs)
    self.blocks = make(rngs)
    self.head = nnx.Linear(9, M.D_OUT, rngs=rngs)

  def __call__(self, x):
    h, _ = zj.scan(lambda h, block: (block(h), None), self.embed(x), self.blocks)
    return self.head(h)


@pytest.mark.parametrize("stage", [2, 3])
def test_stacked_nnx_blocks_with_dropout_and_batchnorm_in_eval_mode(mesh, stage):
  step = zj.make_sharded_train_step(net_loss, M.OPTIMIZERS["adam"](), mesh=mesh, stage=stage,
                                    stacked=nnx.PathContains("blocks"))
  state = M.trained(step, Deep(nnx.Rngs(0, dropout=1)), steps=2)
  b = M.batch(0)
  before = M.host(state)
  metrics = step.evaluate(state, b)
  logits = step.apply(state, lambda m, x: m(x), b["x"])
  M.assert_bitwise_equal(M.host(state), before)
  model = step.get_model(state)
  model.eval()
  np.testing.assert_allclose(float(metrics["loss"]), float(jax.jit(net_loss)(model, b)),
                             rtol=RTOL)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(jax.jit(lambda m, x: m(x))(
      model, b["x"])), rtol=1e-5, atol=1e-5)
