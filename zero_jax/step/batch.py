"""The global batch: checked once per structure, placed on the batch axes.

Every leaf of a batch is an array whose leading dimension is the global batch
size, the same for all leaves and divisible by the devices of the batch axes
times ``grad_accum_steps``. A batch that arrives as global ``jax.Array``s
already split that way on the step's mesh (``zj.make_global_batch``, or the
user's own ``device_put``) is used as it is, without a copy; host arrays are
placed with ``jax.device_put``. The checks run on the first batch of each
structure and shape, so a training loop pays for them once.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax.step.spec import StepSpec


def _is_number_list(x) -> bool:
  return isinstance(x, (list, tuple)) and bool(x) and all(
      isinstance(v, numbers.Number) for v in x)


def check_batch(spec: StepSpec, batch, *, name: str = "batch", micro: bool = True) -> None:
  """Raises an error naming the leaf for a batch the step cannot split correctly.

  ``name``: what the message calls the tree (``step.apply``'s split ``args``); ``micro``:
  whether the rows are also split into ``grad_accum_steps`` micro-batches."""
  lists = jax.tree_util.tree_flatten_with_path(batch, is_leaf=_is_number_list)[0]
  for path, x in lists:
    if _is_number_list(x):
      raise TypeError(f"{name}{jax.tree_util.keystr(path)} is a Python {type(x).__name__} of "
                      f"numbers, which JAX reads as {len(x)} separate scalar leaves; pass an "
                      f"array (np.asarray(...)) whose first dimension is the global batch.")
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    raise ValueError(f"the {name} has no arrays; pass a pytree of arrays whose first dimension "
                     "is the global batch size.")
  k = spec.grad_accum_steps if micro else 1
  div = spec.n_batch * k
  need = (f"{spec.n_batch} devices on the batch axes {spec.batch_axes}" +
          (f" x grad_accum_steps={k}" if k > 1 else ""))
  rows = {}
  for path, x in leaves:
    where = f"{name}{jax.tree_util.keystr(path)}"
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{where} is a {type(x).__name__}, not an array; every batch leaf must "
                      f"be an array whose first dimension is the global batch size.")
    shape = tuple(np.shape(x))
    if not shape:
      raise ValueError(f"{where} is a scalar (shape ()); every batch leaf's leading dimension "
                       f"is the global batch size. Pass per-example values (one row per "
                       f"example), or close over a constant in loss_fn.")
    rows[where] = shape
  sizes = sorted({s[0] for s in rows.values()})
  if len(sizes) > 1:
    raise ValueError(f"the {name}'s leaves have different leading sizes ({_by_size(rows)}); "
                     f"the leading dimension of every leaf is the global batch size, so they "
                     f"must all be equal. Split or repeat the leaves so each has one row per "
                     f"example." + _rows_as_list(batch))
  where, shape = next(iter(rows.items()))
  if shape[0] == 0:
    raise ValueError(f"{where} has no rows (shape {shape}): an empty batch has no loss to "
                     f"average. Skip the call for an empty batch.")
  if shape[0] % div:
    raise ValueError(f"{where} has leading dimension {shape[0]} (shape {shape}), "
                     f"but every batch leaf's leading dimension is the global batch size and "
                     f"must be divisible by {div} ({need}); use a global batch size that is "
                     f"a multiple of {div}, or drop the last incomplete batch." +
                     _rows_as_list(batch))


def _by_size(rows: dict) -> str:
  """``"batch['x'][0], batch['x'][1] and 6 more have 3; batch['y'] has 8"``."""
  groups: dict = {}
  for name, shape in rows.items():
    groups.setdefault(shape[0], []).append(name)
  def one(size, names):
    shown = ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
    return f"{shown} {'have' if len(names) > 1 else 'has'} {size}"
  return "; ".join(one(size, names) for size, names in groups.items())


def _rows_as_list(batch) -> str:
  """A hint for a Python list or tuple of equal arrays, which JAX reads as separate leaves."""
  for path, node in jax.tree_util.tree_flatten_with_path(
      batch, is_leaf=lambda x: isinstance(x, (list, tuple)))[0]:
    if isinstance(node, (list, tuple)) and len(node) > 1 and all(
        hasattr(x, "shape") for x in node) and len({np.shape(x) for x in node}) == 1:
      name = f"batch{jax.tree_util.keystr(path)}"
      return (f" {name} is a Python {type(node).__name__} of {len(node)} arrays of shape "
              f"{np.shape(node[0])}, which JAX reads as {len(node)} separate leaves, not as "
              f"rows: if they are examples, stack them (np.stack({name})).")
  return ""


def batch_sharding(spec: StepSpec, x) -> NamedSharding:
  """Where a batch leaf goes: rows over the batch axes; a model split of the
  other dimensions that the leaf already has on the step's mesh is kept."""
  rest = ()
  sh = getattr(x, "sharding", None)
  if isinstance(sh, NamedSharding) and sh.mesh.devices.shape == spec.mesh.devices.shape and \
      tuple(sh.mesh.axis_names) == tuple(spec.mesh.axis_names):
    keep = lambda e: e if e is None or all(
        a in spec.model_axes for a in ((e,) if isinstance(e, str) else e)) else None
    rest = tuple(keep(e) for e in tuple(sh.spec)[1:])
  return NamedSharding(spec.working_mesh(), P(spec.batch_axes, *rest))


def place_batch(spec: StepSpec, batch):
  """The batch as global arrays split over the batch axes (no copy when already so)."""
  def place(x):
    target = batch_sharding(spec, x)
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract batch, for lower()
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and \
        x.sharding == target:
      return x
    return jax.device_put(x, target)
  return jax.tree.map(place, batch)
