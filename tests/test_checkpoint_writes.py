"""Checkpoint writes that go wrong, misuse of the manager, and restored hyperparameters.

A failed background save is reported as soon as it is known, naming the step lost and
why (a full disk as such), and leaves no temporary directory; ``save`` after ``close``
and ``restore`` given a step number first are clear errors; an ``inject_hyperparams``
learning rate restored from a checkpoint is warned about, or taken from the step.
"""

import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from zero_jax.checkpoint import integrity as checkpoint_integrity

MESH = None


def _mesh():
  return jax.make_mesh((jax.device_count(),), ("data",))


def loss_fn(p, b):
  return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def params():
  r = np.random.default_rng(0)
  return {"w": r.normal(size=(5, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}


def batch(i=0):
  r = np.random.default_rng(10 + i)
  return {"x": r.normal(size=(16, 5)).astype(np.float32),
          "y": r.normal(size=(16, 3)).astype(np.float32)}


def trained(opt, n=2):
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=_mesh())
  state = step.init(params())
  for i in range(n):
    state, _ = step(state, batch(i))
  return step, state


def _tmp_dirs(path):
  return [p for p in os.listdir(path) if "tmp" in p]


# ------------------------------------------------------------------ misuse
def test_restore_with_a_step_number_first_says_what_to_pass(tmp_path):
  step, state = trained(optax.sgd(0.1))
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    with pytest.raises(TypeError, match=r"first argument is the ShardedTrainStep.*"
                                         r"got int 2.*restore\(step_fn, params_like, step=N\)"):
      mngr.restore(2, params())


def test_save_and_restore_after_close_are_clear_errors(tmp_path):
  step, state = trained(optax.sgd(0.1))
  mngr = zj.CheckpointManager(tmp_path)
  mngr.save(state)
  mngr.close()
  with pytest.raises(RuntimeError, match=r"save: this manager of .* is closed.*make a new one"):
    mngr.save(state, force=True)
  with pytest.raises(RuntimeError, match=r"restore: this manager .* is closed"):
    mngr.restore(step, params())
  with zj.CheckpointManager(tmp_path) as again:  # what the message says works
    assert again.latest_step() == 2


# ------------------------------------------------------------ failing saves
def _disk_full(monkeypatch):
  def full(step_dir):
    raise OSError(errno.ENOSPC, "No space left on device", str(step_dir))
  monkeypatch.setattr(checkpoint_integrity, "write_record", full)


def test_a_failed_async_save_is_reported_naming_the_step_and_a_full_disk(tmp_path, monkeypatch):
  step, state = trained(optax.adam(1e-2))
  mngr = zj.CheckpointManager(tmp_path, async_save=True)
  mngr.save(state)
  mngr.wait_until_finished()
  state, _ = step(state, batch(5))
  _disk_full(monkeypatch)
  assert mngr.save(state)  # returns while the write goes on
  with pytest.raises(OSError, match=r"checkpoint of step 3 .* failed: the disk is full") as e:
    mngr.wait_until_finished()
  assert e.value.errno == errno.ENOSPC
  assert _tmp_dirs(tmp_path) == []  # the temporary directory is gone
  monkeypatch.undo()
  assert mngr.all_steps() == [2]  # the earlier checkpoint is intact, and nothing is pending
  restored = mngr.restore(step, params())
  assert int(restored.step) == 2
  mngr.close()


def test_a_failed_save_is_reported_by_the_next_save_or_close(tmp_path, monkeypatch):
  step, state = trained(optax.sgd(0.1))
  _disk_full(monkeypatch)
  mngr = zj.CheckpointManager(tmp_path, async_save=True)
  mngr.save(state)
  state, _ = step(state, batch(3))
  with pytest.raises(OSError, match=r"step 2 .* the disk is full"):
    mngr.save(state)
  mngr.save(state)
  with pytest.raises(OSError, match=r"step 3 .* the disk is full"):
    mngr.close()
  assert _tmp_dirs(tmp_path) == []


# ------------------------------------------------------ restored hyperparameters
def _continue(opt_state_lr, lr_step, n_after=2):
  """Single-device optax: 2 steps at lr 0.01, then ``n_after`` more with the state's
  learning rate set to ``opt_state_lr`` (what restore leaves in force)."""
  opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
  p = jax.tree.map(jnp.asarray, params())
  s = opt.init(p)
  g = jax.grad(loss_fn)
  for i in range(2):
    u, s = opt.update(g(p, batch(i)), s, p)
    p = optax.apply_updates(p, u)
  s.hyperparams["learning_rate"] = jnp.asarray(opt_state_lr, jnp.float32)
  for i in range(n_after):
    u, s = opt.update(g(p, batch(2 + i)), s, p)
    p = optax.apply_updates(p, u)
  return p


@pytest.mark.parametrize("choice", [None, "checkpoint", "step"])
def test_restored_inject_hyperparams_are_warned_or_taken_from_the_step(tmp_path, choice):
  _, state = trained(optax.inject_hyperparams(optax.adam)(learning_rate=0.01))
  new = zj.make_sharded_train_step(
      loss_fn, optax.inject_hyperparams(optax.adam)(learning_rate=1e-4), mesh=_mesh())
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    if choice is None:
      with pytest.warns(UserWarning, match=r"learning_rate: checkpoint 0.01.* vs step "
                                           r"0.0001.*checkpoint's values are in force.*"
                                           r"hyperparams='step'"):
        restored = mngr.restore(new, params())
    else:
      restored = mngr.restore(new, params(), hyperparams=choice)
  for i in range(2):
    restored, _ = new(restored, batch(2 + i))
  want = _continue(1e-4 if choice == "step" else 0.01, None)
  for k, v in new.get_params(restored).items():
    np.testing.assert_allclose(np.asarray(v), np.asarray(want[k]), rtol=2e-5, atol=1e-7)


def test_restore_refuses_an_unknown_hyperparams_choice(tmp_path):
  step, state = trained(optax.sgd(0.1))
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    with pytest.raises(ValueError, match=r"hyperparams='new'.*'checkpoint'.*'step'"):
      mngr.restore(step, params(), hyperparams="new")
