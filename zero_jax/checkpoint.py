"""Checkpoints of a `TrainState` with Orbax, restorable onto a mesh of any size.

Every device writes its own shards (Orbax/TensorStore, OCDBT format); nothing
is gathered on one host. A checkpoint is one directory per step holding two
Orbax items:

* ``state``: every array of the `TrainState`, in its storage view (padded for
  the number of devices N it was saved on), as a dict
  ``{group: {"0000": leaf, ...}}`` with groups ``step``, ``params``,
  ``master``, ``opt_state``, ``loss_scale``, ``model_state`` and ``rng``
  (empty groups are left out);
* ``zero_jax``: a small JSON document (see `describe`): for every leaf its
  path in its tree, logical shape, dtype and stored shape; which parameters
  train; how they are stored (dtype, master copy); the node types of the
  optimizer state; the step and the number of devices that wrote it.

Restoring onto another N or stage is exact: padding is only ever zeros at the
end of one dimension, and a leaf's logical content is at the start of every
dimension, so Orbax reads each leaf straight into the *target's* storage shape
and sharding (``ArrayRestoreArgs(global_shape=..., strict=False)`` pads with
zeros or drops the trailing padding, per dimension). The JSON is checked first,
so a checkpoint whose trees, shapes, precision or optimizer differ from the
step's is refused with the names of the leaves that differ, instead of being
silently padded or truncated. The number of devices and the ZeRO stage may
change; the precision, the optimizer (its hyperparameters may change) and the
trainable leaves may not. The loss-scale *values* are restored; whether the
scale is dynamic is the new step's setting.

Orbax writes a checkpoint into a temporary directory and renames it when every
item of every process is written, so a crash in the middle of a save leaves no
step directory (the previous checkpoints stay, and old ones are deleted only
after the new one is complete). Restoring reads TensorStore arrays and JSON;
it never unpickles anything.

In a training loop (see `CheckpointManager` for a complete example)::

  mngr = zj.CheckpointManager("/tmp/run1/ckpt", max_to_keep=3)
  for batch in batches:
    state, metrics = step(state, batch)
    if int(state.step) % 1000 == 0:
      mngr.save(state)                       # returns while it writes
  mngr.wait_until_finished()
  # Later, in another process, on a mesh of another size or at another stage:
  state = mngr.restore(step, params_like)    # the latest complete checkpoint
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from etils import epath

from zero_jax.checkpoint_export import export_params  # noqa: F401  (re-exported)
from zero_jax.checkpoint_format import (  # noqa: F401  (FORMAT, describe: re-exported)
    FORMAT, check_compatible, describe, from_items, to_items)
from zero_jax.train_step import ShardedTrainStep, TrainState

_STATE_ITEM, _META_ITEM = "state", "zero_jax"
_CONCURRENT_GB = 96  # in-flight bytes per process while writing or reading (one shard must fit)


# ------------------------------------------------------------------- manager
def _abs_path(directory) -> epath.Path:
  s = os.fspath(directory)
  return epath.Path(s if "://" in s else os.path.abspath(s))


class CheckpointManager:
  """Saves and restores `TrainState`s, keeping the last ``max_to_keep``.

  Each device writes its own shards of the state (no gathering), in the
  background when ``async_save`` (``save`` returns once the arrays are copied
  off the devices, so the next step may reuse or donate them). A checkpoint
  saved by a step on N devices at one ZeRO stage restores into a step on any
  number of devices and any stage, with the same precision, optimizer and
  trainable leaves; training then continues with the results it would have
  had without the interruption.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> params = {"w": jnp.zeros((3, 1))}
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 1))}
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh)
    >>> state, _ = step(step.init(params), batch)
    >>> path = tempfile.mkdtemp()
    >>> with zj.CheckpointManager(path, max_to_keep=3) as mngr:
    ...   mngr.save(state)                   # step number: int(state.step)
    True
    >>> # Later, perhaps in another process: one device, ZeRO stage 3.
    >>> mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> step1 = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh1, stage=3)
    >>> with zj.CheckpointManager(path) as mngr:
    ...   state1 = mngr.restore(step1, params)   # the latest complete checkpoint
    >>> int(state1.step)
    1

  Args:
    directory: where the step directories go (created if missing).
    max_to_keep: how many of the latest checkpoints to keep (None: all).
    async_save: write in a background thread.
  """

  def __init__(self, directory, *, max_to_keep: int | None = 3, async_save: bool = True):
    if max_to_keep is not None and not (isinstance(max_to_keep, int) and max_to_keep >= 1):
      raise ValueError(f"max_to_keep must be a positive int or None (keep all), got "
                       f"{max_to_keep!r}.")
    self.directory = _abs_path(directory)
    self.max_to_keep = max_to_keep
    self.async_save = async_save
    policy = None if max_to_keep is None else ocp.checkpoint_managers.LatestN(n=max_to_keep)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True, create=True)
    # A byte limit (Orbax's StandardCheckpointHandler default) makes each array's
    # write stream to disk instead of buffering the whole state in one OCDBT
    # transaction until the commit: about 1/3 of the extra host memory.
    arrays = ocp.PyTreeCheckpointHandler(save_concurrent_gb=_CONCURRENT_GB,
                                         restore_concurrent_gb=_CONCURRENT_GB)
    self._mngr = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={_STATE_ITEM: arrays, _META_ITEM: ocp.JsonCheckpointHandler()})

  # --------------------------------------------------------------- queries
  def all_steps(self) -> list[int]:
    """The steps of the complete checkpoints on disk, ascending (waits for a pending save)."""
    self._mngr.wait_until_finished()
    self._mngr.reload()
    return sorted(self._mngr.all_steps())

  def latest_step(self) -> int | None:
    """The latest complete checkpoint's step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metadata(self, step: int | None = None) -> dict:
    """The JSON description (see `describe`) of a checkpoint (default: latest)."""
    return self._read_meta(self._resolve(step))

  def _read_meta(self, step: int) -> dict:
    where = f"the checkpoint of step {step} in {self.directory}"
    try:
      out = self._mngr.restore(step, args=ocp.args.Composite(
          **{_META_ITEM: ocp.args.JsonRestore()}))
      meta = out[_META_ITEM]
    except (FileNotFoundError, KeyError, ValueError) as e:
      raise ValueError(f"{where} has no readable zero_jax description (item {_META_ITEM!r}): "
                       f"it was not written by zero_jax.CheckpointManager ({e}).") from e
    if not isinstance(meta, dict) or "groups" not in meta:
      raise ValueError(f"{where} has no zero_jax description (item {_META_ITEM!r}); it was "
                       f"not written by zero_jax.CheckpointManager.")
    return meta

  def _resolve(self, step: int | None) -> int:
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}: nothing to "
                              f"restore. Check the path, or start from step.init(params).")
    if step is None:
      return steps[-1]
    if step not in steps:
      raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; "
                              f"the steps there are {steps}.")
    return int(step)

  # ------------------------------------------------------------------ save
  def save(self, state: TrainState, *, force: bool = False) -> bool:
    """Writes ``state`` as the checkpoint of step ``int(state.step)``.

    Returns once the arrays are off the devices; the write finishes in the
    background when ``async_save`` (see `wait_until_finished`). Call it on
    every process.

    Args:
      state: a `TrainState` made by a `ShardedTrainStep`.
      force: save even if a checkpoint of this step exists (it is replaced).

    Returns:
      True if a checkpoint is being written, False if one of this step exists
      already and ``force`` is False.
    """
    if not isinstance(state, TrainState):
      raise TypeError(f"save needs the TrainState returned by step.init or step(...), got "
                      f"{type(state).__name__}.")
    step = int(state.step)
    if step in self.all_steps():
      if not force:
        return False
      self._mngr.delete(step)
    desc = describe(state)
    desc["step"] = step
    return bool(self._mngr.save(step, force=True, args=ocp.args.Composite(**{
        _STATE_ITEM: ocp.args.PyTreeSave(to_items(state)),
        _META_ITEM: ocp.args.JsonSave(desc)})))

  # --------------------------------------------------------------- restore
  def restore(self, train_step: ShardedTrainStep, params_like, *, step: int | None = None,
              model_state=None, rng=None) -> TrainState:
    """Reads a checkpoint into the state ``train_step`` would make.

    Args:
      train_step: the `ShardedTrainStep` to continue with (any mesh size and
        stage; the precision, optimizer and trainable leaves of the saved run).
      params_like: the parameters (arrays or ``jax.ShapeDtypeStruct``s) in
        their original tree, shapes and dtypes, as given to ``init``.
      step: which checkpoint; default the latest complete one.
      model_state: shaped like the ``model_state`` given to ``init`` for the
        saved run (arrays or shape structs), or None if it had none.
      rng: shaped like the saved run's ``rng``, or None.

    Returns:
      The `TrainState`, sharded for ``train_step``'s mesh and stage.

    Raises:
      FileNotFoundError: no complete checkpoint (of that step) in the directory.
      ValueError: the checkpoint does not match ``train_step`` and
        ``params_like`` (the message names the leaves that differ).
    """
    step = self._resolve(step)
    target = train_step.abstract_state(params_like, model_state=model_state, rng=rng)
    where = f"the checkpoint of step {step} in {self.directory}"
    check_compatible(self._read_meta(step), describe(target), where)
    items = to_items(target)
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                       dtype=s.dtype, strict=False), items)
    out = self._mngr.restore(step, args=ocp.args.Composite(**{
        _STATE_ITEM: ocp.args.PyTreeRestore(item=items, restore_args=restore_args)}))
    return from_items(target, out[_STATE_ITEM])

  # ---------------------------------------------------------------- finish
  def wait_until_finished(self) -> None:
    """Blocks until the background write (if any) is complete."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    """Waits for pending writes and releases Orbax's resources."""
    self._mngr.close()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
