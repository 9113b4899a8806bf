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

import re

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
HOSTS = {"mesh_shape": (2, 4), "axes": ("replica", "data"), "axis_name": ("replica", "data"),
         "hpz_axis": "data"}  # hpZ: gathered within a "host" of 4, reduced across 2
# name: (layers, optimizer, run options, compare with the reference? (True: to float
# rounding; a number: rtol, for a quantized hop; False: half precision, only that it
# trained), rtol vs prefetch=0: 0 where the order of operations is unchanged; 1e-6 where
# a closed-over leaf's gradient is summed over layers in another order)
FROZEN_B = {"emb": True, "layers": {"w": True, "b": False, "gain": True}, "head": True}
CASES = {
    "s3_sgd_7layers": (7, SGD, {"stage": 3}, True, 0),
    # the spans of `zero_jax.layers.loops.span`: layers 1-4 in the loops (an even count: the
    # first and last outside, residuals apart), 1-2 (one iteration), none (all three outside)
    "s3_sgd_6layers": (6, SGD, {"stage": 3}, True, 0),
    "s3_adam_4layers": (4, ADAM, {"stage": 3}, True, 0),
    "s3_sgd_3layers": (3, SGD, {"stage": 3}, True, 0),
    "s3_adam_1layer_offload": (1, ADAM, {"stage": 3, "offload": "optimizer"}, True, 0),
    "s2_sgd_2layers_weighted": (2, SGD, {"stage": 2, "kind": "weighted"}, True, 0),
    "s2_adam_hybrid_accum": (3, ADAM, {"stage": 2, "mesh_shape": (2, 4),
                                       "axes": ("replica", "data"), "replica_axis": "replica",
                                       "grad_accum_steps": 2}, True, 1e-6),
    "s3_sgd_hpz_aux": (2, SGD, {"stage": 3, **HOSTS, "kind": "aux"}, True, 0),
    "s3_sgd_hpz_qgz_across": (2, SGD, {"stage": 3, **HOSTS, "quantize": zj.Quantize(
        weights=False, block_size=64, across_only=True)}, 1e-3, 0),
    "s3_adam_hpz_replica_accum": (3, ADAM, {"stage": 3, "mesh_shape": (2, 2, 2),
                                            "axes": ("replica", "host", "data"),
                                            "replica_axis": "replica",
                                            "axis_name": ("host", "data"), "hpz_axis": "data",
                                            "grad_accum_steps": 2}, True, 0),
    # 5 layers: the backward loop runs (the hops across hosts two layers late)
    "s3_sgd_hpz_replica_5layers": (5, SGD, {"stage": 3, "mesh_shape": (2, 2, 2),
                                            "axes": ("replica", "host", "data"),
                                            "replica_axis": "replica",
                                            "axis_name": ("host", "data"), "hpz_axis": "data"},
                                   True, 0),
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
    "s3_sgd_param_specs_replica": (2, SGD, {"stage": 3, "mesh_shape": (2, 2, 2),
                                            "axes": ("replica", "data", "model"),
                                            "replica_axis": "replica",
                                            "param_specs": {"emb": P(), "head": P(), "layers": {
                                                "w": P(None, None, "model"), "b": P(),
                                                "gain": P()}}}, True, 0),
    "s3_adam_bf16_qwz_qgz": (2, ADAM, {"stage": 3, "precision": "bf16", "quantize": Q}, False, 0),
    "s3_sgd_fp16": (3, SGD, {"stage": 3, "precision": "fp16",
                             "loss_scale": zj.static_loss_scale(2.0 ** 8)}, False, 0),
    # A frozen stacked leaf is the same on every replica (it varies over fewer axes).
    "s3_adam_replica_frozen_b": (2, ADAM, {"stage": 3, "mesh_shape": (2, 4),
                                           "axes": ("replica", "data"),
                                           "replica_axis": "replica", "trainable": FROZEN_B},
                                 True, 0),
    "s3_sgd_hpz_frozen_b": (2, SGD, {"stage": 3, **HOSTS, "trainable": FROZEN_B}, True, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_prefetch_equals_no_prefetch_and_the_single_device_reference(case, full_compile):
  layers, opt, kw, exact, tol = CASES[case]
  step1, state1, losses1 = run(1, layers=layers, opt=opt(), **kw)
  step0, state0, losses0 = run(0, layers=layers, opt=opt(), **kw)
  p1, p0 = step1.get_params(state1), step0.get_params(state0)
  assert_tree_close(p1, p0, rtol=tol, atol=0, what=f"{case}: prefetch 1 vs 0 ")
  assert losses1 == losses0
  if exact:
    kind = kw.get("kind", "mean")
    mask = kw.get("trainable")
    ref, ref_losses, _ = reference_run(reference_loss(kind), opt(), make_params(layers),
                                       make_batches(), has_aux=kind == "aux", mask=mask)
    rtol = {} if exact is True else {"rtol": exact, "atol": exact}
    assert_tree_close(p1, ref[-1], what=f"{case}: prefetch 1 vs reference ", **rtol)
    np.testing.assert_allclose(losses1, [float(x) for x in ref_losses], rtol=rtol.get("rtol", 1e-5))
  else:  # half precision: it trained, and moved every leaf
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), p1, make_params(layers))
    assert min(jax.tree.leaves(moved)) > 0


# ------------------------------------------------------------------- Flax
LAYERS = 3


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(W, rngs=rngs)
    self.lin = nnx.Linear(W, W, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + self.drop(nnx.gelu(self.lin(self.norm(x))))


class NnxDeep(nnx.Module):
  """``nnx.vmap``-built blocks (their Dropout RNG counters are model state), looped over
  with ``zj.scan`` (``prefetch`` 0 or 1) or, as before ``zj.scan``, with ``nnx.scan`` over
  ``nnx.remat``; each layer under ``policy``."""

  def __init__(self, loop, rngs, policy=None):
    self.loop, self.policy = loop, policy
    self.embed = nnx.Linear(5, W, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxBlock(rngs)
    self.blocks = make(rngs)
    self.head = nnx.Linear(W, 3, rngs=rngs)

  def __call__(self, x):
    h = self.embed(x)
    if self.loop == "nnx.scan":
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat(policy=self.policy)
      def layer(h, block):
        return zj.gather(block)(h)
      h = layer(h, self.blocks)
    else:
      h, _ = zj.scan(lambda h, block: (block(h), None), h, self.blocks, prefetch=self.loop,
                     policy=self.policy)
    return self.head(h)


def nnx_loss(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.dots_saveable],
                         ids=["keep", "dots_saveable"])
def test_nnx_stack_with_dropout_equals_nnx_scan_and_keeps_its_rng_counters(mesh, policy):
  got = {}
  for loop in (1, "nnx.scan"):
    step = zj.make_sharded_train_step(nnx_loss, optax.adam(1e-2), mesh=mesh, stage=3,
                                      stacked=nnx.PathContains("blocks"))
    model = NnxDeep(loop, nnx.Rngs(0), policy)
    model.train()
    state = step.init(model)
    for b in make_batches():
      state, m = step(state, b)
    keys_as_data = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x
    got[loop] = jax.tree.map(keys_as_data, nnx.state(step.get_model(state)))
  assert_tree_close(got[1], got["nnx.scan"], rtol=1e-6, what="zj.scan vs nnx.scan ")
  counts = got[1]["blocks"]["drop"]["rngs"]["count"][...]
  np.testing.assert_array_equal(counts, np.full(LAYERS, STEPS))  # one draw per layer a step


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + nn.Dense(W)(nn.LayerNorm()(h)), None


class LinenStack(nn.Module):
  """Linen's ``nn.scan`` builds the stacked parameters (``params["stack"]``)."""

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=LAYERS)
    return stack(name="stack")(x, None)[0]


def linen_loss(params, batch):
  block = LinenBlock()
  apply = lambda h, p: block.apply({"params": p}, h, None)
  h, _ = zj.scan(apply, batch["x"] @ params["emb"], params["stack"])
  return jnp.mean((h @ params["head"] - batch["y"]) ** 2)


def test_linen_scan_params_applied_in_zj_scan_equal_the_reference(mesh):
  r = np.random.default_rng(3)
  params = {"emb": r.normal(size=(5, W)).astype(np.float32) / 2,
            "stack": LinenStack().init(jax.random.key(0), jnp.ones((2, W)))["params"]["stack"],
            "head": r.normal(size=(W, 3)).astype(np.float32) / 3}
  step = zj.make_sharded_train_step(
      linen_loss, optax.sgd(0.1), mesh=mesh, stage=3,
      stacked=lambda path, _: jax.tree_util.keystr(path).startswith("['stack']"))
  state = step.init(params)
  for b in make_batches():
    state, _ = step(state, b)
  ref, _, _ = reference_run(linen_loss, optax.sgd(0.1), params, make_batches())
  assert_tree_close(step.get_params(state), ref[-1], what="linen ")


# -------------------------------------------------------- the compiled schedule
DEEP, WIDE = 7, 128


def deep_loss(prefetch):
  def loss_fn(p, b):
    layer = lambda h, lp: (jnp.tanh(h @ lp["w"] + lp["b"]), None)
    h, _ = zj.scan(layer, b["x"], p["layers"], prefetch=prefetch)
    return jnp.mean((h - b["y"]) ** 2)
  return loss_fn


@pytest.fixture(scope="module")
def deep_compiled(mesh):
  """Stage 3, 7 layers of (128, 128) + (128,): compiled with prefetch 1 and 0."""
  params = {"layers": {"w": jax.ShapeDtypeStruct((DEEP, WIDE, WIDE), jnp.float32),
                       "b": jax.ShapeDtypeStruct((DEEP, WIDE), jnp.float32)}}
  batch = {k: jax.ShapeDtypeStruct((16, WIDE), jnp.float32) for k in ("x", "y")}
  out = {}
  for prefetch in (1, 0):
    step = zj.make_sharded_train_step(deep_loss(prefetch), optax.sgd(0.1), mesh=mesh,
                                      stage=3, stacked=True)
    out[prefetch] = step.lower(step.abstract_state(params), batch).compile()
  return out


def executed(text, op, shape, groups=None):
  """How many arrays shaped ``shape`` collectives ``op`` (over ``groups``, if given) move:
  once outside loops, the trip count inside one (XLA may combine several in one)."""
  match = lambda c: c.op == op and (groups is None or c.groups == groups)
  outside = sum(c.shapes.count(shape) for c in hlo_lib.collectives(text)
                if match(c) and not c.in_loop)
  return outside + sum(l.trip_count * sum(c.shapes.count(shape) for c in l.collectives
                                          if match(c)) for l in hlo_lib.loops(text))


def test_compiled_loops_carry_the_next_layer_and_reduce_the_previous_gradient(deep_compiled):
  text = deep_compiled[1].as_text()
  layer_loops = [l for l in hlo_lib.loops(text) if any(c.op == "all-gather" for c in l.collectives)]
  fwd, bwd = sorted(layer_loops, key=lambda l: any(c.op == "reduce-scatter" for c in l.collectives))
  # two layers an iteration (`zero_jax.layers.loops.UNROLL`) over the same layers both ways,
  # 1 to 4 (`zero_jax.layers.loops.span`); the ends, and the odd layer 5, run outside
  assert (fwd.trip_count, bwd.trip_count) == ((DEEP - 2) // 2, (DEEP - 2) // 2)
  for loop in (fwd, bwd):  # the loop carries a whole gathered layer, gathered for the next
    assert (WIDE, WIDE) in loop.carried and (WIDE,) in loop.carried
    # w and b (each split along its first dimension) in collectives of their own, with no
    # joined buffer: XLA:CPU has no combiner; on GPUs XLA joins them (tests/gpu/test_schedule)
    # (the backward pass needs w only: b's gradient does not read b). Per leaf, the first
    # layer's gather feeds the second layer; the second's is carried to the next iteration.
    gathers = [c for c in loop.collectives if c.op == "all-gather"]
    leaves = [[(WIDE,)], [(WIDE, WIDE)]] if loop is fwd else [[(WIDE, WIDE)]]
    assert sorted(c.shapes for c in gathers) == sorted(leaves * 2), gathers
    carried = [c for c in gathers if not c.used_by_compute and c.carried_to]
    assert sorted(c.shapes for c in carried) == leaves, gathers
  scatters = [c for c in bwd.collectives if c.op == "reduce-scatter"]
  # w's and b's gradients, each layer's reduced in the next layer's pullback: the first
  # layer's reads w's gradient the last iteration carried in, the second's the one the first
  # layer's matmul computed
  assert sorted(c.shapes for c in scatters) == sorted([[(WIDE // 8,)], [(WIDE // 8, WIDE)]] * 2)
  assert sorted(c.operand_from_compute for c in scatters if c.shapes == [(WIDE // 8, WIDE)]) == [
      False, True], scatters
  assert not any(c.op == "reduce-scatter" for c in fwd.collectives)
  # Each leaf gathered once per layer in each direction, reduce-scattered once per layer
  # (layer 0's backward re-gather too, issued in the loop's last iteration, though its
  # pullback needs no input gradient here, so nothing reads w there)
  assert executed(text, "all-gather", (WIDE, WIDE)) == 2 * DEEP
  assert executed(text, "all-gather", (WIDE,)) == DEEP
  for c in scatters:
    assert executed(text, "reduce-scatter", c.shapes[0]) == DEEP, c
  # Without prefetch each loop uses the layer it gathers in the same iteration.
  old = [c for l in hlo_lib.loops(deep_compiled[0].as_text()) for c in l.collectives
         if c.op == "all-gather"]
  assert sorted(c.shapes for c in old) == [[(WIDE,)], [(WIDE, WIDE)], [(WIDE, WIDE)]], old
  assert all(not c.carried_to for c in old)
  assert all(c.used_by_compute for c in old if c.shapes == [(WIDE, WIDE)])  # w: by the matmul


def _outside_loops(text: str) -> list:
  """The instructions a lowered program runs outside its loops: the entry computation's and
  those of what it calls, but not the bodies and conditions of its ``while``s."""
  comps = hlo_lib._computations(text)  # pylint: disable=protected-access
  todo, seen, out = [re.search(r"^ENTRY\s+%?([\w.\-]+)", text, re.M).group(1)], set(), []
  while todo:
    name = todo.pop()
    for ins in filter(None, map(hlo_lib.parse_instruction, comps.get(name, []))):
      out.append(ins)
      if ins.op != "while":
        todo += [c for c in ins.called if c not in seen]
        seen.update(ins.called)
  return out


@pytest.mark.parametrize("layers", [8, 7])
def test_no_code_outside_the_loops_reads_or_writes_the_stacked_residuals(mesh, layers):
  # Before: JAX ran the odd iteration of the two-layer forward loop after it (storing its
  # residuals into the stacks there) and the backward pass read layer 0's outside its loop;
  # XLA:GPU gave a whole stack the layout that code's matmul wanted and transposed it out of
  # the loops' and back (Llama-3-8B: four transposes of 3.9 GiB). Now only the loops touch
  # them: the first and last layers (and an odd one) keep their residuals apart.
  params = {"layers": {"w": jax.ShapeDtypeStruct((layers, WIDE, WIDE), jnp.float32),
                       "b": jax.ShapeDtypeStruct((layers, WIDE), jnp.float32)}}
  batch = {k: jax.ShapeDtypeStruct((16, WIDE), jnp.float32) for k in ("x", "y")}
  step = zj.make_sharded_train_step(deep_loss(1), optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=True)
  text = step.lower(step.abstract_state(params), batch).as_text(dialect="hlo")
  # a stack: one (2, WIDE) activation per device for each of several layers
  stack = lambda shape: re.fullmatch(rf"f32\[([2-9]|\d\d+),2,{WIDE}\](\{{.*\}})?", shape)
  outside = _outside_loops(text)
  shapes = {i.name: i.shape_text for i in outside}
  passing = ("while", "tuple", "get-tuple-element", "call", "broadcast", "opt-barrier",
             "optimization-barrier", "parameter")
  touched = [i.line.strip()[:120] for i in outside if i.op not in passing and (
      stack(i.shape_text) or any(stack(shapes.get(o, "")) for o in i.operands))]
  assert not touched, touched
  # the stacks are there, carried by both loops: layers 1 .. 2k (`zero_jax.layers.loops.span`)
  stacked = layers - 2 - layers % 2
  loops = hlo_lib.loops(step.lower(step.abstract_state(params), batch).compile().as_text())
  assert [(stacked, 2, WIDE) in l.carried for l in loops] == [True, True], loops


def test_a_layer_moves_the_same_way_whatever_the_bucket_size(mesh):
  """``bucket_bytes=0`` gives every leaf its own collective elsewhere; zj.scan moves a layer
  as it chooses whatever the bucket size: its leaves split along their first dimension (w
  and b here) in collectives of their own, which XLA:GPU joins into one each way (more
  than XLA:GPU keeps in flight would leave some waiting with no compute in their window:
  tests/gpu/test_schedule.py), the others in one joined buffer."""
  params = {"layers": {"w": jax.ShapeDtypeStruct((DEEP, WIDE, WIDE), jnp.float32),
                       "b": jax.ShapeDtypeStruct((DEEP, WIDE), jnp.float32),
                       "v": jax.ShapeDtypeStruct((DEEP, 3, WIDE), jnp.float32)}}
  batch = {k: jax.ShapeDtypeStruct((16, WIDE), jnp.float32) for k in ("x", "y")}

  def loss(p, b):
    def layer(h, w):
      return jnp.tanh(h @ w["w"] + w["b"] + w["v"].sum(0)), None
    h, _ = zj.scan(layer, b["x"], p["layers"], prefetch=1)
    return jnp.mean((h - b["y"]) ** 2)

  loops = {}
  for bucket_bytes in (0, 2**20):
    step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh, stage=3,
                                      stacked=True, bucket_bytes=bucket_bytes)
    text = step.lower(step.abstract_state(params), batch).compile().as_text()
    loops[bucket_bytes] = sorted(sorted((c.op, c.shapes) for c in l.collectives)
                                 for l in hlo_lib.loops(text) if l.collectives)
  assert loops[0] == loops[2**20]
  # v (3, 128) is split along its second dimension: it travels as rows in a joined buffer
  # (of one leaf here, which XLA:CPU gathers along that dimension), w and b alone
  # (two layers an iteration: each twice)
  assert loops[0][0] == sorted([("all-gather", [(3, WIDE)]), ("all-gather", [(WIDE,)]),
                                ("all-gather", [(WIDE, WIDE)])] * 2), loops[0]


def test_prefetch_memory_is_one_layer_more_per_direction_and_memory_report_counts_it(
    deep_compiled):
  layer = (WIDE * WIDE + WIDE) * 4
  loops = [l for l in hlo_lib.loops(deep_compiled[1].as_text()) if l.collectives]
  # What the loops carry beyond today's: forward one gathered layer, backward one gathered
  # layer and one layer's gradient (reduced one iteration late).
  assert sorted(l.carried.count((WIDE, WIDE)) for l in loops) == [1, 2]
  temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in deep_compiled.items()}
  # The peak (the backward loop's) grows by the gathered layer in flight and the layer
  # gradient being reduced, and no more (a margin of 1/16 layer for small buffers): the
  # backward's first gathers wait for its cotangent, or XLA:CPU, which drops the ordering
  # barriers before it schedules, would gather them at the start of the step (+4 layers).
  assert 0 < temp[1] - temp[0] <= 2 * layer + layer // 16, ((temp[1] - temp[0]) / layer, temp)
  params = {"layers": {"w": np.zeros((DEEP, WIDE, WIDE), np.float32),
                       "b": np.zeros((DEEP, WIDE), np.float32)}}
  report = zj.memory_report(params, optax.sgd(0.1), n_devices=8, stacked=True, prefetch=1)
  assert report[3].prefetch == 2 * layer  # a gathered layer and a layer's gradient
  assert report[2].prefetch == layer      # stage 2: the delayed gradient
  assert report[1].prefetch == report[0].prefetch == 0
  plain = zj.memory_report(params, optax.sgd(0.1), n_devices=8, stacked=True)
  assert report[3].total == plain[3].total + 2 * layer and plain[3].prefetch == 0
  assert "prefetch" in str(report) and "prefetch" not in str(plain)


@pytest.fixture(scope="module")
def hosts_compiled():
  """Stage 3 on replica x host x data (2, 2, 2) with hpZ within a host: gathered over
  "data", reduced on across "host" (hpZ's outer hop) and "replica" (all-reduce)."""
  mesh = jax.make_mesh((2, 2, 2), ("replica", "host", "data"))
  params = {"layers": {"w": jax.ShapeDtypeStruct((DEEP, WIDE, WIDE), jnp.float32),
                       "b": jax.ShapeDtypeStruct((DEEP, WIDE), jnp.float32)}}
  batch = {k: jax.ShapeDtypeStruct((16, WIDE), jnp.float32) for k in ("x", "y")}
  out = {}
  for prefetch in (1, 0):
    step = zj.make_sharded_train_step(deep_loss(prefetch), optax.sgd(0.1), mesh=mesh, stage=3,
                                      stacked=True, replica_axis="replica",
                                      axis_name=("host", "data"), hpz_axis="data")
    out[prefetch] = step.lower(step.abstract_state(params), batch).compile().as_text()
  return out


# device id = 4 * replica + 2 * host + data
ACROSS_HOSTS = [(0, 2), (1, 3), (4, 6), (5, 7)]
ACROSS_REPLICAS = [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_cross_host_and_replica_hops_run_in_the_backward_loop_layers_late(hosts_compiled):
  """The gradient's hops across hosts (hpZ) and replicas run per layer in the backward
  loop, bucketed (one collective each for w and b), each on what the previous iteration's
  hop carried in (layer i+1's reduced within the host, layer i+2's across hosts, layer
  i+3's across replicas: no hop waits for another); none waits for the end of the
  backward pass."""
  text = hosts_compiled[1]
  bwd = [l for l in hlo_lib.loops(text) if any(c.op == "reduce-scatter" for c in l.collectives)]
  # the first and the last three layers' backward run outside the loop (no layer i+3 yet);
  # one layer an iteration: the blocks (hpZ's within the host, the same on every replica)
  # vary over fewer axes than the activations (`zero_jax.layers.loops.Stack.unroll`)
  assert len(bwd) == 1 and bwd[0].trip_count == DEEP - 4
  inner = [c for c in bwd[0].collectives if c.op == "reduce-scatter" and len(c.groups[0]) == 2
           and c.groups != ACROSS_HOSTS]
  assert inner and not any(c.operand_from_compute or c.used_by_compute for c in inner), inner
  hops = {}
  for c in bwd[0].collectives:
    hops.setdefault((c.op, tuple(c.groups)), []).append(c)
  outer = hops[("reduce-scatter", tuple(ACROSS_HOSTS))]
  replica = hops[("all-reduce", tuple(ACROSS_REPLICAS))]
  for c in outer + replica:
    assert not c.operand_from_compute and not c.used_by_compute, c
  # one layer's w (128, 128) and b (128,), each split along its first dimension, in
  # collectives of their own (XLA:CPU does not join them), their rows over 2 x 2 devices
  blocks = [[(WIDE // 4,)], [(WIDE // 4, WIDE)]]
  assert sorted(c.shapes for c in outer) == blocks, outer
  assert sorted(x for c in replica for x in c.shapes) == sorted(  # (XLA:CPU may join these)
      [(WIDE // 4,), (WIDE // 4, WIDE)]), replica
  for shape in blocks:
    assert executed(text, "reduce-scatter", shape[0], ACROSS_HOSTS) == DEEP  # per layer
    assert executed(text, "all-reduce", shape[0], ACROSS_REPLICAS) == DEEP
  assert not any(c.op == "reduce-scatter" and c.groups == ACROSS_HOSTS and c.shapes not in blocks
                 for c in hlo_lib.collectives(text)), "a whole stack reduced after the loop"
  # prefetch=0 (zj.gather in a checkpointed lax.scan): the same hops, in its backward loop
  old = [c for l in hlo_lib.loops(hosts_compiled[0]) for c in l.collectives]
  assert {("reduce-scatter", tuple(ACROSS_HOSTS)), ("all-reduce", tuple(ACROSS_REPLICAS))} <= {
      (c.op, tuple(c.groups or ())) for c in old}


# ------------------------------------------------- stage 2's parameter rebuild
def two_stacks_loss(p, b):
  """A 5-layer stack of four uneven leaves (12 rows, padded to 16) and a 3-layer one."""
  def block(h, lp):
    lp = zj.gather(lp)
    h = jnp.tanh(h @ lp["w"] + lp["b"])
    return jnp.tanh(h @ lp["up"]) @ lp["down"] + h, None
  h, _ = jax.lax.scan(jax.checkpoint(block), b["x"] @ p["emb"], p["blocks"])
  h, _ = jax.lax.scan(jax.checkpoint(lambda h, w: (jnp.tanh(h @ zj.gather(w)), None)), h,
                      p["enc"])
  return jnp.mean((h @ p["head"] - b["y"]) ** 2)


def test_stage2_rebuilds_each_stack_in_one_loop_bucketed_bit_for_bit(mesh):
  """The update gathers every stacked leaf of a depth in one loop over the layers, a
  layer's leaves in one bucketed all-gather, into the leaves' own buffers; the parameters
  equal, bit for bit, those of the same step without stacked= (whole leaves gathered)."""
  r = np.random.default_rng(2)
  f = lambda *s: (r.normal(size=s) * 0.3).astype(np.float32)
  params = {"emb": f(5, W), "blocks": {"w": f(5, W, W), "b": f(5, W), "up": f(5, W, 2 * W),
                                       "down": f(5, 2 * W, W)},
            "enc": f(3, W, W), "head": f(W, 3)}
  got = {}
  for stacked in (lambda path, _: "'blocks'" in jax.tree_util.keystr(path) or
                  "'enc'" in jax.tree_util.keystr(path), None):
    step = zj.make_sharded_train_step(two_stacks_loss, optax.adam(1e-2), mesh=mesh, stage=2,
                                      stacked=stacked)
    state = step.init(params)
    if stacked is not None:
      text = step.lower(state, make_batches()[0]).compile().as_text()
    for b in make_batches():
      state, _ = step(state, b)
    got[stacked is not None] = step.get_params(state)
  jax.tree.map(np.testing.assert_array_equal, got[True], got[False])
  gathers = [l for l in hlo_lib.loops(text) if any(c.op == "all-gather" for c in l.collectives)]
  assert sorted(l.trip_count for l in gathers) == [3, 5]  # one loop per depth
  five = next(l for l in gathers if l.trip_count == 5)
  # one all-gather per layer carrying w (12 rows padded to 16: 2 a device), b (2), up and
  # down (24 split 8 ways: 3 a device)
  assert [(c.op, c.shapes) for c in five.collectives] == [
      ("all-gather", [(8, 2 * W + 2 + W * 3 + 3 * W)])]


# ----------------------------------------------------------- outside, misuse
def test_outside_the_step_it_is_lax_scan_and_modules_update():
  p, b = make_params(4), make_batches()[0]
  for prefetch in (0, 1):
    assert make_loss(prefetch)(p, b) == make_loss(0)(p, b)
  layer = lambda h, lp: (jnp.tanh(h @ lp["w"] + lp["b"]) * lp["gain"], h.sum())
  h, ys = zj.scan(layer, b["x"] @ p["emb"], p["layers"])
  h2, ys2 = jax.lax.scan(layer, b["x"] @ p["emb"], p["layers"])
  np.testing.assert_array_equal(h, h2)
  np.testing.assert_array_equal(ys, ys2)
  model = NnxDeep(1, nnx.Rngs(0))
  model(b["x"])  # dropout draws once per layer: the counters are written back
  np.testing.assert_array_equal(model.blocks.drop.rngs.count[...], np.ones(LAYERS))


def test_an_empty_stack_returns_the_carry_as_lax_scan_does(mesh):
  """Zero layers at stage 3: the carry comes back and the other leaves train as without it."""
  def loss(prefetch):
    def fn(p, b):
      h, ys = zj.scan(lambda h, lp: (jnp.tanh(h @ lp["w"]), h[:, 0]), b["x"] @ p["emb"],
                      p["layers"], prefetch=prefetch)
      assert ys.shape == (0, b["x"].shape[0])
      return jnp.mean((h @ p["head"] - b["y"]) ** 2)
    return fn
  params = {k: v for k, v in make_params(0).items() if k != "layers"}
  params["layers"] = {"w": np.zeros((0, W, W), np.float32)}
  b = make_batches()[0]
  plain = lambda p, b: jnp.mean((b["x"] @ p["emb"] @ p["head"] - b["y"]) ** 2)
  ref, _, _ = reference_run(plain, optax.sgd(0.1), params, [b])
  for prefetch in (0, 1):
    step = zj.make_sharded_train_step(loss(prefetch), optax.sgd(0.1), mesh=mesh, stage=3,
                                      stacked=STACKED)
    state, _ = step(step.init(params), b)
    assert_tree_close(step.get_params(state), ref[-1], what=f"prefetch={prefetch} ")


def test_misuse_is_refused_with_what_to_do(mesh):
  p, x = make_params(3), jnp.ones((2, W))
  for bad in (2, 1.0, True):
    with pytest.raises(ValueError, match=rf"prefetch={bad}.*choose 1.*or 0"):
      zj.scan(lambda h, lp: (h, None), x, p["layers"], prefetch=bad)
  with pytest.raises(ValueError, match=r"memory_report: prefetch=1.0.*choose 1"):
    zj.memory_report(p, optax.sgd(0.1), n_devices=8, prefetch=1.0)
  with pytest.raises(ValueError, match=r"different numbers of layers.*\['v'\]: 2.*\['w'\]: 3"):
    zj.scan(lambda h, lp: (h, None), x, {"w": p["layers"]["w"], "v": jnp.ones((2, 4))})
  with pytest.raises(ValueError, match=r"stacked\['s'\] is a scalar"):
    zj.scan(lambda h, lp: (h, None), x, {"s": jnp.float32(1)})
  with pytest.raises(TypeError, match=r"must return a pair \(carry, y\)"):
    zj.scan(lambda h, lp: h, x, p["layers"])
  def bad_carry(p, b):  # returns a carry of another shape: named at trace time in the step
    h, _ = zj.scan(lambda h, lp: (h[:, :3], None), b["x"] @ p["emb"], p["layers"])
    return jnp.mean(h)
  step = zj.make_sharded_train_step(bad_carry, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked=STACKED)
  with pytest.raises(TypeError, match=r"same structure, shapes and dtypes as init.*\(2, 12\).*\(2, 3\)"):
    step(step.init(p), make_batches()[0])
