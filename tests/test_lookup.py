"""Row lookups on the split table at stage 3: ``lookup=`` and ``zj.take``.

A small language-model-like loss (an embedding table of 37 rows x 16 features, a dense
layer, an untied or tied output) trained at stage 3 with ``lookup=`` must give what a
single-device optax step gives (plain SGD, which shows a gradient summed twice, and Adam),
on 8 devices and on a (2, 4) mesh with a replica axis or hpZ; and the compiled step must move
only looked-up rows, never the whole table, when the table is only looked up.

Tolerances (fp32): every value is a sum of at most 16 x 6 x 37 products in another order
than the reference's; with unit roundoff u = 2**-24 and values O(1), relative differences of
a few hundred u (1e-5) bound it with a margin, as `_feature_helpers.RTOL` says.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zero_jax as zj
from _feature_helpers import assert_tree_close, collectives, reference_run, shapes_in

V, D, T, BATCH, STEPS = 37, 16, 6, 16, 3
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(1e-2)}
LOOKUP = {"embed": True, "w": False, "b": False, "head": False}
ALL = {"embed": True, "w": True, "b": True, "head": True}


def make_params(d=D):
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.5).astype(np.float32)
  return {"embed": f(V, d), "w": f(d, d), "b": f(d), "head": f(d, V)}


def make_batches(n=STEPS, every_row=False):
  r = np.random.default_rng(1)
  out = []
  for _ in range(n):
    ids = r.integers(0, V, size=(BATCH, T)).astype(np.int32)
    if every_row:  # every row looked up, and rows repeated many times
      ids.reshape(-1)[:V] = np.arange(V)
      ids[:, -1] = 3
    out.append({"ids": ids, "y": r.integers(0, V, size=(BATCH, T)).astype(np.int32)})
  return out


def untied_loss(p, b):
  h = zj.take(p["embed"], b["ids"])                 # [B, T, D]
  h = jnp.tanh(h @ p["w"] + p["b"])
  logits = h @ p["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def tied_loss(p, b):
  table = zj.gather(p["embed"])                     # the whole table, for the logits
  h = jnp.tanh(zj.take(p["embed"], b["ids"]) @ p["w"] + p["b"])
  logits = h @ table.T + 0.0 * p["head"].sum()
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def train(loss_fn, opt, batches, *, mesh_shape=(8,), axes=("data",), params=None, **kw):
  mesh = jax.make_mesh(mesh_shape, axes)
  kw.setdefault("axis_name", axes[-1] if len(axes) > 1 else axes[0])
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, **kw)
  state = step.init(make_params() if params is None else params)
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return step, state, losses


HOSTS = {"mesh_shape": (2, 4), "axes": ("host", "data"), "axis_name": ("host", "data")}
LAYOUTS = {
    "s3": {},
    "s3_replica": {"mesh_shape": (2, 4), "axes": ("replica", "data"), "replica_axis": "replica"},
    "s3_hpz": {**HOSTS, "hpz_axis": "data"},
    "s3_two_axes": HOSTS,
    "s3_accum": {"grad_accum_steps": 2},
}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("loss_fn", [untied_loss, tied_loss], ids=["untied", "tied"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_stage3_lookup_equals_single_device_reference(name, loss_fn, opt):
  batches = make_batches(every_row=True)
  step, state, losses = train(loss_fn, OPTIMIZERS[opt](), batches, stage=3, lookup=LOOKUP,
                              **LAYOUTS[name])
  ref, ref_losses, _ = reference_run(loss_fn, OPTIMIZERS[opt](), make_params(), batches)
  assert_tree_close(step.get_params(state), ref[-1], what=f"{name} {opt}")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def _bf16(loss_fn):
  """The loss as the bf16 policy runs it on one device: parameters rounded to bf16."""
  return lambda p, b: loss_fn(jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), b)


def test_stage3_lookup_in_bf16_equals_the_rounded_reference():
  # bf16 rounds each value the loss computes to u = 2**-8 relative, and the step sums the
  # rows' gradients (repeated ids: up to 19 times) and the devices' partial sums in another
  # order than one device: a chain of ~10 roundings, so the update agrees to about 10u ~ 4%
  # of its size; 6% of the largest change bounds it. A gradient summed twice (100%) or a
  # wrong row fails. Plain SGD only: Adam divides each gradient by its own size, so a
  # gradient element near zero whose rounding differs moves by up to the learning rate
  # (fp32 Adam is tested above).
  batches = make_batches(every_row=True)
  step, state, losses = train(untied_loss, OPTIMIZERS["sgd"](), batches, stage=3,
                              lookup=LOOKUP, precision="bf16")
  ref, ref_losses, _ = reference_run(_bf16(untied_loss), OPTIMIZERS["sgd"](), make_params(),
                                     batches)
  got, p0 = step.get_params(state), make_params()
  for k in p0:
    moved = np.abs(ref[-1][k] - p0[k]).max()
    np.testing.assert_allclose(got[k], ref[-1][k], rtol=0, atol=0.06 * moved, err_msg=k)
  np.testing.assert_allclose(losses, [float(x) for x in ref_losses], rtol=2 ** -8 * 4)


# ------------------------------------------------------------ what moves
BIG_V = 1000  # the table (16000 elements) is far bigger than the rows looked up (192)


def lookup_only_loss(p, b):
  h = jnp.tanh(zj.take(p["embed"], b["ids"]) @ p["w"] + p["b"])
  return jnp.mean((h - 1.0) ** 2)


def indexing_loss(p, b):  # the same, with the table gathered whole for table[ids]
  h = jnp.tanh(p["embed"][b["ids"]] @ p["w"] + p["b"])
  return jnp.mean((h - 1.0) ** 2)


def _compiled(loss_fn, **kw):
  r = np.random.default_rng(2)
  params = {"embed": r.normal(size=(BIG_V, D)).astype(np.float32),
            "w": r.normal(size=(D, D)).astype(np.float32), "b": np.zeros(D, np.float32)}
  batch = {"ids": r.integers(0, BIG_V, size=(BATCH, T)).astype(np.int32)}
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)),
                                    stage=3, **kw)
  return step.lower(step.abstract_state(params), batch).compile().as_text()


def test_a_table_only_looked_up_never_moves_whole():
  colls = collectives(_compiled(lookup_only_loss, lookup={"embed": True, "w": False,
                                                          "b": False}))
  size = lambda t: sum(int(np.prod(s)) for s in shapes_in(t))  # a tuple's parts together
  # Each device's rows [2 examples, 6 ids, 16 features] travel as an all-to-all of
  # 8 x [1, 2, 6, 2 features], once each way (rows, then their gradients), its ids as an
  # all-gather of 8 x 12 ints; the largest other collective is the dense layer's bucket
  # (16 x 16 + 16). Not the table's 16000 values, nor its block (2000).
  assert [size(t) for o, t, _ in colls if o == "all-to-all"] == [BATCH // 8 * T * D] * 2
  assert max(size(t) for _, t, _ in colls) <= D * (D + 1) < BIG_V * D // 8, colls
  # Without lookup=, the table is gathered whole (and its gradient reduce-scattered).
  plain = collectives(_compiled(indexing_loss))
  assert any(o == "all-gather" and size(t) >= BIG_V * D for o, t, _ in plain), plain


# ------------------------------------------------------------ every stage, every id
@pytest.mark.parametrize("stage", [1, 2])
def test_lookup_is_accepted_at_stages_1_and_2_where_take_indexes(stage):
  batches = make_batches(2, every_row=True)
  step, state, losses = train(tied_loss, optax.sgd(0.5), batches, stage=stage, lookup=LOOKUP)
  ref, ref_losses, _ = reference_run(tied_loss, optax.sgd(0.5), make_params(), batches)
  assert_tree_close(step.get_params(state), ref[-1], what=f"stage {stage}")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_out_of_range_and_negative_ids_read_as_table_ids():
  # ids as table[ids] reads them: negative from the end, others clamped to the first or
  # last row; the same rows (and gradients) at stage 3 as on one device.
  table = jnp.arange(5.0 * 3).reshape(5, 3)
  ids = jnp.array([[-1, -5, -6, -100], [0, 4, 5, 1 << 30]])
  np.testing.assert_array_equal(zj.take(table, ids), table[ids])
  np.testing.assert_array_equal(zj.take(np.asarray(table), np.asarray(ids)), table[ids])
  batches = make_batches(2)
  for b in batches:
    b["ids"][:, 0], b["ids"][:, 1], b["ids"][:, 2] = -1, V + 3, -V - 4
  step, state, losses = train(untied_loss, optax.sgd(0.5), batches, stage=3, lookup=LOOKUP)
  ref, ref_losses, _ = reference_run(untied_loss, optax.sgd(0.5), make_params(), batches)
  assert_tree_close(step.get_params(state), ref[-1], what="out of range")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_a_feature_dimension_that_needs_padding_constant_ids_and_a_1d_table():
  # 12 features are padded to 16 on 8 devices; position ids are the same on every device
  # (not device-varying), each device still gets its own rows; a table of one dimension (a
  # bias per token) has nothing to split: it is whole on every device.
  def loss_fn(p, b):
    pos = zj.take(p["pos"], jnp.arange(T))            # [T, 12], same ids everywhere
    h = jnp.tanh(zj.take(p["embed"], b["ids"]) + pos) @ p["w"]
    h = h * zj.take(p["bias"], b["ids"])[..., None]   # a scale per token
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], b["y"]).mean()
  r = np.random.default_rng(3)
  params = {"embed": r.normal(size=(V, 12)).astype(np.float32),
            "pos": r.normal(size=(T, 12)).astype(np.float32),
            "bias": r.normal(size=(V,)).astype(np.float32),
            "w": r.normal(size=(12, 12)).astype(np.float32) * 0.3,
            "head": r.normal(size=(12, V)).astype(np.float32) * 0.3}
  batches = make_batches(2)
  lookup = {"embed": True, "pos": True, "bias": True, "w": False, "head": False}
  step, state, _ = train(loss_fn, optax.sgd(0.5), batches, stage=3, lookup=lookup,
                         params=params)
  layouts = dict(zip(sorted(params), state.meta.param_layouts))
  assert layouts["embed"] == zj.Layout((V, 12), 1, 16)  # rows whole
  assert layouts["bias"].dim is None
  ref, _, _ = reference_run(loss_fn, optax.sgd(0.5), params, batches)
  assert_tree_close(step.get_params(state), ref[-1], what="padded")


# ------------------------------------------------------------ NNX
class TinyLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.lin = nnx.Linear(D, D, rngs=rngs)


def nnx_loss(model, b):
  h = jnp.tanh(model.lin(zj.take(model.embed.embedding, b["ids"])))
  logits = h @ zj.gather(model.embed.embedding).T     # tied, as nnx.Embed.attend
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def test_nnx_embed_marked_by_a_filter():
  batches = make_batches(2, every_row=True)
  mesh = jax.make_mesh((8,), ("data",))
  step = zj.make_sharded_train_step(nnx_loss, optax.sgd(0.5), mesh=mesh, stage=3,
                                    lookup=nnx.PathContains("embed"))
  state = step.init(TinyLM(nnx.Rngs(0)))
  for b in batches:
    state, _ = step(state, b)
  got = nnx.state(step.get_model(state), nnx.Param)
  model = TinyLM(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  ref, _, _ = reference_run(lambda p, b: nnx_loss(nnx.merge(graphdef, p), b), optax.sgd(0.5),
                            params, batches)
  assert_tree_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, ref[-1]),
                    what="nnx")


# ------------------------------------------------------------ errors
def _step(loss_fn, **kw):
  kw.setdefault("stage", 3)
  return zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)),
                                    **kw)


def _run(step, params=None):
  state = step.init(make_params() if params is None else params)
  return step(state, make_batches(1)[0])


def test_lookup_selecting_nothing_names_the_option_as_written():
  none = {"embed": False, "w": False, "b": False, "head": False}
  with pytest.raises(ValueError, match=r"lookup=\{'embed': False, .* selects no parameter"):
    _step(untied_loss, lookup=none).init(make_params())
  with pytest.raises(ValueError, match=r"lookup=PathContains.*selects no parameter"):
    _step(nnx_loss, lookup=nnx.PathContains("embd")).init(TinyLM(nnx.Rngs(0)))


def test_take_on_a_leaf_not_marked_lookup_names_it():
  with pytest.raises(TypeError, match=r"params\['embed'\], which is not marked lookup="):
    _run(_step(untied_loss))
  with pytest.raises(TypeError, match=r"params\['embed'\]\['embedding'\].*not marked lookup"):
    step = _step(nnx_loss)
    step(step.init(TinyLM(nnx.Rngs(0))), make_batches(1)[0])


def test_a_lookup_table_used_as_an_array_or_indexed_names_the_fix():
  with pytest.raises(TypeError, match=r"params\['embed'\] is a lookup table.*zj.take"):
    _run(_step(indexing_loss, lookup={"embed": True, "w": False, "b": False}),
         {k: v for k, v in make_params().items() if k != "head"})
  with pytest.raises(TypeError, match=r"params\['embed'\] is a lookup table.*zj.gather"):
    _run(_step(lambda p, b: jnp.mean(p["embed"] @ p["w"]), lookup=LOOKUP))


def test_ids_that_are_not_integers_are_refused():
  with pytest.raises(TypeError, match=r"zj.take\(params\['embed'\], ids\).*float32"):
    _run(_step(lambda p, b: untied_loss(p, {**b, "ids": b["ids"].astype(jnp.float32)}),
               lookup=LOOKUP))
  with pytest.raises(TypeError, match=r"bool.*must be integers"):
    zj.take(jnp.zeros((4, 2)), jnp.array([True, False]))


def test_a_leaf_both_stacked_and_lookup_is_refused():
  with pytest.raises(ValueError, match=r"lookup and stacked both mark params\['embed'\]"):
    _step(untied_loss, lookup=LOOKUP, stacked=LOOKUP).init(make_params())


def test_quantize_leaves_the_looked_up_rows_exact():
  # qwZ/qgZ round what weight gathers and gradient reduce-scatters carry (1/127 of a block's
  # largest value); take moves rows and their gradients by all-to-all, exact: a table that
  # is only looked up trains as on one device, to fp32 rounding.
  def loss_fn(p, b):
    return jnp.mean((zj.take(p["embed"], b["ids"]) - 1.0) ** 2)
  params = {"embed": make_params()["embed"]}
  batches = make_batches(2, every_row=True)
  step, state, losses = train(loss_fn, optax.sgd(0.5), batches, stage=3, params=params,
                              lookup={"embed": True}, quantize=zj.Quantize(block_size=8))
  ref, ref_losses, _ = reference_run(loss_fn, optax.sgd(0.5), params, batches)
  assert_tree_close(step.get_params(state), ref[-1], what="quantize")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_an_nnx_embed_called_directly_names_take():
  def loss(model, b):
    return jnp.mean(jnp.tanh(model.lin(model.embed(b["ids"]))) ** 2)
  step = _step(loss, lookup=nnx.PathContains("embed"))
  with pytest.raises(TypeError, match=r"\['embed'\]\['embedding'\].*is a lookup table.*"
                                      r"zj.take\(model.embed.embedding, ids\)"):
    step(step.init(TinyLM(nnx.Rngs(0))), make_batches(1)[0])


# ------------------------------------------------------------ with the step's other options
@pytest.mark.parametrize("kw", [{"stage": 3, "gather_once": True, "grad_accum_steps": 2},
                                {"stage": 3, "trainable": {**ALL, "embed": False}},
                                {"stage": 3, "trainable": {**ALL, "w": False}}],
                         ids=["gather_once", "frozen_table", "frozen_dense"])
def test_lookup_with_gather_once_and_frozen_leaves(kw):
  batches = make_batches(2, every_row=True)
  step, state, losses = train(tied_loss, optax.sgd(0.5), batches, lookup=LOOKUP, **kw)
  mask = kw.get("trainable")
  ref, ref_losses, _ = reference_run(tied_loss, optax.sgd(0.5), make_params(), batches,
                                     mask=mask)
  assert_tree_close(step.get_params(state), ref[-1], what=str(kw))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_a_checkpoint_moves_between_lookup_and_plain_steps(tmp_path):
  # The table is split along another dimension with lookup= than without: a checkpoint
  # restores across (the logical leaf is what is saved), and training continues alike.
  batches = make_batches(3, every_row=True)
  step3, state3, _ = train(untied_loss, optax.adam(1e-2), batches[:2], stage=3, lookup=LOOKUP)
  with zj.CheckpointManager(tmp_path / "ck") as mngr:
    mngr.save(state3, force=True)
  plain = zj.make_sharded_train_step(untied_loss, optax.adam(1e-2), stage=2,
                                     mesh=jax.make_mesh((8,), ("data",)))
  with zj.CheckpointManager(tmp_path / "ck") as mngr:
    restored = mngr.restore(plain, make_params())
  assert_tree_close(plain.get_params(restored), step3.get_params(state3), rtol=0, atol=0)
  restored, _ = plain(restored, batches[2])
  state3, _ = step3(state3, batches[2])
  assert_tree_close(plain.get_params(restored), step3.get_params(state3), what="continued")


def test_a_state_made_without_lookup_is_refused_naming_the_leaf():
  step = _step(untied_loss, lookup=LOOKUP)
  other = _step(untied_loss).init(make_params())
  with pytest.raises(ValueError, match=r"lookup= differs for params\['embed'\]"):
    step(other, make_batches(1)[0])


def test_memory_report_takes_lookup():
  shapes = {"embed": jax.ShapeDtypeStruct((50257, 12), jnp.float32)}
  plain = zj.memory_report(shapes, optax.sgd(0.1), n_devices=8, stages=(3,))
  looked = zj.memory_report(shapes, optax.sgd(0.1), n_devices=8, stages=(3,),
                            lookup={"embed": True})
  # 12 features padded to 16 with lookup= (rows whole); 12 exactly without (rows split, 50264)
  assert looked[3].params == 50257 * 2 * 4 and plain[3].params == 50264 // 8 * 12 * 4
