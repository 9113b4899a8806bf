"""Stacked layers at stage 3: gathered one layer at a time inside the loss, memory 1/N.

Leaves marked ``stacked=`` are stacks of per-layer weights that ``loss_fn``
scans over. At stage 3 each device keeps 1/N of every layer and ``loss_fn``
gathers a layer's slice with ``zj.gather`` inside the scan body, so the
compiled step has no whole-model gather and its temp memory falls like 1/N.
The numbers must equal stage 2's and a single-device optax reference (which
runs the same ``loss_fn``, where ``zj.gather`` is the identity).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import (N, assert_stage3_equals_stage2_equals_reference,
                              assert_tree_close, collectives, reference_run, shapes_in)

LAYERS, WIDTH, BATCH, STEPS = 5, 12, 16, 3  # 12 is padded to 16 on 8 devices
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
STACKED = {"emb": False, "layers": True, "head": False}


def make_params():
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.4).astype(np.float32)
  return {"emb": f(5, WIDTH),
          "layers": {"w": f(LAYERS, WIDTH, WIDTH), "b": f(LAYERS, WIDTH),
                     "gain": (1 + f(LAYERS)).astype(np.float32)},  # (L,): replicated
          "head": f(WIDTH, 3)}


def loss_fn(p, b):
  @jax.checkpoint  # the backward pass gathers each layer again
  def layer(h, lp):
    lp = zj.gather(lp)
    return jnp.tanh(h @ lp["w"] + lp["b"]) * lp["gain"], None

  h = b["x"] @ p["emb"]
  h, _ = jax.lax.scan(layer, h, p["layers"])
  return jnp.mean((h @ p["head"] - b["y"]) ** 2)


def make_batches(n=STEPS):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(BATCH, 5)).astype(np.float32),
           "y": r.normal(size=(BATCH, 3)).astype(np.float32)} for _ in range(n)]


def train(mesh, opt, stage, batches, **kw):
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, stage=stage, stacked=STACKED, **kw)
  state = step.init(make_params())
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return step, state, losses


def reparametrized_loss(p, b):
  """The stack mapped through a nonlinear function before the loop (``jax.tree.map``
  reaches every child of a `zj.ShardedParam`), a layer gathered inside it as in `loss_fn`;
  ``zj.scan``'s loop (NNX's ``nnx.scan`` alike) takes the same tree."""
  return loss_fn({**p, "layers": jax.tree.map(jnp.tanh, p["layers"])}, b)


HOSTS = {"mesh_shape": (2, 4), "axes": ("host", "data"), "axis_name": ("host", "data")}


@pytest.mark.parametrize("stage,kw", [
    (2, {}), (3, {}), (3, {**HOSTS, "hpz_axis": "data"}),
    (3, {"mesh_shape": (2, 4), "axes": ("replica", "data"), "replica_axis": "replica"}),
    (3, {"grad_accum_steps": 2, "gather_once": True})],
    ids=["s2", "s3", "s3_hpz", "s3_replica", "s3_gather_once"])
def test_a_function_mapped_over_the_stack_is_differentiated_at_the_weights(stage, kw):
  # Its gradient reaches the stand-ins whose gradients are the reduced ones (stage 2's
  # block, stage 3's sink with hpZ or replica axes): they hold the device's weights.
  mesh = jax.make_mesh(kw.pop("mesh_shape", (N,)), kw.pop("axes", ("data",)))
  step = zj.make_sharded_train_step(reparametrized_loss, optax.sgd(0.1), mesh=mesh,
                                    stage=stage, stacked=STACKED, **kw)
  state = step.init(make_params())
  for b in make_batches():
    state, _ = step(state, b)
  ref, _, _ = reference_run(reparametrized_loss, optax.sgd(0.1), make_params(), make_batches())
  assert_tree_close(step.get_params(state), ref[-1])


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_stacked_stage3_equals_stage2_equals_single_device(mesh, opt_name):
  batches = make_batches()
  assert_stage3_equals_stage2_equals_reference(
      train(mesh, OPTIMIZERS[opt_name](), 3, batches),
      train(mesh, OPTIMIZERS[opt_name](), 2, batches),
      loss_fn, OPTIMIZERS[opt_name](), make_params(), batches)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_stacked_stage3_equals_stage2_in_mixed_precision(mesh, precision):
  # Half-precision gathers and loss scaling inside the layer loop: the fp32 master
  # weights agree to half-precision rounding of the gradients (Adam moves each
  # parameter by about 3e-2 over these steps, so a scale or dtype bug shows).
  batches = make_batches()
  runs = [train(mesh, optax.adam(1e-2), s, batches, precision=precision) for s in (3, 2)]
  (step3, state3, _), (step2, state2, _) = runs
  assert_tree_close(step3.get_params(state3), step2.get_params(state2), rtol=0, atol=5e-4,
                    what=f"{precision} stage 3 vs 2")


def test_stacked_frozen_leaves_and_accumulation_match_masked_reference(mesh):
  batches = make_batches(2)
  mask = jax.tree.map(lambda _: True, make_params())
  mask["layers"]["b"] = False
  step, state, _ = train(mesh, optax.adam(1e-2), 3, batches, grad_accum_steps=2,
                         trainable=mask)
  ref, _, _ = reference_run(loss_fn, optax.adam(1e-2), make_params(), batches, mask=mask)
  got = step.get_params(state)
  assert_tree_close(got, ref[-1], what="stage 3, k=2, frozen b")
  np.testing.assert_array_equal(got["layers"]["b"], make_params()["layers"]["b"])


def test_stacked_leaves_are_split_within_each_layer(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=STACKED)
  state = step.init(make_params())
  layouts = dict(zip([jax.tree_util.keystr(p) for p, _ in
                      jax.tree_util.tree_flatten_with_path(state.params)[0]],
                     state.meta.param_layouts))
  assert layouts["['layers']['w']"] == zj.Layout((LAYERS, WIDTH, WIDTH), 1, 16)
  assert layouts["['layers']['b']"] == zj.Layout((LAYERS, WIDTH), 1, 16)
  assert layouts["['layers']['gain']"].dim is None  # nothing to split within a layer
  w = state.params["layers"]["w"]
  assert w.addressable_shards[0].data.shape == (LAYERS, 16 // N, WIDTH)


def test_gathering_the_whole_stack_a_range_or_one_layer_matches_reference(mesh):
  def loss_by_index(p, b):
    h = b["x"] @ p["emb"]
    w_all = zj.gather(p["layers"]["w"])             # every layer at once
    w_first = zj.gather(p["layers"]["w"][:2])       # a range of layers
    last = zj.gather(jax.tree.map(lambda x: x[-1], p["layers"]))  # one layer, all leaves
    for i in range(2):
      h = jnp.tanh(h @ w_first[i])
    h = jnp.tanh(h @ w_all[2] + zj.gather(p["layers"]["b"][2]))
    h = jnp.tanh(h @ last["w"] + last["b"]) * last["gain"]
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)

  batches = make_batches(2)
  step = zj.make_sharded_train_step(loss_by_index, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=STACKED)
  state = step.init(make_params())
  for b in batches:
    state, _ = step(state, b)
  ref, _, _ = reference_run(loss_by_index, optax.sgd(0.1), make_params(), batches)
  assert_tree_close(step.get_params(state), ref[-1], what="indexed gathers")


# ------------------------------------------------------------------ memory
def deep_loss(p, b):
  @jax.checkpoint
  def layer(h, lp):
    lp = zj.gather(lp)
    return jax.nn.gelu(h @ lp["w"] + lp["b"]), None

  h, _ = jax.lax.scan(layer, b["x"], p)
  return jnp.mean((h - b["y"]) ** 2)


def compiled(n, stage, layers=8, width=256):
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  params = {"w": jax.ShapeDtypeStruct((layers, width, width), jnp.float32),
            "b": jax.ShapeDtypeStruct((layers, width), jnp.float32)}
  batch = {k: jax.ShapeDtypeStruct((32, width), jnp.float32) for k in ("x", "y")}
  step = zj.make_sharded_train_step(deep_loss, optax.adam(1e-3), mesh=mesh, stage=stage,
                                    stacked=True)
  return step.lower(step.abstract_state(params), batch).compile()


def test_stacked_stage3_memory_falls_with_n_and_never_holds_the_whole_model():
  model_bytes = 8 * (256 * 256 + 256) * 4
  temp = {}
  for n in (1, 2, 4, 8):
    c = compiled(n, 3)
    temp[n] = c.memory_analysis().temp_size_in_bytes
    entry = c.as_text()[c.as_text().index("\nENTRY"):]
    assert "all-gather" not in entry, n  # every gather is inside the layer loop
  assert temp[1] > temp[2] > temp[4] > temp[8], temp
  assert temp[8] < temp[1] / 4, temp
  # Fewer bytes than the gathered model: at most a few layers are ever whole.
  assert temp[8] < model_bytes / 2, (temp, model_bytes)
  stage2 = compiled(8, 2).memory_analysis()
  stage3 = compiled(8, 3).memory_analysis()
  total = lambda m: m.temp_size_in_bytes + m.argument_size_in_bytes
  assert total(stage3) < total(stage2) / 2, (total(stage3), total(stage2))


def unrolled_loss(p, b):
  h = b["x"]
  for name in sorted(p):
    h = jax.nn.gelu(h @ p[name]["w"] + p[name]["b"])
  return jnp.mean((h - b["y"]) ** 2)


def compiled_unrolled_stage2(n, layers=8, width=256):
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  params = {f"l{i}": {"w": jax.ShapeDtypeStruct((width, width), jnp.float32),
                      "b": jax.ShapeDtypeStruct((width,), jnp.float32)} for i in range(layers)}
  batch = {k: jax.ShapeDtypeStruct((32, width), jnp.float32) for k in ("x", "y")}
  step = zj.make_sharded_train_step(unrolled_loss, optax.adam(1e-3), mesh=mesh, stage=2)
  return step.lower(step.abstract_state(params), batch).compile()


def test_stacked_stage2_reduce_scatters_inside_the_loop_and_its_temp_falls_with_n():
  temp = {}
  for n in (1, 2, 4, 8):
    c = compiled(n, 2)
    temp[n] = c.memory_analysis().temp_size_in_bytes
  assert temp[1] > temp[2] > temp[4] > temp[8], temp
  # The whole (L, W, W) gradient at N=1; a 1/8 block, plus a layer's bucket, at N=8.
  assert temp[8] < temp[1] / 3, temp
  colls = collectives(compiled(8, 2).as_text())
  assert any(op == "reduce-scatter" and in_loop for op, _, in_loop in colls), colls
  # No whole (L, W, W) gradient is reduce-scattered after the loop.
  after = [s for op, shape, in_loop in colls if op == "reduce-scatter" and not in_loop
           for s in shapes_in(shape)]
  assert not any(len(s) == 3 for s in after), after
  unrolled = compiled_unrolled_stage2(8).memory_analysis().temp_size_in_bytes
  assert temp[8] <= unrolled, (temp, unrolled)


# ------------------------------------------------------------------- misuse
@pytest.mark.parametrize("stage", [2, 3])
def test_using_a_stacked_leaf_without_gather_names_the_leaf(mesh, stage):
  def forgot(p, b):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"] @ p["emb"],
                        p["layers"]["w"])
    return jnp.mean(h)

  step = zj.make_sharded_train_step(forgot, optax.sgd(0.1), mesh=mesh, stage=stage,
                                    stacked=STACKED)
  with pytest.raises(TypeError, match=r"params\['layers'\]\['w'\].*zj.gather"):
    step(step.init(make_params()), make_batches(1)[0])


def test_gathering_a_slice_across_layers_names_the_leaf(mesh):
  def bad_slice(p, b):
    w = zj.gather(p["layers"]["w"][:, :, 0])  # sliced along the split dimension
    return jnp.mean(b["x"] @ p["emb"] @ w.T)

  step = zj.make_sharded_train_step(bad_slice, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=STACKED)
  with pytest.raises(ValueError, match=r"params\['layers'\]\['w'\].*leading"):
    step(step.init(make_params()), make_batches(1)[0])


@pytest.mark.parametrize("stacked,error,match", [
    ({"emb": False, "layers": {"w": True, "b": True, "gain": True}, "head": 1}, TypeError,
     r"stacked\['head'\] is 1"),
    ({"layers": True}, ValueError, "stacked= must be a pytree of bools"),
])
def test_malformed_stacked_option_is_refused(mesh, stacked, error, match):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=stacked)
  with pytest.raises(error, match=match):
    step.init(make_params())


def test_a_scalar_cannot_be_stacked(mesh):
  step = zj.make_sharded_train_step(lambda p, b: p["s"] * jnp.mean(b["x"]), optax.sgd(0.1),
                                    mesh=mesh, stage=3, stacked=True)
  with pytest.raises(ValueError, match=r"params\['s'\].*scalar"):
    step.init({"s": np.float32(1.0)})


# ------------------------------------------------- a stacked= that selects nothing
_NO_MATCH = {  # name: (stacked= as the user wrote it, how the message names it)
    "function": (lambda path, _: jax.tree_util.keystr(path).startswith("['layer']"),
                 r"stacked=<function <lambda>>"),
    "all_false_tree": ({"emb": False, "layers": False, "head": False},
                       r"stacked=\{'emb': False, 'layers': False, 'head': False\}"),
}


@pytest.mark.parametrize("case", sorted(_NO_MATCH))
def test_a_stacked_option_that_selects_nothing_is_an_error_at_stage_3(mesh, case):
  """Issue 48: at stage 3 such a step gathered every parameter whole, silently."""
  stacked, named = _NO_MATCH[case]
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=stacked)
  message = (named + r" marks no parameter as a stack of layers: none of the 5 leaves is "
             r"selected. The parameters are: params\['emb'\], params\['head'\], "
             r"params\['layers'\]\['b'\], params\['layers'\]\['gain'\], "
             r"params\['layers'\]\['w'\]\. At stage 3 .*memory stage 3 saves would be gone")
  with pytest.raises(ValueError, match=message):
    step.init(make_params())
  with pytest.raises(ValueError, match=message):  # and before anything is allocated
    step.abstract_state(make_params())


@pytest.mark.parametrize("stage", [1, 2])
def test_a_stacked_option_that_selects_nothing_warns_at_stages_1_and_2(mesh, stage):
  stacked, named = _NO_MATCH["function"]
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=stage,
                                    stacked=stacked)
  with pytest.warns(UserWarning, match=named + r" marks no parameter.*params\['layers'\]\['w'\]"
                                               r".*at stage 3 it is an error"):
    step.init(make_params())
  quiet = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=stage)
  quiet.init(make_params())  # stacked=None (not given): no warning (filterwarnings=error)


def test_an_nnx_filter_that_selects_nothing_is_named_as_written(mesh):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class Model(nnx.Module):
    def __init__(self):
      self.blocks = nnx.Param(jnp.ones((LAYERS, 4, 4)))
      self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

  step = zj.make_sharded_train_step(lambda m, b: jnp.mean(b["x"] @ m.head.kernel[...]),
                                    optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=nnx.PathContains("block"))
  with pytest.raises(ValueError, match=r"stacked=nnx.PathContains\('block', exact=True\) marks "
                                       r"no parameter.*params\['blocks'\], "
                                       r"params\['head'\]\['bias'\].*Did you mean "
                                       r"nnx.PathContains\('blocks'\)\?"):
    step.init(Model())


# -------------------------------------------------------------------- Flax
class Block(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + nn.Dense(h.shape[-1])(nn.LayerNorm()(h)), None


class ScannedModel(nn.Module):
  """The Flax way: gather in map_variables, remat the block, scan the stack."""
  layers: int = 3

  @nn.compact
  def __call__(self, x):
    block = nn.map_variables(Block, "params", trans_in_fn=zj.gather,
                             init=self.is_initializing())
    stack = nn.scan(nn.remat(block), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=self.layers)
    h, _ = stack(name="stack")(nn.Dense(WIDTH)(x), None)
    return nn.Dense(3)(h)


def test_flax_scanned_model_trains_at_stage3_like_single_device(mesh):
  model = ScannedModel()
  batches = make_batches()
  params = model.init(jax.random.key(0), batches[0]["x"])["params"]
  flax_loss = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
  step = zj.make_sharded_train_step(
      flax_loss, optax.adam(1e-2), mesh=mesh, stage=3,
      stacked=lambda path, _: jax.tree_util.keystr(path).startswith("['stack']"))
  state = step.init(params)
  for b in batches:
    state, _ = step(state, b)
  assert state.meta.stacked.count(True) == 4  # kernel, bias, LayerNorm scale and bias
  ref, _, _ = reference_run(flax_loss, optax.adam(1e-2), params, batches)
  assert_tree_close(step.get_params(state), ref[-1], what="flax stage 3")


def test_memory_report_counts_the_stacked_layouts(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=3,
                                    stacked=STACKED)
  state = step.init(make_params())
  report = zj.memory_report(make_params(), optax.adam(1e-2), n_devices=N, stacked=STACKED)
  held = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
  assert report[3].params == held(state.params)
  assert report[3].optimizer_state == held(state.opt_state)
  unstacked = zj.memory_report(make_params(), optax.adam(1e-2), n_devices=N)
  assert unstacked[3].params != report[3].params  # (5, 12, 12) pads differently
