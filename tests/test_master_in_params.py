"""Stage 3 with ``precision="bf16"``/``"fp16"`` keeps no half-precision copy beside the master.

The state keeps each master leaf once, in float32, split, as its parameter; the step casts each
device's block to the compute dtype as it gathers it (a stacked leaf's a layer at a time:
`zero_jax.comm.collectives.in_gather_dtype`) and the update writes the float32 block only. The half
copy the previous layout kept was written by the update as exactly that cast of the float32 value,
so every number must be the same, bit for bit: each test runs the same step in both layouts (the
previous one is what `zero_jax.step.state.master_in_params` returning False gives: the state
``main``'s code made, which ``hpz_axis=`` and ``offload=`` still make) and compares everything a
user can read. The comparison against single-device optax (SGD and Adam, bf16 and fp16, with bounds
derived for any rounding order) is tests/test_precision.py's, which runs stage 3 in this layout.
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zero_jax as zj
import _forward_model as M
import _whole_leaf_model as W
from _held import held_converts, held_shapes
import test_lookup as L
from zero_jax.checkpoint import master_form
from zero_jax.comm import layout as lay
from zero_jax.step import state as state_lib
from zero_jax.step import update as update_lib

F32 = jnp.dtype(jnp.float32)
STEPS = 4


@pytest.fixture(autouse=True)
def _default_compile(full_compile):
  """Two different programs pinned to the same bits: compiled as users compile them
  (tests/_compile.py), not the quicker way of the other tests."""
  yield


@contextlib.contextmanager
def previous_layout(monkeypatch, old: bool = True):
  """Steps built and run inside keep the half-precision copy beside the master at stage 3 (the
  layout of zero_jax before this change)."""
  with monkeypatch.context() as m:
    if old:
      m.setattr(state_lib, "master_in_params", lambda spec: False)
    yield


def run(make, params, batches, monkeypatch, *, old: bool, init=None):
  """``(step, state, host metrics per step, host states)`` of ``make()``'s step trained on
  ``batches``, in the previous layout when ``old``."""
  with previous_layout(monkeypatch, old):
    step = make()
    state = step.init(params, **(init or {}))
    metrics = []
    for b in batches:
      state, m = step(state, b)
      metrics.append(M.host({k: v for k, v in m.items() if k != "health"}))
    return step, state, metrics


def the_same(make, params, batches, monkeypatch, *, init=None, forward=None):
  """Both layouts give the same numbers bit for bit: every step's metrics, the parameters
  (`get_params`: the float32 master), the optimizer state and loss scale, the half-precision
  values the loss saw (the old layout's ``params`` against the new one's master rounded), and
  ``step.evaluate`` / ``step.apply`` (``forward``) on the final state."""
  new_step, new, m_new = run(make, params, batches, monkeypatch, old=False, init=init)
  old_step, old, m_old = run(make, params, batches, monkeypatch, old=True, init=init)
  assert new.meta.master_in_params and new.master is None
  assert not old.meta.master_in_params and old.master is not None
  M.assert_bitwise_equal(m_new, m_old)
  M.assert_bitwise_equal(M.host(new_step.get_params(new)), M.host(old_step.get_params(old)))
  M.assert_bitwise_equal(M.host((new.opt_state, new.loss_scale, new.step)),
                         M.host((old.opt_state, old.loss_scale, old.step)))
  M.assert_bitwise_equal(M.host(master_form.saved_form(new).params), M.host(old.params))
  M.assert_bitwise_equal(M.host(master_form.saved_form(new).master), M.host(old.master))
  b = batches[0]
  with previous_layout(monkeypatch, True):
    old_eval = M.host(old_step.evaluate(old, b))
    old_out = None if forward is None else M.host(old_step.apply(old, forward, b))
  M.assert_bitwise_equal(M.host(new_step.evaluate(new, b)), old_eval)
  if forward is not None:
    M.assert_bitwise_equal(M.host(new_step.apply(new, forward, b)), old_out)
  return new_step, new, m_new


def batches(n=STEPS):
  return [M.batch(t) for t in range(1, n + 1)]


def logits(p, b):
  return M.forward(p, b["x"])


# ------------------------------------------------------------------ the layout
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_state_keeps_the_split_float32_master_as_its_parameters(mesh, precision):
  seen = set()

  def recording(p, b):  # what the loss computes with: the values gathered
    seen.update(str(x.dtype) for x in jax.tree.leaves(zj.gather(p)))
    return M.loss_fn(p, b)
  step = zj.make_sharded_train_step(recording, optax.adam(1e-2), mesh=mesh, stage=3,
                                    precision=precision, stacked=M.STACKED)
  state = step.init(M.init_params())
  assert state.master is None and state.meta.master_in_params
  for x, layout in zip(jax.tree.leaves(state.params), state.meta.param_layouts):
    assert x.dtype == F32 and x.shape == layout.storage_shape
    for shard in x.addressable_shards:  # 1/N of the padded leaf on every device
      expect = list(layout.storage_shape)
      if layout.dim is not None:
        expect[layout.dim] //= 8
      assert shard.data.shape == tuple(expect)
  state, _ = step(state, M.batch(0))
  assert seen == {precision.replace("bf16", "bfloat16").replace("fp16", "float16")}
  assert state.master is None and {x.dtype for x in jax.tree.leaves(state.params)} == {F32}
  # The init values themselves, not a rounding of them.
  state = step.init(M.init_params())
  M.assert_bitwise_equal(M.host(step.get_params(state)), M.init_params())


@pytest.mark.parametrize("kind", ["hpz", "offload", "stage2", "memory_efficient"])
def test_the_half_copy_stays_where_the_step_needs_it(kind):
  """hpZ's secondary copy is a half-precision copy by design (split over fewer devices than
  the master), offload keeps the master on the host and gathers from the half copy on the
  device, stages 1-2 keep the replicated half copy the loss reads; fp16_memory_efficient has
  no master at all."""
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  kw = {"hpz": dict(stage=3, axis_name=("replica", "data"), hpz_axis="data"),
        "offload": dict(stage=3, axis_name=("replica", "data"), offload="optimizer"),
        "stage2": dict(stage=2, axis_name=("replica", "data")),
        "memory_efficient": dict(stage=3, axis_name=("replica", "data"),
                                 precision="fp16_memory_efficient")}[kind]
  kw.setdefault("precision", "bf16")
  if kw["stage"] == 3:
    kw["stacked"] = M.STACKED
  step = zj.make_sharded_train_step(M.loss_fn, optax.adam(1e-2), mesh=mesh, **kw)
  state = step.init(M.init_params())
  assert not state.meta.master_in_params
  half = jnp.float16 if kind == "memory_efficient" else jnp.bfloat16
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(half)}
  assert (state.master is None) == (kind == "memory_efficient")


# ------------------------------------------------------- the same numbers
@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_stacked_layers_with_prefetch_give_the_previous_layouts_bits(mesh, monkeypatch, opt,
                                                                     precision):
  make = lambda: M.make_step(mesh, stage=3, opt=opt, precision=precision)
  the_same(make, M.init_params(), batches(), monkeypatch, forward=logits)


@pytest.mark.parametrize("kw", [dict(prefetch=0), dict(grad_accum_steps=2),
                                dict(grad_accum_steps=2, gather_once=True),
                                dict(quantize=zj.Quantize(block_size=8)),
                                dict(max_grad_norm=0.5)],
                         ids=["prefetch0", "accumulation", "gather_once", "qwZ", "clipping"])
def test_step_options_give_the_previous_layouts_bits(mesh, monkeypatch, kw):
  make = lambda: M.make_step(mesh, stage=3, opt="adam", precision="bf16", **kw)
  the_same(make, M.init_params(), batches(), monkeypatch, forward=logits)


def gained_loss(p, b, prefetch=1):
  """`M.loss_fn` with a per-layer gain ``layers["g"]`` of shape (L,): a stacked leaf with no
  dimension to split, which the step keeps whole on every device (`Layout.dim` None)."""
  layer = lambda h, lp: (jnp.tanh(h @ lp["w"] + lp["b"]) * lp["g"], None)
  h, _ = zj.scan(layer, b["x"].astype(p["w_in"].dtype) @ p["w_in"], p["layers"],
                 prefetch=prefetch)
  return jnp.mean(jnp.square((h @ p["w_out"]).astype(jnp.float32) - b["y"]))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_stacked_leaf_kept_whole_gives_the_previous_layouts_bits(mesh, monkeypatch, prefetch):
  params = M.init_params()
  params["layers"]["g"] = np.linspace(0.8, 1.1, 4).astype(np.float32)
  make = lambda: zj.make_sharded_train_step(
      functools.partial(gained_loss, prefetch=prefetch), optax.sgd(0.1), mesh=mesh, stage=3,
      precision="bf16", stacked={"w_in": False, "layers": True, "w_out": False})
  step, state, _ = the_same(make, params, batches(), monkeypatch)
  layouts = jax.tree.unflatten(jax.tree.structure(params), state.meta.param_layouts)
  assert layouts["layers"]["g"].dim is None  # whole on every device
  assert not np.array_equal(step.get_params(state)["layers"]["g"], params["layers"]["g"])


@pytest.mark.parametrize("kind", ["replica", "model_axis"])
def test_replica_and_model_axes_give_the_previous_layouts_bits(monkeypatch, kind):
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  split_layers = {"w_in": P(), "layers": {"w": P("replica"), "b": P("replica")}, "w_out": P()}
  kw = {"replica": dict(replica_axis="replica", precision="bf16"),
        "model_axis": dict(param_specs=split_layers, precision="bf16")}[kind]
  make = lambda: M.make_step(mesh, stage=3, opt="adam", **kw)
  the_same(make, M.init_params(), batches(), monkeypatch, forward=logits)


def test_skipped_fp16_steps_change_nothing_but_the_scale(mesh, monkeypatch):
  """A scale of 2**19 overflows fp16 until it has backed off: those steps are skipped and
  must leave the float32 parameters and the optimizer state as they were, bit for bit."""
  make = lambda: M.make_step(mesh, stage=3, opt="adam", precision="fp16",
                             loss_scale=zj.dynamic_loss_scale(2.0**19))
  step, state, metrics = the_same(make, M.init_params(), batches(8), monkeypatch)
  finite = [bool(m["grads_finite"]) for m in metrics]
  assert not all(finite) and any(finite), finite  # both kinds of step happened
  # and a skipped step keeps every bit: replay up to the first skip and one more
  first = finite.index(False)
  s = step.init(M.init_params())
  for b in batches(8)[:first]:
    s, _ = step(s, b)
  before = M.host((s.params, s.opt_state))
  s, m = step(s, batches(8)[first])
  assert not bool(m["grads_finite"])
  M.assert_bitwise_equal(M.host((s.params, s.opt_state)), before)


def test_lookup_tables_give_the_previous_layouts_bits(monkeypatch):
  mesh = jax.make_mesh((8,), ("data",))
  make = lambda: zj.make_sharded_train_step(L.untied_loss, optax.adam(1e-2), mesh=mesh,
                                            stage=3, lookup=L.LOOKUP, precision="bf16")
  the_same(make, L.make_params(), L.make_batches(), monkeypatch)


@pytest.mark.parametrize("opt", ["muon", "adam"])
def test_whole_leaf_update_gives_the_previous_layouts_bits(mesh, monkeypatch, opt):
  optimizer = W.muon if opt == "muon" else lambda: optax.adam(1e-2)
  make = lambda: zj.make_sharded_train_step(W.loss_fn, optimizer(), mesh=mesh, stage=3,
                                            precision="bf16", whole_leaf_update=W.is_matrix)
  the_same(make, W.make_params(), W.make_batches(), monkeypatch)


class Net(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Linear(5, 7, rngs=rngs)
    self.b = nnx.Linear(7, 3, rngs=rngs)

  def __call__(self, x):
    return self.b(jnp.tanh(self.a(x.astype(self.a.kernel.dtype))))


def nnx_loss(model, b):
  return jnp.mean(jnp.square(model(b["x"]) - b["y"]).astype(jnp.float32))


def test_nnx_modules_give_the_previous_layouts_bits(mesh, monkeypatch):
  make = lambda: zj.make_sharded_train_step(nnx_loss, optax.adam(1e-2), mesh=mesh, stage=3,
                                            precision="bf16")
  step, state, _ = the_same(make, Net(nnx.Rngs(0)), batches(), monkeypatch,
                            forward=lambda model, b: model(b["x"]))
  model = step.get_model(state)  # the float32 master, as before
  assert model.a.kernel[...].dtype == F32


# ------------------------------------------------------- where the cast happens
HALF_HLO = {"bf16": "bf16", "fp16": "f16"}  # the dtype's name in HLO text


def _stacked_blocks(state) -> list[str]:
  """Each stacked leaf's device block as HLO writes its shape, e.g. ``[4,1,7]``."""
  return ["[" + ",".join(map(str, lay.local_storage_shape(l, 8))) + "]"
          for l, s in zip(state.meta.param_layouts, state.meta.stacked) if s]


def _programs(step, state, b):
  """(name, lowered) of the train step, ``evaluate`` and ``apply`` for ``state``."""
  return [("train", step.lower(state, b)), ("evaluate", jax.jit(step.evaluate).lower(state, b)),
          ("apply", jax.jit(lambda s, b: step.apply(s, logits, b)).lower(state, b))]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_each_layer_is_cast_as_it_is_gathered_never_the_whole_stack(mesh, precision, prefetch):
  """The float32 master block of a stacked leaf is cast a layer at a time, just before that
  layer's all-gather: the compiled programs (training, ``evaluate``, ``apply``) hold no
  conversion of the whole stacked block to half precision (tests/_held.py; training keeps the
  stacked gradient in half precision, filled a layer at a time, as before), and every all-gather
  carries the half dtype, as does every reduce-scatter of the gradients (checked before XLA's own
  passes: XLA:CPU widens half-precision collectives to float32 for its runtime, which a GPU does
  not)."""
  step = M.make_step(mesh, stage=3, opt="adam", precision=precision, prefetch=prefetch)
  state = step.init(M.init_params())
  b = M.batch(0)
  half, blocks = HALF_HLO[precision], _stacked_blocks(state)
  assert blocks == ["[4,1]", "[4,1,7]"]  # layers b (4, 7) and w (4, 7, 7), split over 8
  for name, lowered in _programs(step, state, b):
    text = lowered.compile().as_text()
    assert "f32[4,1,7]" in held_shapes(text), name  # the float32 master block it reads
    whole = [c for s in blocks for c in held_converts(text, f"{half}{s}")]
    assert not whole, (name, whole)
    pre = lowered.as_text()  # StableHLO: tensor<...xbf16>
    wire = re.findall(r"stablehlo\.all_gather.*?-> tensor<[0-9x]*x(\w+)>", pre)
    assert wire and set(wire) == {half}, (name, wire)
    summed = re.findall(r"stablehlo\.reduce_scatter.*\n\s*\^bb0\(%\w+: tensor<(\w+)>", pre)
    assert set(summed) == ({half} if name == "train" else set()), (name, summed)


def chain_loss(p, b):
  h = b["x"].astype(jnp.bfloat16)
  for k in sorted(p):
    h = jnp.tanh(h @ p[k])
  return jnp.mean(jnp.square(h.astype(jnp.float32)))


def test_a_plain_leafs_cast_is_recomputed_for_the_backward_pass_not_saved(mesh):
  """Without stacked leaves the stage-3 loss runs under `regather_policy`, which gathers each
  leaf again for the backward pass: the cast of its float32 block, made inside the loss as it
  is gathered, is recomputed with the gather (`zero_jax.step.grads._cast_shapes`), not kept as
  a bf16 copy of the block until the backward pass. Leaves of 8 MiB in bf16, each gathered
  alone (not bucketed), block [256,2048] on 8 devices."""
  r = np.random.default_rng(0)
  params = {k: (r.normal(size=(2048, 2048)) / 45).astype(np.float32) for k in "abcd"}
  b = {"x": r.normal(size=(64, 2048)).astype(np.float32)}
  step = zj.make_sharded_train_step(chain_loss, optax.sgd(0.1), mesh=mesh, stage=3,
                                    precision="bf16")
  state = step.init(params)
  assert {lay.local_storage_shape(l, 8) for l in state.meta.param_layouts} == {(256, 2048)}
  text = step.lower(state, b).compile().as_text()
  assert "f32[256,2048]" in held_shapes(text)
  assert not held_converts(text, "bf16[256,2048]")


# ------------------------------------------------------------------ misuse
def test_a_state_of_the_other_layout_is_refused_naming_it(mesh, monkeypatch):
  step = M.make_step(mesh, stage=3, precision="bf16")
  with previous_layout(monkeypatch):
    old = M.make_step(mesh, stage=3, precision="bf16").init(M.init_params())
  with pytest.raises(ValueError, match=r"float32 master copy lives: beside a half-precision "
                                       r"copy .* in the state, in params for this step"):
    step(old, M.batch(0))


# -------------------------------------------------------------- checkpoints
def test_checkpoints_of_either_layout_restore_into_the_other_and_into_stage_2(
    mesh, monkeypatch, tmp_path):
  """A checkpoint holds the half copy beside the master whatever the layout (the form every
  zero_jax checkpoint of a bf16/fp16 run has had): one written by the previous layout (as
  ``main``'s code wrote it) restores into this layout, continuing with the same bits, and one
  written now restores into the previous layout and into stage 2."""
  make = lambda stage=3: M.make_step(mesh, stage=stage, opt="adam", precision="bf16")
  first, rest = batches(4)[:2], batches(4)[2:]
  with previous_layout(monkeypatch):
    old_step = make()
    old = old_step.init(M.init_params())
    for b in first:
      old, _ = old_step(old, b)
    with zj.CheckpointManager(tmp_path / "old") as mngr:
      mngr.save(old)
    saved_old = M.host((old.params, old.master, old.opt_state, old.loss_scale))
    for b in rest:  # the previous layout, uninterrupted
      old, m_old = old_step(old, b)
    end_old = M.host((old_step.get_params(old), old.opt_state, m_old))

  step = make()
  with zj.CheckpointManager(tmp_path / "old") as mngr:
    new = mngr.restore(step, M.init_params())
    old_description = mngr.metadata()
  assert new.meta.master_in_params and new.master is None
  M.assert_bitwise_equal(M.host(jax.tree.leaves(new.params)), saved_old[1])  # the master
  M.assert_bitwise_equal(M.host((new.opt_state, new.loss_scale)), saved_old[2:])
  with zj.CheckpointManager(tmp_path / "new") as mngr:  # saved again in this layout
    mngr.save(new)
    new_description = mngr.metadata()
  for b in rest:
    new, m_new = step(new, b)
  M.assert_bitwise_equal(M.host((step.get_params(new), new.opt_state, m_new)), end_old)
  # The same description as the previous layout wrote: any zero_jax restores it.
  for key in ("param_storage", "groups", "opt_signature", "trainable"):
    assert new_description[key] == old_description[key], key

  with previous_layout(monkeypatch), zj.CheckpointManager(tmp_path / "new") as mngr:
    back = mngr.restore(old_step, M.init_params())
    back_params = M.host(old_step.get_params(back))
  M.assert_bitwise_equal(M.host((back.params, back.master, back.opt_state, back.loss_scale)),
                         saved_old)
  stage2 = make(stage=2)
  with zj.CheckpointManager(tmp_path / "new") as mngr:
    two = mngr.restore(stage2, M.init_params())
  M.assert_bitwise_equal(M.host(stage2.get_params(two)), back_params)
  assert {x.dtype for x in jax.tree.leaves(two.params)} == {jnp.dtype(jnp.bfloat16)}


def test_exports_give_the_float32_master_as_before(mesh, monkeypatch, tmp_path):
  """`export_safetensors` writes what `get_params` returns: the float32 master, in both
  layouts, byte for byte."""
  make = lambda: M.make_step(mesh, stage=3, opt="adam", precision="bf16")
  files = {}
  for old in (False, True):
    step, state, _ = run(make, M.init_params(), batches(2), monkeypatch, old=old)
    with previous_layout(monkeypatch, old):
      zj.export_safetensors(step, state, tmp_path / str(old))
    files[old] = sorted((p.name, p.read_bytes()) for p in (tmp_path / str(old)).iterdir())
  assert files[False] == files[True]
  assert b'"F32"' in files[False][0][1]


# ------------------------------------------------------------------ the update
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_the_gpu_update_by_select_gives_the_bits_of_the_cond(mesh, monkeypatch, opt):
  """On GPUs the update keeps a skipped step's values by a select (each new value written over
  the old one in place), elsewhere by a ``lax.cond`` (`zero_jax.step.update.selects`): the
  same numbers, skipped fp16 steps included, bit for bit."""
  make = lambda: M.make_step(mesh, stage=3, opt=opt, precision="fp16",
                             loss_scale=zj.dynamic_loss_scale(2.0**19))
  step, cond, m_cond = run(make, M.init_params(), batches(8), monkeypatch, old=False)
  assert "stablehlo.case" in step.lower(cond, batches(1)[0]).as_text()
  with monkeypatch.context() as m:
    m.setattr(update_lib, "selects", lambda spec: True)
    step, sel, m_sel = run(make, M.init_params(), batches(8), monkeypatch, old=False)
    text = step.lower(sel, batches(1)[0]).as_text()
  assert "stablehlo.case" not in text and "select" in text
  finite = [bool(x["grads_finite"]) for x in m_sel]
  assert not all(finite) and any(finite), finite
  M.assert_bitwise_equal(m_sel, m_cond)
  M.assert_bitwise_equal(M.host(sel), M.host(cond))
