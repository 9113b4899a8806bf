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
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zero_jax.train_step import ShardedTrainStep, TrainState

FORMAT = "zero_jax.checkpoint/1"
_STATE_ITEM, _META_ITEM = "state", "zero_jax"
_GROUPS = ("step", "params", "master", "opt_state", "loss_scale", "model_state", "rng")
_MAX_LISTED = 12
_CONCURRENT_GB = 96  # in-flight bytes per process while writing or reading (one shard must fit)


# --------------------------------------------------------------- description
def _key(i: int) -> str:
  return f"{i:04d}"


def _paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _entry(path: str, shape, dtype, stored) -> dict:
  return {"path": path, "shape": [int(d) for d in shape], "dtype": str(dtype),
          "stored": [int(d) for d in stored]}


def _tree_signature(treedef) -> str:
  """The node types of a tree, with plain containers of leaves collapsed to ``*``.

  ``optax.adam`` gives ``(ScaleByAdamState(*,*,*),EmptyState())``: it names
  the optimizer's state types without the parameter tree and without static
  data (whose repr may hold memory addresses).
  """
  node = treedef.node_data()
  if node is None:
    return "*"
  typ = node[0]
  kids = [_tree_signature(c) for c in treedef.children()]
  if typ is type(None):
    return "None"
  if typ in (dict, list, tuple):
    if all(k == "*" for k in kids):
      return "*"
    return "(" + ",".join(kids) + ")"
  return f"{typ.__name__}(" + ",".join(kids) + ")"


def _groups(state: TrainState) -> dict[str, Any]:
  return {g: getattr(state, g) for g in _GROUPS}


def _storage_kind(state: TrainState) -> str:
  """How the trainable parameters are kept, e.g. ``"bfloat16 + float32 master"``."""
  dtypes = sorted({str(x.dtype) for x, t in zip(jax.tree.leaves(state.params),
                                                state.meta.trainable) if t})
  kind = "/".join(dtypes) or "none trainable"
  return kind + (" + float32 master" if state.master is not None else "")


def _num_devices(state: TrainState) -> int | None:
  for x in jax.tree.leaves(state):
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
      return len(sharding.device_set)
  return None


def describe(state: TrainState) -> dict:
  """The JSON description of ``state`` stored next to its arrays.

  Works on a concrete state and on ``train_step.abstract_state(...)``.

  Returns:
    A dict with ``format``, ``num_devices`` (informative), ``trainable``,
    ``param_storage`` (parameter dtypes and whether there is a master copy),
    ``opt_signature`` (the optimizer state's node types) and ``groups``: for
    each group, one entry per leaf with its ``path``, logical ``shape``,
    ``dtype`` and ``stored`` (storage) shape.
  """
  meta = state.meta
  p_paths = _paths(state.params)
  groups = {}
  groups["step"] = [_entry("", np.shape(state.step), state.step.dtype, np.shape(state.step))]
  groups["params"] = [_entry(p, l.shape, x.dtype, np.shape(x)) for p, l, x in
                      zip(p_paths, meta.param_layouts, jax.tree.leaves(state.params))]
  if state.master is None:
    groups["master"] = []
  else:
    trained = [i for i, t in enumerate(meta.trainable) if t]
    groups["master"] = [_entry(p_paths[i], meta.param_layouts[i].shape, x.dtype, np.shape(x))
                        for i, x in zip(trained, state.master)]
  groups["opt_state"] = [_entry(p, l.shape, x.dtype, np.shape(x)) for p, l, x in
                         zip(_paths(state.opt_state), meta.opt_layouts,
                             jax.tree.leaves(state.opt_state))]
  for g in ("loss_scale", "model_state", "rng"):
    tree = getattr(state, g)
    groups[g] = [_entry(p, np.shape(x), x.dtype, np.shape(x))
                 for p, x in zip(_paths(tree), jax.tree.leaves(tree))]
  return {
      "format": FORMAT,
      "num_devices": _num_devices(state),
      "trainable": [bool(t) for t in meta.trainable],
      "param_storage": _storage_kind(state),
      "opt_signature": _tree_signature(jax.tree.structure(state.opt_state)),
      "groups": groups,
  }


def _to_items(state: TrainState) -> dict:
  """``{group: {"0000": leaf}}`` of the state's arrays, empty groups left out."""
  items = {}
  for g, tree in _groups(state).items():
    leaves = jax.tree.leaves(tree)
    if leaves:
      items[g] = {_key(i): x for i, x in enumerate(leaves)}
  return items


def _from_items(target: TrainState, items: dict) -> TrainState:
  """Puts restored ``items`` into the tree structure of ``target``."""
  fields = {}
  for g, tree in _groups(target).items():
    treedef = jax.tree.structure(tree)
    n = treedef.num_leaves
    fields[g] = jax.tree.unflatten(treedef, [items[g][_key(i)] for i in range(n)]) if n else tree
  return target.replace(**fields)


# ---------------------------------------------------------------- comparison
def _name(group: str, path: str) -> str:
  return group + path


def _listing(lines: list[str]) -> str:
  shown = lines[:_MAX_LISTED]
  more = len(lines) - len(shown)
  return "\n".join("  " + l for l in shown) + (f"\n  ... and {more} more" if more > 0 else "")


def _leaf_differences(group: str, saved: list[dict], mine: list[dict], *,
                      dtypes: bool = True) -> list[str]:
  """Lines naming leaves missing, unexpected or of another shape (or dtype)."""
  s_by = {e["path"]: e for e in saved}
  m_by = {e["path"]: e for e in mine}
  out = []
  for e in mine:
    s = s_by.get(e["path"])
    if s is None:
      out.append(f"{_name(group, e['path'])}: in this step's state "
                 f"{tuple(e['shape'])} {e['dtype']}, not in the checkpoint")
    elif s["shape"] != e["shape"] or (dtypes and s["dtype"] != e["dtype"]):
      out.append(f"{_name(group, e['path'])}: checkpoint {tuple(s['shape'])} {s['dtype']}, "
                 f"this step's state {tuple(e['shape'])} {e['dtype']}")
  for e in saved:
    if e["path"] not in m_by:
      out.append(f"{_name(group, e['path'])}: in the checkpoint {tuple(e['shape'])} "
                 f"{e['dtype']}, not in this step's state")
  if not out and [e["path"] for e in saved] != [e["path"] for e in mine]:
    out.append(f"{group}: the same leaves in another order")
  return out


def check_compatible(saved: dict, mine: dict, where: str) -> None:
  """Raises ValueError naming what differs between two `describe` results.

  Differences in the number of devices and in the stage are allowed (that is
  what a restore converts); anything else is not.
  """
  if saved.get("format") != FORMAT:
    raise ValueError(f"{where} was written in format {saved.get('format')!r}, this version of "
                     f"zero_jax reads {FORMAT!r}.")
  sg, mg = saved["groups"], mine["groups"]
  diffs = _leaf_differences("params", sg["params"], mg["params"], dtypes=False)
  if diffs:
    raise ValueError(
        f"{where} does not match the parameters given to restore ({len(diffs)} "
        f"difference(s)):\n{_listing(diffs)}\nRestore with params_like of the model that was "
        f"saved (same tree and shapes), or start from step.init(params) for a new model.")
  if saved["trainable"] != mine["trainable"]:
    names = [e["path"] for e, a, b in zip(mg["params"], saved["trainable"], mine["trainable"])
             if a != b]
    raise ValueError(f"{where} was written with other trainable= leaves; these differ: "
                     f"{', '.join('params' + n for n in names[:_MAX_LISTED])}. Build the step "
                     f"with the trainable= used for the checkpoint.")
  if saved["param_storage"] != mine["param_storage"]:
    raise ValueError(f"{where} was written with another precision: its trainable parameters "
                     f"are {saved['param_storage']}, this step's are {mine['param_storage']}. "
                     f"Build the step with the precision= of the saved run (and pass "
                     f"params_like with the dtypes the saved run was initialised with).")
  if saved["opt_signature"] != mine["opt_signature"]:
    raise ValueError(
        f"{where} was written with a different optimizer: its optimizer state is "
        f"{saved['opt_signature']}, this step's optimizer makes {mine['opt_signature']}. Build "
        f"the step with the optimizer the checkpoint was trained with (hyperparameters such as "
        f"the learning rate may change).")
  diffs = []
  for g in _GROUPS:
    diffs += _leaf_differences(g, sg[g], mg[g])
  if diffs:
    hint = ""
    if any(d.startswith(("model_state", "rng")) for d in diffs):
      hint = ("\nPass model_state= and rng= to restore shaped like the ones given to "
              "step.init in the saved run (None where it had none).")
    raise ValueError(f"{where} does not match this step's state ({len(diffs)} "
                     f"difference(s)):\n{_listing(diffs)}{hint}")


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
        _STATE_ITEM: ocp.args.PyTreeSave(_to_items(state)),
        _META_ITEM: ocp.args.JsonSave(desc)})))

  # --------------------------------------------------------------- restore
  def restore(self, train_step: ShardedTrainStep, params_like, *, step: int | None = None,
              model_state=None, rng=None) -> TrainState:
    """Reads a checkpoint into the state ``train_step`` would make.

    Args:
      train_step: the `ShardedTrainStep` to continue with (any mesh size and
        stage; the precision, optimizer and trainable leaves of the saved run).
      params_like: the parameters (arrays or ``jax.ShapeDtypeStruct``s) in
        their original tree, shapes and dtypes, as given to ``init``; or,
        for a state made by ``init(model)``, the ``nnx.Module`` or an
        abstract one (``nnx.eval_shape(lambda: Model(...))``), whose model
        state is then taken from it.
      step: which checkpoint; default the latest complete one.
      model_state: shaped like the ``model_state`` given to ``init`` for the
        saved run (arrays or shape structs), or None if it had none (or
        ``params_like`` is a module).
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
    items = _to_items(target)
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                       dtype=s.dtype, strict=False), items)
    out = self._mngr.restore(step, args=ocp.args.Composite(**{
        _STATE_ITEM: ocp.args.PyTreeRestore(item=items, restore_args=restore_args)}))
    return _from_items(target, out[_STATE_ITEM])

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


# -------------------------------------------------------------------- export
def _export_registry():
  """Orbax's standard handlers, minus the file that pins arrays to the saving devices."""
  th = ocp.type_handlers
  return th.create_type_handler_registry(
      (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
      (np.ndarray, th.NumpyHandler()),
      (jax.Array, th.ArrayHandler(enable_write_sharding_file=False)))


def export_params(directory, params, *, force: bool = False) -> None:
  """Writes full parameters as a plain Orbax checkpoint, for evaluation or serving.

  The result is an ordinary Orbax PyTree checkpoint of the ``params`` tree
  (OCDBT, the format ``ocp.StandardCheckpointer`` writes), without the record
  of which devices wrote it: code without zero_jax loads it with Orbax alone,
  on any devices, as numpy arrays (no target) or onto the shardings of an
  abstract target. The arrays are written from the devices that hold them
  (one replica of each piece of a replicated array); the export gathers
  nothing onto one host.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3)
    >>> state = step.init({"w": jnp.ones((3, 1))})
    >>> path = os.path.join(tempfile.mkdtemp(), "params")
    >>> zj.export_params(path, step.get_params(state))
    >>> # Anywhere, with Orbax alone (then e.g. model.apply({"params": params}, x)):
    >>> import orbax.checkpoint as ocp
    >>> params = ocp.StandardCheckpointer().restore(path)   # numpy arrays
    >>> params["w"].shape
    (3, 1)

  Args:
    directory: the directory to create (must not exist unless ``force``).
    params: a pytree of arrays, e.g. ``train_step.get_params(state)``.
    force: replace an existing directory.
  """
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_export_registry(),
                                        save_concurrent_gb=_CONCURRENT_GB)
  with ocp.Checkpointer(handler) as ckptr:
    ckptr.save(_abs_path(directory), args=ocp.args.PyTreeSave(params), force=force)
