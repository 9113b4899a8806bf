"""The global batch of a multi-process job, assembled from each process's rows.

With ``jax.distributed`` each process loads only its rows of the global batch:
`process_batch_slice` says which, and `make_global_batch` turns every
process's rows into one global ``jax.Array`` per leaf, split over the step's
batch axes (``jax.make_array_from_process_local_data``); no data moves between
processes. Both take the step (or a mesh and the axes the batch is split
over: one name, or a tuple for hybrid meshes such as ``("replica", "data")``).

A process that feeds another number of rows than its peers would make each
process compile a step for a different global batch: `make_global_batch`
compares the row counts across processes on every call (one small
all-gather) and raises, naming the processes and their rows.

Example (each process runs this):
  rows = zj.process_batch_slice(global_batch_size, step)   # e.g. slice(0, 32)
  for global_np_batch in loader:
    local = jax.tree.map(lambda x: x[rows], global_np_batch)
    state, metrics = step(state, zj.make_global_batch(local, step))
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def _mesh_and_axes(mesh, axis_name) -> tuple[Mesh, tuple[str, ...]]:
  """``(mesh, batch axes)`` from a mesh and axis name(s), or from a step."""
  spec = getattr(mesh, "spec", None)
  if spec is not None and hasattr(spec, "batch_axes"):  # a ShardedTrainStep
    return spec.mesh, spec.batch_axes
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(("
                    f"jax.device_count(),), ('data',))) or the step; got "
                    f"{type(mesh).__name__}.")
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(f"axis_name={axis_name!r}: {a!r} is not an axis of the mesh, whose axes "
                       f"are {tuple(mesh.axis_names)}; pass the axes the step splits the batch "
                       f"over (its axis_name and replica_axis), or pass the step itself.")
  return mesh, tuple(a for a in mesh.axis_names if a in axes)


def _sharding(mesh, axes) -> NamedSharding:
  return NamedSharding(mesh, P(axes))


def _local_rows(sharding: NamedSharding, global_rows: int) -> list[tuple[int, int]]:
  """Sorted, merged [start, stop) row ranges this process's devices hold."""
  spans = set()
  for index in sharding.addressable_devices_indices_map((global_rows,)).values():
    s = index[0]
    spans.add((s.start or 0, global_rows if s.stop is None else s.stop))
  merged = []
  for start, stop in sorted(spans):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(stop, merged[-1][1]))
    else:
      merged.append((start, stop))
  return merged


def process_batch_slice(global_batch_size: int, mesh, *, axis_name="data") -> slice:
  """The rows of the global batch that this process loads.

  ``make_global_batch`` expects each process to pass exactly these rows of
  the global batch, in order. For ``jax.make_mesh`` meshes, process ``i`` of
  ``p`` gets the ``i``-th of ``p`` equal blocks.

  Example:
    rows = zj.process_batch_slice(64, step)    # 2 processes: slice(0, 32) or slice(32, 64)
    local = {"x": x_global[rows], "y": y_global[rows]}

  Args:
    global_batch_size: the leading dimension of the global batch; a multiple
      of the number of devices along the batch axes.
    mesh: the step, or the step's mesh (then give ``axis_name``).
    axis_name: with a mesh: the axis (or tuple of axes) the batch is split over.

  Returns:
    A ``slice`` into the global batch's leading dimension.
  """
  mesh, axes = _mesh_and_axes(mesh, axis_name)
  n = math.prod(mesh.shape[a] for a in axes)
  if global_batch_size % n:
    raise ValueError(f"global_batch_size={global_batch_size} must be divisible by the "
                     f"{n} devices on the batch axes {axes}.")
  spans = _local_rows(_sharding(mesh, axes), global_batch_size)
  if len(spans) != 1:
    raise ValueError(f"process {jax.process_index()} holds the non-contiguous rows {spans} of "
                     f"the global batch on this mesh; order the mesh's devices by process "
                     f"(jax.make_mesh does) or build the global batch with "
                     f"jax.make_array_from_callback.")
  return slice(*spans[0])


def _check_rows_agree(rows_per_shard: int) -> None:
  """Raises on every process if the processes feed different numbers of rows per shard."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  every = np.asarray(multihost_utils.process_allgather(np.int64(rows_per_shard))).reshape(-1)
  if len(set(every.tolist())) > 1:
    listing = ", ".join(f"process {i}: {int(r)}" for i, r in enumerate(every))
    raise ValueError(f"the processes feed different numbers of rows per device ({listing}); "
                     f"every process must pass its rows of the same global batch, "
                     f"process_batch_slice(global_batch_size, step) rows each. A process that "
                     f"ran out of data must stop with the others (or skip the same step).")


def make_global_batch(local_batch, mesh, *, axis_name="data"):
  """Assembles each process's rows into the global batch the step expects.

  Every process calls it with its own rows (see `process_batch_slice`): the
  leaves' leading dimension is the per-process batch, the result's is the
  global batch (the sum over processes), split over the batch axes. No data
  moves between processes. With one process it just places the batch.

  Example:
    rows = zj.process_batch_slice(64, step)
    batch = zj.make_global_batch({"x": x[rows], "y": y[rows]}, step)
    state, metrics = step(state, batch)

  Args:
    local_batch: a pytree of host arrays (numpy), this process's rows.
    mesh: the step, or the step's mesh (then give ``axis_name``).
    axis_name: with a mesh: the axis (or tuple of axes) the batch is split over.

  Returns:
    The same pytree of global ``jax.Array``s, split over the batch axes.
  """
  mesh, axes = _mesh_and_axes(mesh, axis_name)
  sharding = _sharding(mesh, axes)
  n = math.prod(mesh.shape[a] for a in axes)
  probe = _local_rows(sharding, n)  # with one row per shard: this process's shard count
  local_shards = sum(stop - start for start, stop in probe)
  leaves = jax.tree_util.tree_flatten_with_path(local_batch)[0]
  for path, x in leaves:
    shape = np.shape(x)
    if len(shape) == 0 or shape[0] % local_shards:
      what = "a scalar" if not shape else f"leading dimension {shape[0]}"
      raise ValueError(f"local_batch{jax.tree_util.keystr(path)} has {what} (shape {shape}), "
                       f"but this process feeds {local_shards} of the {n} shards of the batch "
                       f"axes {axes}, so each leaf's leading dimension (this process's rows "
                       f"of the global batch) must be a multiple of {local_shards}; use a "
                       f"global batch size that is a multiple of {n} and pass the rows "
                       f"process_batch_slice(global_batch_size, step) gives.")
  if leaves:
    _check_rows_agree(np.shape(leaves[0][1])[0] // local_shards)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                      local_batch)
