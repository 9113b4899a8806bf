"""Where checkpoint bytes go: the storage behind `zero_jax.CheckpointManager`.

The manager keeps the policy (which step to try, damage warnings, agreement between
processes, the writer's lock); a store only writes, reads, lists and deletes step
directories under one directory. `OrbaxStore` (the default) writes TensorStore arrays
with Orbax, each device its own shards; `DirectoryStore` is a plain ``.npz`` store for
single-process use and tests, and shows what another store needs: the methods below,
atomic commits (a temporary directory renamed when complete, the integrity record of
`zero_jax.checkpoint.integrity` written just before), and ``REQUIRED``/``DESCRIPTION``.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zero_jax import _compat
from zero_jax.checkpoint import integrity
from zero_jax.checkpoint import writer

STATE_ITEM, META_ITEM = "state", "zero_jax"
# A failed read of a damaged checkpoint: TensorStore raises ValueError, JSON
# ValueError, Orbax KeyError (a missing item) or OSError.
READ_ERRORS = (OSError, ValueError, KeyError, EOFError)
CONCURRENT_GB = 96  # in-flight bytes per process while writing or reading (one shard must fit)


class OrbaxStore:
  """Step directories written by Orbax: each device writes its own shards (OCDBT).

  Args:
    directory: the checkpoint directory (an ``epath.Path``).
    max_to_keep: how many of the latest steps to keep (None: all).
    async_save: write in a background thread (`wait` waits for it).
    local: the directory is on a local file system (the manager cleans up after
      interrupted saves itself; Orbax does it elsewhere).
  """
  # What every complete save writes (the record, when there is one, lists the rest).
  REQUIRED = ("_CHECKPOINT_METADATA", f"{STATE_ITEM}/_METADATA", f"{META_ITEM}/metadata")
  DESCRIPTION = f"{META_ITEM}/metadata"

  def __init__(self, directory, *, max_to_keep: int | None, async_save: bool, local: bool):
    policy = None if max_to_keep is None else ocp.checkpoint_managers.LatestN(n=max_to_keep)
    options = ocp.CheckpointManagerOptions(
        # A local directory is made by the manager's first save, not here (see its docs).
        preservation_policy=policy, enable_async_checkpointing=async_save, create=not local,
        # A reader must not delete a save in progress: the writer cleans up (local dirs).
        cleanup_tmp_directories=not local,
        # Directories are made before save() returns, so that a failure raises there.
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        temporary_path_class=integrity.recording_temporary_path_class(directory))
    # A byte limit makes each array's write stream to disk instead of buffering the
    # whole state in one OCDBT transaction until the commit.
    arrays = ocp.PyTreeCheckpointHandler(save_concurrent_gb=CONCURRENT_GB,
                                         restore_concurrent_gb=CONCURRENT_GB)
    self._mngr = ocp.CheckpointManager(
        directory, options=options,
        item_handlers={STATE_ITEM: arrays, META_ITEM: ocp.JsonCheckpointHandler()})

  def write(self, step: int, items: dict, description: dict) -> bool:
    """Starts writing ``items`` (``{group: {key: array}}``) and the JSON ``description``."""
    return bool(self._mngr.save(step, force=True, args=ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeSave(items), META_ITEM: ocp.args.JsonSave(description)})))

  def read_description(self, step: int) -> Any:
    return self._mngr.restore(step, args=ocp.args.Composite(
        **{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]

  def read_arrays(self, step: int, like: dict) -> dict:
    """``like``'s arrays (shape structs with shardings), padded or cut per dimension."""
    restore_args = jax.tree.map(
        lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape,
                                       dtype=s.dtype, strict=False), like)
    return self._mngr.restore(step, args=ocp.args.Composite(**{
        STATE_ITEM: ocp.args.PyTreeRestore(item=like, restore_args=restore_args)}))[STATE_ITEM]

  def delete(self, step: int, step_dir: epath.Path) -> None:
    self._mngr.reload()
    if step in self._mngr.all_steps():
      self._mngr.delete(step)
    elif jax.process_index() == 0:  # too damaged for Orbax to list it
      shutil.rmtree(os.fspath(step_dir), ignore_errors=True)

  def refresh(self) -> None:
    """Sees steps other managers wrote since."""
    self._mngr.reload()

  def wait(self) -> None:
    """Waits for the background write; raises what it failed with."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.close()

  def tmp_suffix(self) -> str:
    return _compat.orbax_tmp_dir_suffix()

  def step_problem(self, step_dir: epath.Path) -> str | None:
    return integrity.orbax_metadata_problem(step_dir)


class DirectoryStore:
  """Plain files: one ``.npz`` of whole arrays and a JSON description per step.

  Single process; writes synchronously (``async_save`` is ignored). Arrays are
  gathered to this host to be written, so this suits small states and tests.
  """
  REQUIRED = (f"{STATE_ITEM}/arrays.npz", f"{META_ITEM}/metadata")
  DESCRIPTION = f"{META_ITEM}/metadata"
  _TMP = ".zero_jax-tmp"

  def __init__(self, directory, *, max_to_keep: int | None, async_save: bool, local: bool):
    del async_save, local
    if jax.process_count() > 1:
      raise ValueError("DirectoryStore writes whole arrays from one process; with several "
                       "processes use the default OrbaxStore.")
    self.directory = epath.Path(directory)
    self.max_to_keep = max_to_keep

  def write(self, step: int, items: dict, description: dict) -> bool:
    final = self.directory / str(step)
    tmp = self.directory / f"{step}{self._TMP}"
    shutil.rmtree(os.fspath(tmp), ignore_errors=True)
    (tmp / STATE_ITEM).mkdir(parents=True)
    (tmp / META_ITEM).mkdir()
    flat = {f"{g}/{k}": _host(x) for g, d in items.items() for k, x in d.items()}
    with open(os.fspath(tmp / self.REQUIRED[0]), "wb") as f:
      np.savez(f, **flat)
    (tmp / self.DESCRIPTION).write_text(json.dumps(description))
    integrity.write_record(tmp)
    shutil.rmtree(os.fspath(final), ignore_errors=True)
    os.rename(os.fspath(tmp), os.fspath(final))  # the commit
    self._keep_latest()
    return True

  def _keep_latest(self) -> None:
    steps = integrity.step_dirs(self.directory)
    if self.max_to_keep is not None:
      for s in steps[:-self.max_to_keep]:
        shutil.rmtree(os.fspath(self.directory / str(s)), ignore_errors=True)

  def read_description(self, step: int) -> Any:
    return json.loads((self.directory / str(step) / self.DESCRIPTION).read_text())

  def read_arrays(self, step: int, like: dict) -> dict:
    with np.load(os.fspath(self.directory / str(step) / self.REQUIRED[0])) as z:
      saved = {name: z[name] for name in z.files}
    return {g: {k: _placed(saved[f"{g}/{k}"], s) for k, s in d.items()}
            for g, d in like.items()}

  def delete(self, step: int, step_dir: epath.Path) -> None:
    shutil.rmtree(os.fspath(step_dir), ignore_errors=True)

  def refresh(self) -> None:
    pass

  def wait(self) -> None:
    pass

  def close(self) -> None:
    pass

  def tmp_suffix(self) -> str:
    return self._TMP

  def step_problem(self, step_dir: epath.Path) -> str | None:
    del step_dir
    return None


def description_or_problem(store, step: int) -> tuple[dict | None, str | None]:
  """The zero_jax description of ``step`` read through ``store``, or None and why it
  cannot be had (unreadable, or not written by `zero_jax.CheckpointManager`)."""
  try:
    meta = store.read_description(step)
  except READ_ERRORS as e:
    return None, (f"its zero_jax description (item {META_ITEM!r}) is unreadable ("
                  f"{writer.first_line(e)}); was it written by zero_jax.CheckpointManager?")
  if not isinstance(meta, dict) or "groups" not in meta:
    return None, (f"its item {META_ITEM!r} is not a zero_jax description; it was not "
                  f"written by zero_jax.CheckpointManager")
  return meta, None


def _is_key(dtype) -> bool:
  return jax.numpy.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(dtype):
  """The PRNG implementation of a key dtype (from a key of that dtype)."""
  return jax.random.key_impl(_key_of(dtype))


def _key_of(dtype):
  for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
    k = jax.random.key(0, impl=impl)
    if k.dtype == dtype:
      return k
  raise ValueError(f"cannot restore keys of dtype {dtype} from a DirectoryStore")


def _host(x) -> np.ndarray:
  """A whole array as numpy: keys as their data, ml_dtypes (bfloat16, ...) as raw bits."""
  if _is_key(x.dtype):
    x = jax.random.key_data(x)
  value = np.asarray(jax.device_get(x))
  if value.dtype.kind == "V" or type(value.dtype).__module__.startswith("ml_dtypes") or \
      value.dtype.name in ("bfloat16",) or value.dtype.name.startswith("float8"):
    value = value.view(f"u{value.dtype.itemsize}")
  return value


def _placed(value: np.ndarray, like) -> jax.Array:
  """A saved array in ``like``'s shape (trailing padding cut or added as zeros per
  dimension, as Orbax's non-strict restore does) and sharding."""
  if _is_key(like.dtype):
    struct = jax.ShapeDtypeStruct(like.shape, like.dtype)
    data = jax.eval_shape(jax.random.key_data, struct)
    out = np.asarray(value, data.dtype).reshape(data.shape)
    rebuild = jax.jit(lambda d: jax.random.wrap_key_data(d, impl=_key_impl(like.dtype)),
                      out_shardings=like.sharding)
    return rebuild(out)
  dtype = np.dtype(like.dtype)
  if value.dtype != dtype and value.dtype.itemsize == dtype.itemsize:
    value = value.view(dtype)  # raw bits of an ml_dtypes array
  if value.ndim != len(like.shape):
    raise ValueError(f"saved shape {value.shape} cannot become {tuple(like.shape)}")
  out = np.zeros(like.shape, dtype)
  common = tuple(slice(0, min(a, b)) for a, b in zip(value.shape, like.shape))
  out[common] = value[common]
  return jax.make_array_from_callback(out.shape, like.sharding, lambda i: out[i])
