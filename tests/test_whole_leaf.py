"""whole_leaf_update=: each selected matrix updated whole on one home device.

The step must equal single-device ``optax.contrib.muon`` (and plain SGD with momentum, and
Adam) within 1e-6 relative at every stage, with hybrid sharding, gradient accumulation,
frozen leaves, uneven shapes, fewer matrices than devices and stacked leaves; in bf16 and
fp16 it must equal the same step without ``whole_leaf_update`` (whose agreement with the
single-device policy is pinned in test_precision). The compiled step moves each matrix
with all-to-alls and sends the muon guide's bytes: at most 1.25x AdamW's on four 512 x 512
matrices and on GPT-2 small's shapes, 1 + s / (2k) per all-to-all in general (k matrices of
a shape, s slots per device), a third all-to-all where the parameter moves home too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

import zero_jax as zj
from zero_jax.comm import hlo
from zero_jax.step import whole_leaf
from _whole_leaf_model import (assert_rel_close, is_matrix, loss_fn, make_batches, make_params,
                               muon)


def reference(opt, params, batches, loss=loss_fn, frozen=()):
  """Single-device optax: the ground truth (frozen leaves get no update)."""
  @jax.jit
  def one(params, state, b):
    g = jax.grad(loss)(params, b)
    u, state = opt.update(g, state, params)
    if frozen:
      u = {k: jnp.zeros_like(v) if k in frozen else v for k, v in u.items()}
    return optax.apply_updates(params, u), state

  params = jax.device_put(jax.tree.map(jnp.asarray, params), jax.devices()[0])
  state = opt.init(params)
  for b in batches:
    params, state = one(params, state, b)
  return params


def train(opt, mesh, batches, params=None, loss=loss_fn, **kw):
  step = zj.make_sharded_train_step(loss, opt, mesh=mesh, **kw)
  state = step.init(make_params() if params is None else params)
  for b in batches:
    state, _ = step(state, b)
  return step, state, step.get_params(state)


OPTIMIZERS = {
    "muon": muon,
    "muon_weight_decay": lambda: muon(weight_decay=0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
}


@pytest.mark.parametrize("name,stage", [
    ("muon", 1), ("muon", 2), ("muon", 3),
    ("muon_weight_decay", 2), ("muon_weight_decay", 3),  # the parameter read at home
    ("sgd_momentum", 2), ("adam", 3)])
def test_whole_leaf_update_equals_single_device(mesh, stage, name):
  batches = make_batches()
  step, state, got = train(OPTIMIZERS[name](), mesh, batches, stage=stage,
                           whole_leaf_update=is_matrix)
  assert state.meta.whole is not None and sum(state.meta.whole.moved) == 3
  assert_rel_close(got, reference(OPTIMIZERS[name](), make_params(), batches))
  # Muon's momentum of the matrices lives at home: one slot per device and group.
  if name != "sgd_momentum":
    homes = jax.tree.leaves(state.opt_state.homes)
    assert {x.shape for x in homes} == {(8, 12, 20), (8, 20, 9), (8, 9, 3)}


@pytest.mark.parametrize("kw", [
    {"replica_axis": "replica"},
    {"grad_accum_steps": 2},
    {"grad_accum_steps": 2, "stage": 3},
    {"trainable": {"w1": True, "b1": False, "w2": False, "w3": True}},
    {"axis_name": ("replica", "data"), "stage": 3},
], ids=["hybrid", "accumulation", "accumulation-stage3", "frozen", "two-data-axes"])
def test_whole_leaf_update_with_other_options_equals_single_device(kw):
  mesh = jax.make_mesh((2, 4), ("replica", "data")) if "replica_axis" in kw or \
      "axis_name" in kw else jax.make_mesh((8,), ("data",))
  batches = make_batches()
  frozen = [k for k, v in kw.get("trainable", {}).items() if not v]
  _, _, got = train(muon(), mesh, batches, whole_leaf_update=is_matrix, **kw)
  assert_rel_close(got, reference(muon(), make_params(), batches,
                                  frozen=frozen))


def test_stacked_leaves_orthogonalise_each_layer_at_its_home(mesh):
  r = np.random.default_rng(2)
  params = {"layers": (r.normal(size=(5, 12, 12)) * 0.3).astype(np.float32),
            "head": (r.normal(size=(12, 3)) * 0.3).astype(np.float32)}

  def loss(p, b):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ zj.gather(w)), None), b["x"], p["layers"])
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)
  dims = {"layers": MuonDimensionNumbers(1, 2), "head": MuonDimensionNumbers(0, 1)}
  opt = lambda: muon(muon_weight_dimension_numbers=dims)
  batches = make_batches()
  for stage in (2, 3):
    step, state, got = train(opt(), mesh, batches, params=params, loss=loss, stage=stage,
                             stacked={"layers": True, "head": False}, whole_leaf_update=True)
    assert len(state.meta.whole.units) == 6  # five layers and the head
    assert_rel_close(got, reference(opt(), params, batches, loss=loss))


def nested_params():
  """``['l1']['w']`` and ``['blk']['l1']['w']``: one leaf's path ends with the other's."""
  r = np.random.default_rng(3)
  f = lambda: (r.normal(size=(12, 12)) * 0.3).astype(np.float32)
  return {"blk": {"l1": {"w": f()}}, "l1": {"w": f()}}


def nested_loss(p, b):
  h = jnp.tanh(b["x"] @ p["l1"]["w"])
  return jnp.mean((jnp.tanh(h @ p["blk"]["l1"]["w"])[:, :3] - b["y"]) ** 2)


def only_top_l1(path, x):
  del x
  return jax.tree_util.keystr(path) == "['l1']['w']"


@pytest.mark.parametrize("stage", [1, 3])
def test_leaf_whose_path_ends_with_the_moved_leafs_path_keeps_its_own_state(mesh, stage):
  """Only ``['l1']['w']`` moves; ``['blk']['l1']['w']``'s state (same shape, a path ending
  with the moved one's) stays its own: schedule-free's ``z`` starts from each leaf's own
  parameter, so taking the other leaf's state would change the numbers."""
  opt = lambda: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2)
  batches = make_batches()
  _, state, got = train(opt(), mesh, batches, params=nested_params(), loss=nested_loss,
                        stage=stage, whole_leaf_update=only_top_l1)
  assert state.meta.whole.moved == (False, True)
  want = reference(opt(), nested_params(), batches, loss=nested_loss)
  for k in ("blk", "l1"):
    assert_rel_close(got[k] if k == "l1" else got[k]["l1"],
                     want[k] if k == "l1" else want[k]["l1"], what=k)


def test_single_array_params_update_whole_like_the_array_in_a_dict(mesh):
  w = make_params()["w1"]
  batches = make_batches()
  loss = lambda w, b: loss_fn({**make_params(), "w1": w}, b)
  _, state, got = train(muon(), mesh, batches, params=w, loss=loss, whole_leaf_update=True)
  assert state.meta.whole.moved == (True,)
  assert_rel_close({"w1": got}, {"w1": reference(muon(), w, batches, loss=loss)})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_equals_the_split_update(mesh, precision):
  batches = make_batches()
  _, _, got = train(muon(), mesh, batches, precision=precision,
                    whole_leaf_update=is_matrix)
  _, _, want = train(muon(), mesh, batches, precision=precision)
  assert_rel_close(got, want)


def test_cross_leaf_optimizer_is_refused_naming_the_leaf(mesh):
  opt = optax.chain(optax.clip_by_global_norm(1.0), muon())
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, whole_leaf_update=is_matrix)
  with pytest.raises(ValueError, match=r"params\['w1'\].*other leaves"):
    step.init(make_params())


def test_frozen_leaf_named_for_itself_is_refused(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh,
                                    trainable={"w1": False, "b1": True, "w2": True, "w3": True},
                                    whole_leaf_update={"w1": True, "b1": False, "w2": True,
                                                       "w3": True})
  with pytest.raises(ValueError, match=r"params\['w1'\], which does not train"):
    step.init(make_params())


# ------------------------------------------------------------------------ bytes
def _sent(step, params, batch) -> float:
  text = step.lower(step.abstract_state(params), batch).compile().as_text()
  return sum(hlo.sent_bytes(c) for c in hlo.collectives(text))


def mlp_512(k: int):
  """Abstract params, batch and loss of an MLP of ``k`` 512 x 512 matrices."""
  params = {f"w{i}": jax.ShapeDtypeStruct((512, 512), jnp.float32) for i in range(k)}
  batch = {"x": jax.ShapeDtypeStruct((64, 512), jnp.float32)}

  def loss(p, b):
    h = b["x"]
    for key in sorted(p):
      h = jnp.tanh(h @ p[key])
    return jnp.mean(h ** 2)
  return params, batch, loss


def test_muon_sends_at_most_125x_adamw_bytes_on_a_512_mlp(mesh):
  params, batch, loss = mlp_512(4)
  make = lambda opt, **kw: zj.make_sharded_train_step(loss, opt, mesh=mesh, **kw)
  adamw = _sent(make(optax.adamw(1e-3)), params, batch)
  whole = make(optax.contrib.muon(1e-3), whole_leaf_update=True)
  text = whole.lower(whole.abstract_state(params), batch).compile().as_text()
  ops = [c.op for c in hlo.collectives(text)]
  assert ops.count("all-to-all") == 2  # one group of equal shapes: one each way
  assert _sent(whole, params, batch) <= 1.25 * adamw
  # Today's split update partitions every Newton-Schulz matmul: several times the bytes.
  assert _sent(make(optax.contrib.muon(1e-3)), params, batch) > 5 * adamw


@pytest.mark.parametrize("k,stage,precision,decay", [
    (4, 3, "fp32", 0.1), (4, 2, "bf16", 0.1), (4, 2, "fp32", 0.1), (8, 3, "fp32", 0.1),
    (1, 2, "fp32", 0.0)])
def test_bytes_over_adamw_are_one_plus_half_an_all_to_all_per_slot_per_matrix(
    mesh, k, stage, precision, decay):
  """The muon guide's figures: each all-to-all adds s / (2k) of a group's bytes (k matrices,
  s slots per device); the parameter takes a third one home only where the update reads it
  and no device holds it whole (weight decay at stage 3, or with a master copy)."""
  params, batch, loss = mlp_512(k)
  make = lambda opt, **kw: zj.make_sharded_train_step(loss, opt, mesh=mesh, stage=stage,
                                                      precision=precision, **kw)
  adamw = _sent(make(optax.adamw(1e-3, weight_decay=decay)), params, batch)
  whole = make(optax.contrib.muon(1e-3, ns_steps=1, weight_decay=decay), whole_leaf_update=True)
  text = whole.lower(whole.abstract_state(params), batch).compile().as_text()
  moves = 3 if decay and (stage == 3 or precision != "fp32") else 2
  assert [c.op for c in hlo.collectives(text)].count("all-to-all") == moves
  s = -(-k // 8)
  assert _sent(whole, params, batch) == pytest.approx((1 + moves / 2 * s / k) * adamw, rel=1e-4)


GPT2 = {"layers": 12, "width": 768, "vocab": 50257, "positions": 1024}


def gpt2_small_shapes():
  d, s = GPT2["width"], lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  block = {"ln1": s(d), "attn": s(d, 3 * d), "attn_b": s(3 * d), "proj": s(d, d),
           "proj_b": s(d), "ln2": s(d), "fc": s(d, 4 * d), "fc_b": s(4 * d),
           "mlp": s(4 * d, d), "mlp_b": s(d)}
  return {"wte": s(GPT2["vocab"], d), "wpe": s(GPT2["positions"], d),
          "h": [dict(block) for _ in range(GPT2["layers"])]}


def gpt2_matrix(path, x):
  return np.ndim(x) == 2 and "'h'" in jax.tree_util.keystr(path)


def test_muon_sends_at_most_125x_adamw_bytes_on_gpt2_small_shapes(mesh):
  params, batch = gpt2_small_shapes(), {"x": jax.ShapeDtypeStruct((8,), jnp.float32)}
  loss = lambda p, b: sum(jnp.sum(x * x) for x in jax.tree.leaves(p)) * jnp.mean(b["x"])
  dims = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, x: MuonDimensionNumbers() if gpt2_matrix(path, x) else None, p)
  muon = optax.contrib.muon(1e-3, ns_steps=1, muon_weight_dimension_numbers=dims)  # bytes: any
  adamw = _sent(zj.make_sharded_train_step(loss, optax.adamw(1e-3), mesh=mesh), params, batch)
  whole = _sent(zj.make_sharded_train_step(loss, muon, mesh=mesh, whole_leaf_update=gpt2_matrix),
                params, batch)
  assert whole <= 1.25 * adamw


# ---------------------------------------------------------------- balance, memory
def test_busiest_device_has_at_most_13x_the_mean_newton_schulz_flops_on_gpt2_small():
  units = [u for path, x in jax.tree_util.tree_flatten_with_path(gpt2_small_shapes())[0]
           if gpt2_matrix(path, x) for u in [x.shape]]
  costs = [whole_leaf.newton_schulz_flops(u) for u in units]
  homes = whole_leaf.assign_homes(costs, units, 8)
  load = np.bincount(homes, weights=costs, minlength=8)
  assert load.max() <= 1.3 * load.mean()
  # Each group of equal shapes moves with the fewest slots: ceil(12 / 8) per device.
  for shape in set(units):
    per_device = np.bincount([h for h, u in zip(homes, units) if u == shape], minlength=8)
    assert per_device.max() == 2


def test_memory_report_counts_the_whole_matrices_at_home():
  params = {f"w{i}": jax.ShapeDtypeStruct((64, 32), jnp.float32) for i in range(12)}
  muon = optax.contrib.muon(1e-3)
  split = zj.memory_report(params, muon, n_devices=8, stages=(2,))[2]
  whole = zj.memory_report(params, muon, n_devices=8, stages=(2,), whole_leaf_update=True)[2]
  # 12 momenta split 8 ways vs 2 whole slots per device (12 matrices over 8 homes); the
  # Newton-Schulz coefficients (3 floats) are kept whole: 12 bytes instead of a 4-byte block.
  matrix = 64 * 32 * 4
  assert whole.optimizer_state == split.optimizer_state - 12 * matrix // 8 + 2 * matrix + 8
  assert whole.params == split.params and whole.gradients == split.gradients


def test_peak_memory_grows_by_at_most_the_largest_groups_share(mesh):
  params = {f"w{i}": jax.ShapeDtypeStruct((64, 32), jnp.float32) for i in range(12)}
  batch = {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32)}
  loss = lambda p, b: sum(jnp.mean(jnp.tanh(b["x"] @ w)) for w in jax.tree.leaves(p))
  opt = optax.contrib.muon(1e-3, ns_steps=1)
  make = lambda **kw: zj.make_sharded_train_step(loss, opt, mesh=mesh, **kw)
  split = zj.compiled_memory(make(), params, batch).peak
  whole = zj.compiled_memory(make(whole_leaf_update=True), params, batch).peak
  group = 2 * 64 * 32 * 4  # the largest (only) group: two whole matrices per device
  assert whole <= split + group
