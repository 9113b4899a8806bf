"""How each leaf is split across the data axis.

A leaf with at least one dimension is split along one dimension, chosen to
minimise padding: the dimension is padded at its end to a multiple of the axis
size ``n`` and each device holds one contiguous block of ``padded // n``
entries. Zero-dimensional leaves (step counters, scalar parameters and their
state) are replicated: they cannot be split and cost one element each.

The *logical* view of a leaf is its original shape; the *storage* view is the
padded one that lives sharded on the mesh between steps. Converting between
them is a slice or a pad along the split dimension, which XLA performs on each
device's block without communication, because XLA's own layout of an unevenly
sharded dimension is the same ``ceil(size / n)`` blocks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


class Layout(NamedTuple):
  """Placement of one leaf on the data axis (static, hashable).

  Attributes:
    shape: the logical shape.
    dim: the split dimension, or ``None`` for a replicated leaf.
    padded: size of ``dim`` in storage (a multiple of the axis size).
  """
  shape: tuple[int, ...]
  dim: int | None
  padded: int

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

  def spec(self, axis_name: str) -> P:
    """PartitionSpec of the storage view."""
    if self.dim is None:
      return P()
    return P(*([None] * self.dim + [axis_name]))


def leaf_layout(shape, n: int, *, stacked: bool = False) -> Layout:
  """Chooses the split dimension of a leaf of ``shape`` over ``n`` devices.

  The dimension with the smallest padded total size wins; among equals, the
  largest dimension, then the first. A ``stacked`` leaf (a stack of per-layer
  weights along its first dimension, see `zero_jax.gather`) is never split
  along that first dimension, so each layer's slice is itself split over all
  ``n`` devices; a stacked leaf with one dimension is replicated.

  >>> leaf_layout((9, 7), 8)
  Layout(shape=(9, 7), dim=1, padded=8)
  >>> leaf_layout((16, 9, 7), 8, stacked=True)
  Layout(shape=(16, 9, 7), dim=2, padded=8)
  """
  shape = tuple(int(d) for d in shape)
  first = 1 if stacked else 0
  if len(shape) <= first:
    return Layout(shape, None, 0)
  total = math.prod(shape)
  best = None
  for d in range(first, len(shape)):
    size = shape[d]
    padded = -(-size // n) * n
    key = (total // max(size, 1) * padded, -size, d)
    if best is None or key < best[0]:
      best = (key, d, padded)
  return Layout(shape, best[1], best[2])


def pad(x: jax.Array, layout: Layout) -> jax.Array:
  """Logical view -> storage view (zero padding at the end of ``dim``)."""
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
  """Shape of one device's block of the storage view."""
  if layout.dim is None:
    return layout.shape
  s = list(layout.shape)
  s[layout.dim] = layout.padded // n
  return tuple(s)
