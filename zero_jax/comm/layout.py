"""How each leaf is split across the data axes (and kept split over model axes).

A leaf is split along the one dimension that needs the least padding (padded at its end to a
multiple of the device count); scalars and leaves without elements are replicated; leaves split
over model axes keep their model blocks whole. The logical view is the original shape, the
storage view the padded one; converting is a local slice or pad. Details: the docs'
"How it works"."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def _entry(names: tuple) -> str | tuple | None:
  """One PartitionSpec entry for a tuple of axis names."""
  if not names:
    return None
  return names[0] if len(names) == 1 else tuple(names)


class Layout(NamedTuple):
  """Placement of one leaf on the mesh (static, hashable).

  Attributes:
    shape: the logical shape.
    dim: the dimension split over the data axes, or ``None`` when the leaf is
      replicated over them.
    padded: size of ``dim`` in storage (a multiple of the data axes' size).
    model: per dimension, the model axes it is split over (``()`` when the
      leaf is not model-parallel).
    model_size: per dimension, the product of those axes' sizes.
  """
  shape: tuple[int, ...]
  dim: int | None
  padded: int
  model: tuple[tuple[str, ...], ...] = ()
  model_size: tuple[int, ...] = ()

  @property
  def storage_shape(self) -> tuple[int, ...]:
    if self.dim is None:
      return self.shape
    s = list(self.shape)
    s[self.dim] = self.padded
    return tuple(s)

  @property
  def pad_amount(self) -> int:
    return 0 if self.dim is None else self.padded - self.shape[self.dim]

  @property
  def has_model(self) -> bool:
    return any(self.model)

  def spec(self, data_axes) -> P:
    """PartitionSpec of the storage view: model axes, then the data axes on ``dim``.

    One entry per dimension (``P(None, 'data')``, not ``P(None, 'data')`` trimmed), the
    form JAX gives back, so that a state keeps one sharding through every step.
    """
    data_axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    entries = []
    for d in range(len(self.shape)):
      names = tuple(self.model[d]) if self.model else ()
      if d == self.dim:
        names += data_axes
      entries.append(_entry(names))
    return P(*entries)

  def data_spec(self, data_axes) -> P:
    """The storage spec without the model axes (what a ``shard_map`` over the
    data and replica axes names: the model axes stay automatic)."""
    return Layout(self.shape, self.dim, self.padded).spec(data_axes)

  def model_spec(self) -> P:
    """PartitionSpec over the model axes only (how the logical leaf is split)."""
    if not self.model:
      return P(*[None] * len(self.shape))
    return P(*[_entry(tuple(m)) for m in self.model])


def leaf_layout(shape, n: int, *, stacked: bool = False, model=None,
                model_size=None) -> Layout:
  """Chooses the data-split dimension of a leaf of ``shape`` over ``n`` devices.

  The dimension with the smallest padded total size wins; among equals, the
  largest dimension, then the first. A ``stacked`` leaf (a stack of per-layer
  weights along its first dimension, see `zero_jax.gather`) is never split
  along that first dimension, so each layer's slice is itself split over all
  ``n`` devices; among equals it prefers its layer's first dimension (each
  device's block of a layer is then contiguous rows, which `zero_jax.scan`
  moves in a collective of its own with no copy); a stacked leaf with one
  dimension is replicated. A dimension split over model axes is a candidate
  only when it divides evenly by its model size times ``n``.

  >>> leaf_layout((9, 7), 8)
  Layout(shape=(9, 7), dim=1, padded=8, model=(), model_size=())
  >>> leaf_layout((16, 9, 7), 8, stacked=True).dim
  2
  >>> leaf_layout((12, 768, 2304), 8, stacked=True).dim   # a layer's rows
  1
  >>> leaf_layout((6, 8), 4, model=((), ("model",)), model_size=(1, 2)).spec("data")
  P(None, ('model', 'data'))

  Args:
    shape: the leaf's logical shape.
    n: the number of devices of the data axes.
    stacked: the leaf is a stack of layers along its first dimension.
    model: per dimension, the model axes it is split over, or None.
    model_size: per dimension, the product of those axes' sizes.

  Returns:
    The `Layout`.
  """
  shape = tuple(int(d) for d in shape)
  if model is not None and any(model):
    model = tuple(tuple(m) for m in model)
    model_size = tuple(int(s) for s in model_size)
  else:
    model, model_size = (), ()
  first = 1 if stacked else 0
  total = math.prod(shape)
  if total == 0:  # no elements: nothing to split (a zero-size dimension divides nothing)
    return Layout(shape, None, 0, model, model_size)
  best = None
  for d in range(first, len(shape)):
    size, m = shape[d], (model_size[d] if model else 1)
    if m > 1 and size % (m * n):
      continue  # padding would sit inside model blocks
    padded = -(-size // n) * n
    key = (total // max(size, 1) * padded, not (stacked and d == first), -size, d)
    if best is None or key < best[0]:
      best = (key, d, padded)
  if best is None:
    return Layout(shape, None, 0, model, model_size)
  return Layout(shape, best[1], best[2], model, model_size)


def pad(x: jax.Array, layout: Layout) -> jax.Array:
  """Logical view -> storage view (zero padding at the end of ``dim``).

  Works on the whole leaf and on a device's model block alike: the padded
  dimension is never split over model axes.
  """
  if layout.pad_amount == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[layout.dim] = (0, layout.pad_amount)
  return jnp.pad(x, widths)


def unpad(x: jax.Array, layout: Layout) -> jax.Array:
  """Storage view -> logical view."""
  if layout.pad_amount == 0:
    return x
  return jax.lax.slice_in_dim(x, 0, layout.shape[layout.dim], axis=layout.dim)


def local_storage_shape(layout: Layout, n: int) -> tuple[int, ...]:
  """Shape of one device's block of the storage view (data and model splits)."""
  s = list(layout.storage_shape)
  for d, m in enumerate(layout.model_size):
    s[d] //= m
  if layout.dim is not None:
    s[layout.dim] //= n
  return tuple(s)


def model_block_shape(layout: Layout) -> tuple[int, ...]:
  """Shape of one device's model block of the logical leaf (before the data split)."""
  return tuple(s // m for s, m in zip(layout.shape, layout.model_size)) if layout.model \
      else layout.shape
