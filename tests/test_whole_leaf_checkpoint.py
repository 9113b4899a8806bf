"""Checkpoints of whole_leaf_update= states: any device count, with or without the option.

A state with home slots is saved in its plain form (the optimizer state of the same step
without whole_leaf_update=) and moved home again after the read, so that it restores like
any other state: written on 8 devices and restored onto 4, back onto 8 and onto 2 (meshes
over the first devices of this process's 8), each restore continuing as the run that did
not stop and as single-device optax. A checkpoint in the home form (what earlier versions
wrote) restores on its own device count and is refused elsewhere, naming the option.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from optax.contrib import MuonDimensionNumbers

import zero_jax as zj
from zero_jax.checkpoint import whole_leaf as ckpt_whole_leaf
from zero_jax.checkpoint.format import describe
from zero_jax.step import plain_state
from _whole_leaf_model import (assert_rel_close, is_matrix, loss_fn, make_batches, make_params,
                               muon)

OPTIMIZERS = {
    "muon_weight_decay": lambda: muon(weight_decay=0.1),  # reads the parameter at home
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


def mesh_of(m: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:m]), ("data",))


def reference(opt, batches):
  """Single-device optax: the parameters after each batch."""
  @jax.jit
  def one(params, state, b):
    u, state = opt.update(jax.grad(loss_fn)(params, b), state, params)
    return optax.apply_updates(params, u), state

  params = jax.device_put(jax.tree.map(jnp.asarray, make_params()), jax.devices()[0])
  state, out = opt.init(params), []
  for b in batches:
    params, state = one(params, state, b)
    out.append(params)
  return out


def plain_logical(state) -> list:
  """The optimizer state's leaves in the plain form, logical views, on the host."""
  plain = plain_state.to_plain(state) if state.meta.whole is not None else state
  return [np.asarray(x)[tuple(slice(0, d) for d in l.shape)]
          for x, l in zip(jax.tree.leaves(plain.opt_state), plain.meta.opt_layouts)]


def make_step(name, m, stage, whole=True):
  return zj.make_sharded_train_step(loss_fn, OPTIMIZERS[name](), mesh=mesh_of(m), stage=stage,
                                    whole_leaf_update=is_matrix if whole else None)


# Devices and whole_leaf_update= of each leg: saved after each, restored by the next.
CHAIN = [(8, True), (4, True), (8, True), (2, True), (4, False), (8, True)]


@pytest.mark.parametrize("name,stage", [("muon_weight_decay", 3), ("sgd_momentum", 2),
                                        ("adamw", 2)])
def test_restore_onto_other_device_counts_continues_like_the_run_that_did_not_stop(
    tmp_path, name, stage):
  batches = make_batches(len(CHAIN) + 1)
  want = reference(OPTIMIZERS[name](), batches)
  # The run that did not stop: every batch on 8 devices.
  step = make_step(name, 8, stage)
  state = step.init(make_params())
  uninterrupted = []
  for b in batches:
    state, _ = step(state, b)
    uninterrupted.append(step.get_params(state))
  # Each leg restores the last leg's checkpoint onto its device count and takes one step
  # (the first leg takes two), then saves: 8 -> 4 -> 8 -> 2, and into a step without the
  # option on 4 and back.
  state, saved = None, None
  with zj.CheckpointManager(tmp_path, max_to_keep=1) as mngr:
    for leg, (m, whole) in enumerate(CHAIN):
      step = make_step(name, m, stage, whole)
      if state is None:
        state = step.init(make_params())
        state, _ = step(state, batches[0])
      else:
        state = mngr.restore(step, make_params())
        assert (state.meta.whole is not None) == whole
        for a, b in zip(plain_logical(state), saved):  # the restore itself is exact
          np.testing.assert_array_equal(a, b, err_msg=f"leg {leg}")
      state, _ = step(state, batches[leg + 1])
      got = step.get_params(state)
      assert_rel_close(got, uninterrupted[leg + 1], 1e-6, f"leg {leg}: {m} devices")
      assert_rel_close(got, want[leg + 1], 1e-6, f"leg {leg}: {m} devices vs optax")
      saved = plain_logical(state)
      mngr.save(state)
      mngr.wait_until_finished()


def test_checkpoint_holds_the_state_of_the_step_without_the_option(mesh, tmp_path):
  """The description is the plain step's: what it restores into is checked as for any
  optimizer state (no home slots, whose number depends on the device count)."""
  step = zj.make_sharded_train_step(loss_fn, muon(), mesh=mesh, whole_leaf_update=is_matrix)
  plain = zj.make_sharded_train_step(loss_fn, muon(), mesh=mesh)
  state = step.init(make_params())
  with zj.CheckpointManager(tmp_path) as mngr:
    mngr.save(state)
    mngr.wait_until_finished()
    got = mngr.metadata()
  want = describe(plain.abstract_state(make_params()))
  assert got["opt_signature"] == want["opt_signature"]
  assert got["groups"]["opt_state"] == want["groups"]["opt_state"]


@pytest.mark.parametrize("kw", [
    {"stage": 3, "precision": "bf16"},
    {"stacked": {"layers": True, "head": False}},
    {"trainable": {"layers": True, "head": False}, "stage": 3},
    {"axis_name": ("replica", "data")},
    {"context": "its own"}, {"context": "another"},
], ids=["bf16-stage3", "stacked", "frozen", "two-data-axes", "inside-its-jax.set_mesh",
        "inside-another-mesh's-jax.set_mesh"])
def test_plain_form_moves_home_again_bit_for_bit(kw):
  context = kw.pop("context", None)
  mesh = jax.make_mesh((2, 4), ("replica", "data")) if "axis_name" in kw else \
      jax.make_mesh((8,), ("data",))  # Explicit axes
  if context is None:
    _round_trip(mesh, kw)
  else:  # states on the user's mesh, as code there expects; or the step's own, elsewhere
    with jax.set_mesh(mesh if context == "its own" else mesh_of(4)):
      _round_trip(mesh, kw)


def _round_trip(mesh, kw):
  r = np.random.default_rng(2)
  params = {"layers": (r.normal(size=(5, 12, 12)) * 0.3).astype(np.float32),
            "head": (r.normal(size=(12, 3)) * 0.3).astype(np.float32)}

  def loss(p, b):
    w = p["layers"]
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ zj.gather(w)), None), b["x"], w) \
        if "stacked" in kw else (jnp.tanh(b["x"] @ w.sum(0)), None)
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)
  dims = {"layers": MuonDimensionNumbers(1, 2), "head": MuonDimensionNumbers(0, 1)}
  step = zj.make_sharded_train_step(loss, muon(muon_weight_dimension_numbers=dims), mesh=mesh,
                                    whole_leaf_update=True, **kw)
  state = step.init(params)
  state, _ = step(state, make_batches(1)[0])
  assert state.meta.whole.plain is not None
  plain = plain_state.to_plain(state)
  assert plain.meta.whole is None and len(jax.tree.leaves(plain.opt_state)) > 0
  back = plain_state.from_plain(plain, step.abstract_state(params))
  assert back.meta == state.meta
  for a, b in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(state.opt_state)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------ the home form, refused
@pytest.fixture
def home_form(tmp_path, monkeypatch):
  """A checkpoint in the home form, as versions before the plain form wrote it, of a muon
  run on 8 devices after two steps; and the run's parameters after two more."""
  batches = make_batches(4)
  step = make_step("muon_weight_decay", 8, 2)
  state = step.init(make_params())
  for b in batches[:2]:
    state, _ = step(state, b)
  with monkeypatch.context() as m:
    m.setattr(ckpt_whole_leaf, "saved_form", lambda s: s)
    with zj.CheckpointManager(tmp_path) as mngr:
      mngr.save(state)
  for b in batches[2:]:
    state, _ = step(state, b)
  return tmp_path, batches, step.get_params(state)


def test_home_form_checkpoint_restores_on_its_device_count(home_form):
  path, batches, want = home_form
  step = make_step("muon_weight_decay", 8, 2)
  with zj.CheckpointManager(path) as mngr:
    state = mngr.restore(step, make_params())
  for b in batches[2:]:
    state, _ = step(state, b)
  assert_rel_close(step.get_params(state), want, 1e-6)


@pytest.mark.parametrize("m,whole", [(8, False), (4, True)],
                         ids=["without-the-option", "on-4-devices"])
def test_home_form_checkpoint_elsewhere_is_refused_naming_whole_leaf_update(home_form, m,
                                                                            whole):
  path, _, _ = home_form
  step = make_step("muon_weight_decay", m, 2, whole)
  with zj.CheckpointManager(path) as mngr:
    with pytest.raises(ValueError, match=r"whole_leaf_update=.*home device among 8.*"
                                         r"same whole_leaf_update= on 8 devices"):
      mngr.restore(step, make_params())


def test_leaf_whose_path_ends_with_the_moved_leafs_path_restores_without_the_option(
    mesh, tmp_path):
  """Only ``['l1']['w']`` moves, ``['blk']['l1']['w']`` (same shape, a path ending with the
  moved one's) keeps its state split: the checkpoint is the plain step's and continues there
  like the run that did not stop."""
  r = np.random.default_rng(3)
  params = {"blk": {"l1": {"w": (r.normal(size=(12, 12)) * 0.3).astype(np.float32)}},
            "l1": {"w": (r.normal(size=(12, 12)) * 0.3).astype(np.float32)}}

  def loss(p, b):
    h = jnp.tanh(b["x"] @ p["l1"]["w"])
    return jnp.mean((jnp.tanh(h @ p["blk"]["l1"]["w"])[:, :3] - b["y"]) ** 2)
  only_top = lambda path, x: jax.tree_util.keystr(path) == "['l1']['w']"
  make = lambda wl: zj.make_sharded_train_step(loss, muon(), mesh=mesh, whole_leaf_update=wl)
  batches = make_batches(4)
  step = make(only_top)
  state = step.init(params)
  for b in batches[:2]:
    state, _ = step(state, b)
  with zj.CheckpointManager(tmp_path) as mngr:
    mngr.save(state)
    mngr.wait_until_finished()
  for b in batches[2:]:
    state, _ = step(state, b)
  plain = make(None)
  with zj.CheckpointManager(tmp_path) as mngr:
    restored = mngr.restore(plain, params)
  for b in batches[2:]:
    restored, _ = plain(restored, b)
  got, want = plain.get_params(restored), step.get_params(state)
  assert_rel_close(got["l1"], want["l1"], what="l1")
  assert_rel_close(got["blk"]["l1"], want["blk"]["l1"], what="blk")
