"""Full parameters as a plain Orbax checkpoint, for evaluation or serving (`export_params`)."""

from __future__ import annotations

import errno
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from zero_jax.checkpoint.store import CONCURRENT_GB as _CONCURRENT_GB
from zero_jax.checkpoint.writer import abs_path
from zero_jax.step.state import TrainState, is_padded_storage, padded_host_copies


def _export_registry():
  """Orbax's standard handlers, minus the file that pins arrays to the saving devices."""
  th = ocp.type_handlers
  return th.create_type_handler_registry(
      (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
      (np.ndarray, th.NumpyHandler()),
      (jax.Array, th.ArrayHandler(enable_write_sharding_file=False)))


_WRITABLE = (jax.Array, np.ndarray, np.number, int, float)


def _check_writable(where: str, x) -> None:
  """Refuses a leaf that holds no values Orbax can write, naming it (``where``)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    raise TypeError(
        f"{where} is a jax.ShapeDtypeStruct {tuple(x.shape)} {x.dtype}: a shape without "
        f"values, and export_params writes values. Pass arrays, e.g. step.get_params(state) "
        f"or a restored state's parameters (an abstract tree such as step.abstract_state's "
        f"or jax.eval_shape's output is what restore and load_safetensors take as a target).")
  if not isinstance(x, _WRITABLE):
    raise TypeError(f"{where} is a {type(x).__name__}, not an array or a number: "
                    f"export_params writes arrays (jax or NumPy) and numbers. Convert it, or "
                    f"leave it out of the exported tree.")


def _check_export(path: epath.Path, params, force: bool) -> None:
  """Refuses a `TrainState`, a stage-3 state's padded storage (``state.params``, or its host
  copy from ``jax.device_get``), an existing ``path`` (unless ``force``) and leaves Orbax
  cannot write."""
  if isinstance(params, TrainState):
    raise TypeError("export_params takes the parameters, not a TrainState: pass "
                    "step.get_params(state), or write safetensors from the shards with "
                    "zj.export_safetensors(step, state, directory).")
  if path.exists() and not force:
    kind = "directory" if path.is_dir() else "file"
    raise FileExistsError(errno.EEXIST, f"export_params writes a new directory, and {path} "
                                        f"exists (a {kind}). Export into a new path, or pass "
                                        f"force=True to replace it.")
  copies = padded_host_copies()
  for keypath, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    where, layout = f"params{jax.tree_util.keystr(keypath)}", is_padded_storage(x)
    copy = layout is None and isinstance(x, np.ndarray) and id(x) in copies
    if copy:
      layout = copies[id(x)]
    if layout is not None:
      what = ("a host copy (jax.device_get(state.params)) of a stage-3 state's padded, split "
              "storage" if copy else "a stage-3 state's padded, split storage (state.params)")
      raise ValueError(
          f"{where} has shape {tuple(x.shape)}: it is {what}, not the parameter of shape "
          f"{tuple(layout.shape)}; exported as it is it would be silently wrong. Pass "
          f"step.get_params(state), or write safetensors from the shards with "
          f"zj.export_safetensors(step, state, directory).")
    _check_writable(where, x)
    if not np.prod(np.shape(x)):
      raise ValueError(f"{where} has shape {np.shape(x)}, no elements, and an Orbax "
                       f"checkpoint holds no zero-size array. Leave it out of the exported "
                       f"tree (it has no values to keep).")


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

  Raises:
    TypeError: ``params`` is a `TrainState`, or a leaf is not an array or a number
      (a ``jax.ShapeDtypeStruct``: a shape without values).
    FileExistsError: ``directory`` exists and ``force`` is False.
    ValueError: a leaf is a stage-3 state's padded storage (``state.params``'s own
      arrays, or the host copies ``jax.device_get(state.params)`` returns for them while
      the state lives; a copy made otherwise is not recognised), or has no elements.
  """
  path = epath.Path(abs_path(directory))
  _check_export(path, params, force)
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_export_registry(),
                                        save_concurrent_gb=_CONCURRENT_GB)
  with ocp.Checkpointer(handler) as ckptr:
    ckptr.save(path, args=ocp.args.PyTreeSave(params), force=force)
