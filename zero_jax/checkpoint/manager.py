"""Checkpoints of a `TrainState` with Orbax, restorable onto a mesh of any size or stage.

Every device writes its own shards (nothing is gathered); each step directory holds the
arrays in their storage view and a JSON description checked before anything is read, so a
checkpoint that does not fit the step is refused naming the leaves, and a damaged one is
named, never loaded. The format, the integrity record and the writer's lock are explained
in the docs' checkpoints guide; `CheckpointManager` has a complete example.
"""

from __future__ import annotations

import numbers
import os
import shutil
import warnings

import jax
import numpy as np
from etils import epath

from zero_jax.step import monitor
from zero_jax.checkpoint import hyperparams as hyperparams_lib
from zero_jax.checkpoint import store as store_lib
from zero_jax.checkpoint import integrity
from zero_jax.checkpoint import master_form
from zero_jax.checkpoint import preemption as preemption_lib
from zero_jax.checkpoint import whole_leaf
from zero_jax.checkpoint import writer
from zero_jax.checkpoint.export import export_params  # noqa: F401  (re-exported)
from zero_jax.checkpoint.format import (  # noqa: F401  (FORMAT, describe: re-exported)
    FORMAT, added_since, as_arrays, check_compatible, describe, from_items, hyperparam_casts,
    to_items, with_opt_dtypes, zeros_like)
from zero_jax.checkpoint.integrity import (  # noqa: F401  (re-exported)
    DamagedCheckpointError, DamagedCheckpointWarning)
from zero_jax.checkpoint.writer import DirectoryInUseError  # noqa: F401  (re-exported)
from zero_jax.processes.distributed import all_processes_agree
from zero_jax.step.signature import optimizer_signature
from zero_jax.step.state import masked_optimizer, optimizer_view
from zero_jax.step.state_checks import check_alive, check_concrete
from zero_jax.step.train_step import ShardedTrainStep, TrainState

_READ_ERRORS = store_lib.READ_ERRORS


# ------------------------------------------------------------------- manager
def _step_optimizer(train_step: ShardedTrainStep):  # the one place that knows where it is
  return getattr(train_step, "optimizer")


class CheckpointManager:
  """Saves and restores `TrainState`s, keeping the last ``max_to_keep``.

  Each device writes its own shards of the state (no gathering), in the
  background when ``async_save`` (``save`` returns once the arrays are copied
  off the devices, so the next step may reuse or donate them). A checkpoint
  saved by a step on N devices at one ZeRO stage restores into a step on any
  number of devices and any stage, with the same precision, optimizer and
  trainable leaves; training then continues with the results it would have
  had without the interruption.

  One manager writes a directory at a time (`DirectoryInUseError` names the
  holder of its lock); readers take no lock. A save still in flight when the
  interpreter exits is finished first; a failed one is reported, naming its
  step, by the next ``save``, ``wait_until_finished`` or ``close``.

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
    ...   state1 = mngr.restore(step1, params)   # the latest intact checkpoint
    >>> int(state1.step)
    1

  Args:
    directory: where the step directories go (created by the first ``save``).
    max_to_keep: how many of the latest checkpoints to keep (None: all).
    async_save: write in a background thread.
    store: the storage class (`zero_jax.checkpoint.store`): `OrbaxStore` by
      default, or `DirectoryStore` (plain ``.npz`` files, one process).

  Raises:
    NotADirectoryError: ``directory``, or a folder above it, is a file.
    OSError: ``directory`` exists and can be written to no more than it can be
      read from (it holds no checkpoint and is not writable).
  """

  def __init__(self, directory, *, max_to_keep: int | None = 3, async_save: bool = True,
               store: type | None = None):
    if max_to_keep is not None and not (isinstance(max_to_keep, int) and max_to_keep >= 1):
      raise ValueError(f"max_to_keep must be a positive int or None (keep all), got "
                       f"{max_to_keep!r}.")
    self.directory = epath.Path(writer.abs_path(directory))
    self.max_to_keep = max_to_keep
    self.async_save = async_save
    self._lock: writer.DirectoryLock | None = None
    self._claimed = self._closed = False
    self._pending: int | None = None  # the step of a save that may still be writing
    self._unreadable: dict[int, str] = {}  # steps whose arrays failed to read, and how
    self._rolled_back: int | None = None  # a step restored while later ones were on disk
    local = writer.is_local(self.directory)
    store = store or store_lib.OrbaxStore
    if local:
      self._check_directory(store.DESCRIPTION)
    self._store = store(
        self.directory, max_to_keep=max_to_keep, async_save=async_save, local=local)

  def _check_directory(self, description: str) -> None:
    """Refuses a file, and a directory that can be neither written nor read from. Creates
    nothing: the first save does (a mistyped path to restore from leaves nothing behind)."""
    path = os.fspath(self.directory)
    writer.check_directory(path)
    if os.path.isdir(path):
      error = writer.writable_problem(path)
      if error is not None and not integrity.holds_saves(self.directory, description):
        raise error

  # --------------------------------------------------------------- queries
  def _step_dirs(self) -> list[int]:
    return integrity.step_dirs(self.directory)

  def _problem(self, step: int) -> str | None:
    """What is damaged in the checkpoint of ``step`` (see `checkpoint_integrity`), or None."""
    step_dir = self.directory / str(step)
    return self._unreadable.get(step) or integrity.problem(
        step_dir, required=self._store.REQUIRED, description=self._store.DESCRIPTION,
        extra=self._store.step_problem)

  def all_steps(self) -> list[int]:
    """The steps of the complete, intact checkpoints on disk, ascending.

    Waits for this manager's pending save. A step directory without every
    item and file its save wrote, as it wrote them, is left out (``restore``
    names what is wrong with it).
    """
    self._finish()
    self._store.refresh()
    return [s for s in self._step_dirs() if self._problem(s) is None]

  def latest_step(self) -> int | None:
    """The latest complete, intact checkpoint's step, or None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metadata(self, step: int | None = None) -> dict:
    """The JSON description (see `describe`) of a checkpoint (default: the latest intact one)."""
    step = self._candidates(self.latest_step() if step is None else step)[0]
    problem = self._problem(step)
    meta, problem = (None, problem) if problem else store_lib.description_or_problem(self._store, step)
    if problem:
      raise self._damaged(step, problem)
    return meta

  def _candidates(self, step: int | None) -> list[int]:
    """The steps to try, newest first."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral)):
      raise TypeError(f"step= is a checkpoint's step number, an int; got "
                      f"{type(step).__name__} {step!r}. Pass e.g. step=int(...), or no step= "
                      f"for the latest intact checkpoint.")
    steps = self._step_dirs()
    if not steps:
      raise integrity.nothing_to_restore(self.directory)
    if step is None:
      return steps[::-1]
    if step not in steps:
      raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory}; "
                              f"the steps there are {self.all_steps()}.")
    return [int(step)]

  def _damaged(self, step: int, problem: str) -> DamagedCheckpointError:
    return integrity.damaged_error(self.directory, step, problem,
                                   [s for s in self.all_steps() if s != step])

  # ------------------------------------------------------------------ save
  def save(self, state: TrainState, *, force: bool = False, optimizer=None) -> bool:
    """Writes ``state`` as the checkpoint of step ``int(state.step)``.

    Returns once the arrays are off the devices; the write finishes in the
    background when ``async_save`` (see `wait_until_finished`; at the latest
    it finishes when the interpreter exits). Call it on every process.

    Args:
      state: a `TrainState` made by a `ShardedTrainStep`.
      force: save even if a checkpoint of this step exists (it is replaced).
        A damaged checkpoint of this step is replaced in any case.
      optimizer: the optax optimizer ``state`` was trained with. Its update
        rule (`zero_jax.step.signature.optimizer_signature`) is recorded, and
        `restore` refuses a step whose optimizer has another one. Default: the
        signature the state's meta carries, if any.

    Returns:
      True if a checkpoint is being written, False if an intact one of this
      step exists already and ``force`` is False.

    Raises:
      OSError: the directory cannot be written (before anything is written).
      DirectoryInUseError: another manager is writing the directory.
    """
    if not isinstance(state, TrainState):
      raise TypeError(f"save needs the TrainState returned by step.init or step(...), got "
                      f"{type(state).__name__}.")
    check_alive(state, "CheckpointManager.save")
    check_concrete(state, "CheckpointManager.save")
    self._check_open("save")
    monitor.deliver()  # what the steps before this save went through, before it is kept
    step = int(state.step)
    # any device count and stage restores it
    state = master_form.saved_form(whole_leaf.saved_form(as_arrays(state)))
    self._claim()
    self._finish()
    if (self.directory / str(step)).exists():
      problem = self._problem(step)
      if problem is None and not force:
        self._warn_if_rolled_back(step)
        return False
      if problem is not None:
        warnings.warn(f"replacing the damaged checkpoint of step {step} in {self.directory} "
                      f"({problem}).", DamagedCheckpointWarning, stacklevel=2)
      self._remove(step)
    self._unreadable.pop(step, None)
    desc = describe(state)
    desc.update({"step": step, integrity.RECORD_KEY: integrity.RECORD})
    if optimizer is not None:
      desc["optimizer"] = optimizer_signature(optimizer)
    try:
      started = self._store.write(step, to_items(state), desc)
    except Exception as e:  # a synchronous failure: the same report as an async one
      self._pending = step
      self._lost(e)
    self._pending = step if started else None
    return started

  def _warn_if_rolled_back(self, step: int) -> None:
    """A save skipped over a checkpoint that the run this manager restored from had written
    after the restored step: it is the abandoned run's, not this state's."""
    if self._rolled_back is not None and step > self._rolled_back:
      warnings.warn(
          f"the checkpoint of step {step} in {self.directory} is from before this run "
          f"restored step {self._rolled_back}, so this save kept it and wrote nothing (save "
          f"returned False): the step-{step} checkpoint is the abandoned run's. Pass "
          f"save(state, force=True) to replace it.", stacklevel=3)

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise RuntimeError(f"CheckpointManager.{what}: this manager of {self.directory} is "
                         f"closed (close() or the end of its with block); make a new one: "
                         f"zj.CheckpointManager({os.fspath(self.directory)!r}).")

  def _finish(self) -> None:
    """Waits for the pending save; if it failed, says which step was lost and why."""
    try:
      self._store.wait()
    except Exception as e:  # raised in the writer's thread, reported here
      self._lost(e)
    self._pending = None

  def _lost(self, e: BaseException):
    step, self._pending = self._pending, None
    if jax.process_index() == 0:
      self._remove_interrupted_saves()
    raise writer.save_failed(self.directory, step, e) from e

  def _claim(self) -> None:
    """Before the first save: the directory is writable, ours (locked) and cleaned up."""
    if self._claimed:
      return
    if writer.is_local(self.directory):
      path = os.fspath(self.directory)
      writer.make_directory(path)
      writer.check_writable(path)
      if jax.process_index() == 0:
        self._lock = writer.DirectoryLock(path)
        self._lock.acquire()
        self._remove_interrupted_saves()
    writer.finish_at_exit(self)
    self._claimed = True

  def _remove_interrupted_saves(self) -> None:
    """Deletes the temporary directories that saves cut short by a crash left."""
    suffix = self._store.tmp_suffix()
    for p in self.directory.iterdir():
      if suffix in p.name and p.name.split(".", 1)[0].isdigit():
        shutil.rmtree(os.fspath(p), ignore_errors=True)

  def _remove(self, step: int) -> None:
    """Deletes the checkpoint of ``step`` (every process calls it)."""
    self._store.delete(step, self.directory / str(step))

  # --------------------------------------------------------------- restore
  def restore(self, train_step: ShardedTrainStep, params_like, *, step: int | None = None,
              model_state=None, rng=None, hyperparams: str | None = None) -> TrainState:
    """Reads a checkpoint into the state ``train_step`` would make.

    Without ``step``, the newest checkpoint that is intact: a damaged newer
    one (files missing, truncated or altered, or unreadable) is skipped with a
    `DamagedCheckpointWarning` that names it and what is wrong. The loss-scale
    policy is ``train_step``'s: a dynamic scale continues from the saved value,
    a static one is the step's ``loss_scale=``.

    Args:
      train_step: the `ShardedTrainStep` to continue with (any mesh size and
        stage; the precision, optimizer and trainable leaves of the saved run).
      params_like: what ``init`` was given, or its shapes: the parameters
        (arrays or ``jax.ShapeDtypeStruct``s), an ``nnx.Module`` or an abstract
        one (``nnx.eval_shape(lambda: Model(...))``, whose model state is then
        taken from it), or the init function (traced, not run).
      step: which checkpoint; default the latest intact one.
      model_state: shaped like the ``model_state`` given to ``init`` for the
        saved run (arrays or shape structs), or None if it had none (or
        ``params_like`` is a module).
      rng: shaped like the saved run's ``rng``, or None.
      hyperparams: for an optimizer made with ``optax.inject_hyperparams``,
        whose state holds its hyperparameters: None keeps the checkpoint's and
        warns where they differ from the step optimizer's; ``"checkpoint"``
        keeps them silently; ``"step"`` takes the step optimizer's.

    Returns:
      The `TrainState`, sharded for ``train_step``'s mesh and stage.

    Raises:
      FileNotFoundError: no checkpoint (of that step) in the directory.
      DamagedCheckpointError: the checkpoint of ``step`` is damaged, or, without
        ``step``, every checkpoint is (the message names the damage and the
        intact steps).
      ValueError: the checkpoint does not match ``train_step`` and
        ``params_like`` (the message names the leaves that differ).
    """
    if not isinstance(train_step, ShardedTrainStep):
      raise TypeError(
          f"restore's first argument is the ShardedTrainStep to continue with (the function "
          f"make_sharded_train_step returned), then the params' shapes; got "
          f"{type(train_step).__name__} {train_step!r:.60}. Call "
          f"mngr.restore(step_fn, params_like, step=N) (the checkpoint's step is a keyword).")
    self._check_open("restore")
    hyperparams_lib.check_choice(hyperparams)
    target = train_step.abstract_state(params_like, model_state=model_state, rng=rng)
    optimizer = (optimizer_signature(_step_optimizer(train_step)),
                 optimizer_signature(_step_optimizer(train_step), legacy=True))
    self._finish()
    self._store.refresh()
    damaged = []
    for s in self._candidates(step):
      state, problem = self._restore_step(s, target, optimizer)
      if problem is None:
        opt = masked_optimizer(_step_optimizer(train_step), jax.tree.structure(target.params),
                               state.meta.trainable)
        seen = optimizer_view(train_step.spec, target.meta, target.params)  # the init's dtypes
        state = whole_leaf.into_step(state.replace(  # the plain form read, moved home
            opt_state=hyperparams_lib.reconcile(state.opt_state, opt, seen, hyperparams,
                                                f"the checkpoint of step {s} in "
                                                f"{self.directory}"),
            loss_scale=hyperparams_lib.static_scale(state.loss_scale,
                                                    train_step.initial_loss_scale)), target)
        state = master_form.into_step(state, target)
        self._rolled_back = s if any(t > s for t in self._step_dirs()) else None
        for d, why in damaged:
          warnings.warn(f"the checkpoint of step {d} in {self.directory} is damaged ({why}); "
                        f"restored step {s}, the newest intact one.", DamagedCheckpointWarning,
                        stacklevel=2)
        return state
      if step is not None:
        raise self._damaged(s, problem)
      damaged.append((s, problem))
    raise DamagedCheckpointError(
        f"no intact checkpoint in {self.directory}: " +
        "; ".join(f"step {d} is damaged ({why})" for d, why in damaged) +
        ". Restore from a copy of the directory, or start from step.init(params).")

  def _restore_step(self, step: int, target: TrainState, optimizer: tuple[str, str]):
    """``(state, None)``, or ``(None, what is damaged)``: the same on every process.

    ``optimizer``: the step's update rule's signature, and the one an older zero_jax gave it.
    """
    state, (meta, problem) = None, (None, self._problem(step))
    if problem is None:
      meta, problem = store_lib.description_or_problem(self._store, step)
    if problem is None:
      where = f"the checkpoint of step {step} in {self.directory}"
      # A checkpoint written before integers were hyperparameters records the older name.
      rule = optimizer[1] if meta.get("optimizer") == optimizer[1] else optimizer[0]
      into, mine = whole_leaf.read_target(meta, master_form.abstract_saved(target), rule,
                                          where)
      check_compatible(meta, mine, where)
      if not meta.get("optimizer"):
        warnings.warn(f"{where} does not record its optimizer's update rule (it was written "
                      f"by an older zero_jax, or saved without optimizer=): restoring it into "
                      f"a step with {mine['optimizer']} unchecked.", stacklevel=3)
      # An injected hyperparameter saved as an int and now a float (or back): read as
      # saved, then cast to the step's dtype.
      casts = hyperparam_casts(meta, mine)
      state, problem = self._read_arrays(step, with_opt_dtypes(into, casts),
                                         added_since(meta, mine))
      if state is not None:
        state = with_opt_dtypes(state, {i: mine["groups"]["opt_state"][i]["dtype"]
                                        for i in casts})
    if not all_processes_agree(problem is None):
      if problem is None:
        self._unreadable[step] = problem = "another process of the job could not read it"
      return None, problem
    return state, None

  def _read_arrays(self, step: int, target: TrainState, added):
    """``(state, None)`` or ``(None, problem)``; ``added`` leaves are not read but zero."""
    items = to_items(target)
    fill = {(g, k): items[g].pop(k) for g, k in added}
    try:
      out = self._store.read_arrays(step, items)
    except _READ_ERRORS as e:
      self._unreadable[step] = f"reading its arrays failed: {writer.first_line(e)}"
      return None, self._unreadable[step]
    for (g, k), like in fill.items():
      out[g][k] = zeros_like(like)
    return from_items(target, out), None

  # ------------------------------------------------------------ preemption
  preemption: "preemption_lib.Preemption | None" = None
  """Where `reached_preemption` stopped the job, once it returned True."""

  def reached_preemption(self, state: TrainState) -> bool:
    """Whether to stop for a preemption notice; if so, ``state`` is saved.

    Call it every step on every process: False (no device sync) until a notice
    (SIGTERM, or the signals of `watch_preemption`) on any process has reached
    every process; then True at the same call everywhere, after saving
    ``state`` whatever the save interval (not the initial state, step 0) and
    waiting for the write; `preemption` says which step. A loop to paste:
    the checkpoints guide, "Preemption and resuming".

    Args:
      state: the `TrainState` the next step would start from.
    """
    self._check_open("reached_preemption")
    return preemption_lib.reached(self, state)

  # ---------------------------------------------------------------- finish
  def wait_until_finished(self) -> None:
    """Blocks until the background write (if any) is complete.

    Raises:
      OSError: the pending save failed (the message names its step and why, e.g. a
        full disk); its temporary directory is removed.
    """
    monitor.deliver()
    self._finish()

  def close(self) -> None:
    """Waits for pending writes, releases Orbax's resources and the directory's lock."""
    monitor.deliver()
    if self._closed:
      return
    self._closed = True
    writer.forget_at_exit(self)
    try:
      self._finish()
    finally:
      try:
        preemption_lib.release(self)
      finally:
        self._close_store()

  def _close_store(self) -> None:
    try:
      self._store.close()
    finally:
      if self._lock is not None:
        self._lock.release()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
