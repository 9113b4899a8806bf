"""``step.apply(state, fn, *args)``: any forward use of the split state (logits, sampling).

The reference is ``jax.jit(fn)(step.get_params(state), *args)`` on one device (NNX:
``step.get_model(state)`` after ``model.eval()``). The state must come back unchanged, bit for
bit, and at stage 3 the compiled program holds a layer or two of a stacked model, not all.

Tolerance: both sides compute each output value from the same float32 parameters and inputs
with the same operations; only the blocking of the matmuls may differ (replicated args: the same
shapes, so usually none; split args: 2 rows per device against 16). A dot of length <= 7 rounds
within gamma_7 = 7 * 2^-24 = 4.2e-7 of the exact value; through the 3 + L matmuls of the model
(L = 4 layers; tanh does not amplify, weights of norm ~1) the two differ by at most
2 * 7 * 4.2e-7 = 5.9e-6 relative to the output's scale. RTOL = ATOL = 1e-5 (outputs are O(1)).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zero_jax as zj
import _forward_model as M
from test_evaluate import Net

TOL = dict(rtol=1e-5, atol=1e-5)


def check_apply(step, state, fn, *args, split_args=False):
  before = M.host(state)
  out = step.apply(state, fn, *args, split_args=split_args)
  ref = jax.jit(fn)(step.get_params(state), *args)
  for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(o), np.asarray(r), **TOL)
    if split_args:
      assert tuple(o.sharding.spec)[:1] == ("data",), o.sharding
    else:
      assert o.sharding.is_fully_replicated, o.sharding
  M.assert_bitwise_equal(M.host(state), before)
  return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_apply_equals_fn_on_the_gathered_params(mesh, stage, opt):
  step, state = M.trained_step(mesh, stage=stage, opt=opt)
  x = M.batch(0)["x"]
  check_apply(step, state, M.forward, x)
  check_apply(step, state, M.forward, x, split_args=True)
  # Several args and outputs, a tree of them.
  two = lambda p, a, b: {"logits": M.forward(p, a["x"]), "rows": M.per_example(p, b)}
  check_apply(step, state, two, {"x": x}, M.batch(1))


@pytest.mark.parametrize("kind", ["hpz", "replica_stage3", "quantized"])
def test_hpz_replica_axes_and_quantized_weights(kind):
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  kw = {"hpz": dict(stage=3, axis_name=("replica", "data"), hpz_axis="data"),
        "replica_stage3": dict(stage=3, replica_axis="replica"),
        "quantized": dict(stage=3, axis_name=("replica", "data"),
                          quantize=zj.Quantize(block_size=8))}[kind]
  step, state = M.trained_step(mesh, opt="adam", **kw)
  b = M.batch(0)
  if kind == "quantized":  # the weights as the step's forward sees them: its own loss
    rows = step.apply(state, M.per_example, b)
    np.testing.assert_allclose(float(jnp.mean(rows)), float(step.evaluate(state, b)["loss"]),
                               rtol=2e-5)
    return
  out = step.apply(state, M.forward, b["x"], split_args=True)
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      jax.jit(M.forward)(step.get_params(state), b["x"])), **TOL)
  assert tuple(out.sharding.spec)[:1] == (("replica", "data"),), out.sharding
  check_apply(step, state, M.forward, b["x"])


def greedy(p, x0, proj, steps=4):
  """A sampling-like loop: each step runs the whole model (a zj.scan over the layers)."""
  def one(x, _):
    logits = M.forward(p, x)
    return jnp.tanh(logits @ proj), (jnp.argmax(logits, axis=-1), logits)
  _, (tokens, logits) = jax.lax.scan(one, x0, None, length=steps)
  return tokens, logits


def test_a_sampling_loop_runs_the_layer_loop_at_every_position(mesh):
  step, state = M.trained_step(mesh, stage=3, opt="sgd")
  proj = np.random.default_rng(7).normal(size=(M.D_OUT, M.D_IN)).astype(np.float32)
  tokens, logits = step.apply(state, greedy, M.batch(0)["x"][:3], proj)
  ref_tokens, ref_logits = jax.jit(greedy)(step.get_params(state), M.batch(0)["x"][:3], proj)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), **TOL)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref_tokens))
  assert tokens.dtype == jnp.int32 and tokens.shape == (4, 3)


def test_model_state_is_passed_as_a_keyword(mesh):
  def loss(p, b, *, model_state):
    return M.loss_fn(p, b), model_state

  step = M.make_step(mesh, stage=3, fn=loss)
  ms = {"shift": np.float32(0.5)}
  state = step.init(M.init_params(), model_state=ms)
  fn = lambda p, x, *, model_state: M.forward(p, x) + model_state["shift"]
  out = step.apply(state, fn, M.batch(0)["x"])
  np.testing.assert_allclose(np.asarray(out), np.asarray(
      M.forward(step.get_params(state), M.batch(0)["x"]) + 0.5), **TOL)
  with pytest.raises(TypeError, match="takes no model_state"):
    step.apply(state, M.forward, M.batch(0)["x"])


@pytest.mark.parametrize("stage", [2, 3])
def test_nnx_module_in_eval_mode_and_its_changes_dropped(mesh, stage):
  step = zj.make_sharded_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                                    M.OPTIMIZERS["sgd"](), mesh=mesh, stage=stage)
  state = M.trained(step, Net(nnx.Rngs(0, dropout=1)), steps=2)
  x = M.batch(0)["x"]
  before = M.host(state)
  out = step.apply(state, lambda m, x: m(x), x)
  model = step.get_model(state)
  model.eval()
  np.testing.assert_allclose(np.asarray(out), np.asarray(model(x)), **TOL)

  def train_mode(m, x):  # changes BatchNorm statistics and draws dropout keys
    m.train()
    return m(x)
  step.apply(state, train_mode, x)
  M.assert_bitwise_equal(M.host(state), before)


# ----------------------------------------------------------------------- memory
def test_stage3_apply_holds_a_layer_or_two_not_the_model():
  width = 256
  layer = (width * width + width) * 4
  temp = lambda layers: M.deep_compiled(layers, width, "apply").memory_analysis(
  ).temp_size_in_bytes
  t8, t16 = temp(8), temp(16)
  # Doubling the layers adds (almost) nothing: the loop holds the same one or two layers.
  assert t16 - t8 < layer, (t8, t16, layer)
  # And the whole: at most a few layers' bytes, far below the 16-layer model (4.2 MB).
  assert t16 < 4 * layer, (t16, layer)


# ----------------------------------------------------------------------- misuse
def test_misuse_is_named(mesh):
  step = M.make_step(mesh, stage=3)
  state = step.init(M.init_params())
  x = M.batch(0)["x"]
  with pytest.raises(TypeError, match=r"fn's output\['name'\] is a str"):
    step.apply(state, lambda p, x: {"y": M.forward(p, x), "name": "logits"}, x)
  with pytest.raises(TypeError, match=r"args\[1\] is a int.*functools.partial"):
    step.apply(state, lambda p, x, n: M.forward(p, x)[:n], x, 3)
  with pytest.raises(ValueError, match=r"fn's output\['mean'\] is a scalar.*split_args"):
    step.apply(state, lambda p, x: {"mean": jnp.mean(M.forward(p, x))}, x, split_args=True)
  with pytest.raises(ValueError, match=r"args\[0\] has leading dimension 12.*divisible by 8"):
    step.apply(state, M.forward, x[:12], split_args=True)
  with pytest.raises(TypeError, match="fn must be callable"):
    step.apply(state, x)
  other = M.make_step(mesh, stage=2)
  with pytest.raises(ValueError, match="not made by this step"):
    step.apply(other.init(M.init_params()), M.forward, x)


def test_compiled_once_per_function_and_shape(mesh):
  traces = []

  def fn(p, x):
    traces.append(1)
    return M.forward(p, x)

  step = M.make_step(mesh, stage=3)
  state = step.init(M.init_params())
  for t in range(3):
    step.apply(state, fn, M.batch(t)["x"])
  assert len(traces) == 1
  step.apply(state, fn, M.batch(0, rows=8)["x"])
  assert len(traces) == 2


def test_explicit_axes_inside_the_users_mesh_context():
  """Outputs on the user's Explicit mesh: replicated, or split as the args with split_args;
  args already split on that mesh are taken as they are."""
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  step = M.make_step(mesh, stage=3, opt="sgd")
  x = M.batch(0)["x"]
  with jax.set_mesh(mesh):
    state = M.trained(step)
    out = step.apply(state, M.forward, x)
    both = step.apply(state, lambda p, x: {"y": M.forward(p, x), "x": x}, x, split_args=True)
    split_x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
    from_split = step.apply(state, M.forward, split_x)
  ref = np.asarray(jax.jit(M.forward)(step.get_params(state), x))
  for o in (out, both["y"], from_split):
    np.testing.assert_allclose(np.asarray(o), ref, **TOL)
    assert o.sharding.mesh.axis_types == (jax.sharding.AxisType.Explicit,)
  assert out.sharding.is_fully_replicated and tuple(both["y"].sharding.spec)[:1] == ("data",)
  np.testing.assert_array_equal(np.asarray(both["x"]), x)


def test_an_output_that_varies_over_devices_comes_back_as_the_first_devices():
  """Replicated args give every device the same output; one that differs anyway (it reads
  the device's position) is returned replicated as the first device's."""
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  step = M.make_step(mesh, stage=3, axis_name=("replica", "data"), hpz_axis="data")
  state = step.init(M.init_params())
  where = lambda p, x: (M.forward(p, x),
                        1 + jax.lax.axis_index("data") + 10 * jax.lax.axis_index("replica"))
  logits, first = step.apply(state, where, M.batch(0)["x"])
  assert int(first) == 1 and first.sharding.is_fully_replicated
  np.testing.assert_allclose(np.asarray(logits), np.asarray(
      jax.jit(M.forward)(step.get_params(state), M.batch(0)["x"])), **TOL)


def test_a_function_remade_in_the_loop_is_warned_once(mesh):
  """A lambda written inside the loop is a new object each time: apply warns (once) that
  each compiles again; the same object, or a functools.partial, is quiet."""
  step = M.make_step(mesh, stage=3)
  state = step.init(M.init_params())
  x = M.batch(0)["x"]
  step.apply(state, lambda p, x: M.forward(p, x), x)  # a function used once: quiet
  with pytest.warns(UserWarning, match=r"new function object made from the same code"):
    for _ in range(3):
      step.apply(state, lambda p, x: M.forward(p, x), x)
  for _ in range(2):
    step.apply(state, functools.partial(M.forward, prefetch=0), x)
