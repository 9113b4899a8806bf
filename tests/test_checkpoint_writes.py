"""Checkpoint writes that go wrong, misuse of the manager, and restored hyperparameters.

A failed background save is reported as soon as it is known, naming the step lost and
why (a full disk as such), and leaves no temporary directory; ``save`` after ``close``
and ``restore`` given a step number first are clear errors; an ``inject_hyperparams``
learning rate restored from a checkpoint is warned about, or taken from the step. Issue 28:
a Python number in a saved state, leaves without elements, export into an existing path,
restore(step="2"), a full disk deep in TensorStore's message or at the first save, a directory
that is a file, and a mistyped directory that restore leaves uncreated. Issue 36: restore from a
safetensors export names it, reached_preemption on a closed manager.
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
  with pytest.raises(RuntimeError, match=r"reached_preemption: this manager .* is closed"):
    mngr.reached_preemption(state)  # refused up front, not at the save a notice would make
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


# ------------------------------------------- the last raw errors (issue 28, items 10-11)
def test_a_python_number_set_in_an_inject_hyperparams_state_is_saved_and_restored(tmp_path):
  step, state = trained(optax.inject_hyperparams(optax.adam)(learning_rate=0.01))
  state.opt_state.hyperparams["learning_rate"] = 1e-4  # by hand, as optax's docs show
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    restored = mngr.restore(step, params(), hyperparams="checkpoint")
    with pytest.raises(TypeError, match=r"step= is a checkpoint's step number, an int; got "
                                        r"str '2'"):
      mngr.restore(step, params(), step="2")
  lr = restored.opt_state.hyperparams["learning_rate"]
  assert lr.dtype == np.float32 and float(lr) == np.float32(1e-4)
  for i in range(2):
    restored, _ = step(restored, batch(2 + i))
  want = _continue(1e-4, None)
  for k, v in step.get_params(restored).items():
    np.testing.assert_allclose(np.asarray(v), np.asarray(want[k]), rtol=2e-5, atol=1e-7)
  state.opt_state.hyperparams["learning_rate"] = "1e-4"
  with zj.CheckpointManager(tmp_path / "other") as mngr:
    with pytest.raises(TypeError, match=r"state.opt_state.hyperparams\['learning_rate'\] is "
                                        r"a str, not an array or a number"):
      mngr.save(state)


def test_export_into_an_existing_path_or_with_empty_leaves_is_refused(tmp_path):
  tree = {"w": np.ones((3, 2), np.float32)}
  zj.export_params(tmp_path / "params", tree)
  with pytest.raises(FileExistsError, match=r"export_params writes a new directory, and .*"
                                            r"params exists \(a directory\).*force=True"):
    zj.export_params(tmp_path / "params", tree)
  zj.export_params(tmp_path / "params", {"w": np.zeros((3, 2), np.float32)}, force=True)
  with pytest.raises(ValueError, match=r"params\['e'\] has shape \(0, 2\), no elements"):
    zj.export_params(tmp_path / "other", {**tree, "e": np.zeros((0, 2), np.float32)})


def test_export_of_shapes_without_values_is_refused_naming_the_leaf(tmp_path):
  """Issue 48: ShapeDtypeStruct leaves failed inside Orbax ("TypeHandler lookup failed")."""
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=_mesh())
  abstract = jax.eval_shape(step.get_params, step.abstract_state(params()))
  with pytest.raises(TypeError, match=r"params\['b'\] is a jax.ShapeDtypeStruct \(3,\) float32: "
                                      r"a shape without values, and export_params writes "
                                      r"values. Pass arrays, e.g. step.get_params\(state\)"):
    zj.export_params(tmp_path / "params", abstract)
  with pytest.raises(TypeError, match=r"params\['w'\]\[1\] is a str, not an array or a "
                                      r"number.*leave it out"):
    zj.export_params(tmp_path / "params", {"w": [np.ones(2, np.float32), "kernel"]})
  assert not (tmp_path / "params").exists()  # refused before anything is written


def test_a_state_with_leaves_without_elements_is_saved_and_restored(tmp_path):
  with_empty = {**params(), "e": np.zeros((0, 3), np.float32)}
  loss = lambda p, b: loss_fn(p, b) + jnp.sum(p["e"])
  step = zj.make_sharded_train_step(loss, optax.adam(1e-2), mesh=_mesh(), stage=3)
  state, _ = step(step.init(with_empty), batch())
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    restored = mngr.restore(step, with_empty)
  got = step.get_params(restored)
  assert got["e"].shape == (0, 3)
  for k, v in step.get_params(state).items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v))


def _tensorstore_disk_full(step, items, description):
  """What TensorStore raises in a synchronous save on a full disk: the reason after a path
  long enough that the message's first 400 characters do not hold it."""
  del step, items, description
  deep = "/".join(["checkpoints", "run-2026-11-25", "0.orbax-checkpoint-tmp"] * 6)
  raise ValueError(f'RESOURCE_EXHAUSTED: Error opening "zarr" driver: Error writing '
                   f'"opt_state.0001/.zarray" in OCDBT database at local file "/{deep}/": '
                   f'Failed writing: "/{deep}/d/6c42ec3c": Failed to write 181 bytes to file '
                   f"12: No space left on device [os_error_code='28']")


def test_a_full_disk_in_a_synchronous_save_is_named_as_such(tmp_path, monkeypatch):
  _, state = trained(optax.sgd(0.1))
  mngr = zj.CheckpointManager(tmp_path, async_save=False)
  monkeypatch.setattr(mngr._store, "write", _tensorstore_disk_full)
  with pytest.raises(OSError, match=r"checkpoint of step 2 .* failed: the disk is full.*Free "
                                    r"space") as e:
    mngr.save(state)
  assert e.value.errno == errno.ENOSPC
  mngr.close()


def test_a_full_disk_at_the_first_save_is_named_and_leaves_no_probe(tmp_path, monkeypatch):
  from zero_jax.checkpoint import writer
  real_open = open

  def full_open(path, mode="r", *args, **kw):  # files are made, writing them fails
    f = real_open(path, mode, *args, **kw)
    if "w" in mode:
      f.close()
      raise OSError(errno.ENOSPC, "No space left on device", path)
    return f
  monkeypatch.setattr(writer, "open", full_open, raising=False)
  _, state = trained(optax.sgd(0.1))
  with pytest.raises(OSError, match=r"checkpoint directory .* is not writable: the disk is "
                                    r"full") as e:
    zj.CheckpointManager(tmp_path / "ckpt").save(state)
  assert e.value.errno == errno.ENOSPC
  assert os.listdir(tmp_path / "ckpt") == []  # the probe is gone


def test_a_directory_that_is_a_file_is_named_and_a_mistyped_one_is_not_created(tmp_path):
  step, state = trained(optax.sgd(0.1))
  (tmp_path / "a_file").write_text("")
  with pytest.raises(NotADirectoryError, match=r"checkpoint directory .*a_file is a file, not "
                                               r"a directory"):
    zj.CheckpointManager(tmp_path / "a_file")
  mistyped = tmp_path / "runs" / "ckpt"
  with zj.CheckpointManager(mistyped) as mngr:
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*ckpt \(the "
                                                r"directory does not exist\)"):
      mngr.restore(step, params())
    assert mngr.all_steps() == [] and mngr.latest_step() is None
  assert not (tmp_path / "runs").exists()  # nothing left behind
  with zj.CheckpointManager(mistyped) as mngr:  # the first save makes it
    assert mngr.save(state)
  assert zj.CheckpointManager(mistyped).all_steps() == [2]


def test_an_unwritable_directory_of_number_named_folders_is_refused_as_holding_no_checkpoint(
    tmp_path, monkeypatch):
  """/proc is such a directory: its folders (process ids) come and go, and are no checkpoints.
  An unwritable directory that holds a save is still opened, to restore from."""
  from zero_jax.checkpoint import writer
  step, state = trained(optax.sgd(0.1))
  with zj.CheckpointManager(tmp_path / "saved") as mngr:
    assert mngr.save(state)
  for n in ("17", "4242"):
    (tmp_path / "pids" / n).mkdir(parents=True)
  monkeypatch.setattr(writer, "writable_problem", lambda d: PermissionError(
      errno.EACCES, f"the checkpoint directory {d} is not writable"))
  with pytest.raises(PermissionError, match=r"checkpoint directory .*pids is not writable"):
    zj.CheckpointManager(tmp_path / "pids")
  with zj.CheckpointManager(tmp_path / "saved") as mngr:
    assert mngr.all_steps() == [2]
    mngr.restore(step, params())


def test_restoring_from_a_safetensors_export_points_at_load_safetensors(tmp_path):
  """An export holds parameters only: restore names its files and the reader to use, and
  the reader it names loads them."""
  step, state = trained(optax.sgd(0.1))
  zj.export_safetensors(step, state, tmp_path / "hf")
  with zj.CheckpointManager(tmp_path / "hf") as mngr:
    with pytest.raises(FileNotFoundError, match=r"hf holds a safetensors export "
                                                r"\(model.safetensors\), not a CheckpointManager "
                                                r"checkpoint.*zj.load_safetensors\("):
      mngr.restore(step, params())
  loaded = zj.load_safetensors(tmp_path / "hf", params(), step=step)
  for k, v in step.get_params(state).items():
    np.testing.assert_array_equal(np.asarray(loaded[k]), np.asarray(v), err_msg=k)
  (tmp_path / "empty").mkdir()
  with zj.CheckpointManager(tmp_path / "empty") as mngr:  # an empty directory: as before
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint in .*empty: nothing"):
      mngr.restore(step, params())
