"""Which part of a leaf each device writes, in which pieces, at which bytes (pure functions).

A box is a tuple of ``(start, stop)`` per dimension. A device's block of a leaf is the box
its shard covers, its padding dropped; a block held by several devices (replicated over
the data axes, or the replicas of a hybrid mesh) is divided among them along the file's
first dimension, so that every element is written once and the writing is spread over the
devices and processes that hold it. A box is written in chunks of bounded size, each a
box itself; a chunk lies in the row-major file as equal runs of contiguous bytes.
"""

from __future__ import annotations

import math
from typing import Any

Box = tuple[tuple[int, int], ...]


def shard_box(index, storage_shape, logical_shape) -> Box | None:
  """A shard's index (slices into the storage view) as a box of the logical leaf: its
  padding dropped; None when the shard holds padding only."""
  box = []
  for s, n, size in zip(index, storage_shape, logical_shape):
    start, stop, _ = s.indices(n)
    stop = min(stop, size)
    if stop <= start:
      return None
    box.append((start, stop))
  return tuple(box)


def layer_box(box: Box | None, layer: int) -> Box | None:
  """The part of ``box`` (of a stacked leaf, layers along its first dimension) in layer
  ``layer``, as a box of that layer's dimensions; None when the box does not hold it.

  >>> layer_box(((0, 3), (2, 4)), 1), layer_box(((0, 3), (2, 4)), 5)
  (((2, 4),), None)
  """
  if box is None or not box[0][0] <= layer < box[0][1]:
    return None
  return box[1:]


def transpose_box(box: Box, transpose: bool) -> Box:
  return tuple(reversed(box)) if transpose else box


def assign(boxes: dict[Any, Box | None], split_dim: int) -> dict[Any, Box]:
  """``{device: its box}`` -> ``{device: the part of it that device writes}``.

  Devices holding the same box (sorted by ``.id``) divide it along ``split_dim`` as
  evenly as possible; a device whose part is empty is left out (so is one holding no
  box). The parts cover every box once.
  """
  groups: dict[Box, list] = {}
  for d, box in boxes.items():
    if box is not None:
      groups.setdefault(box, []).append(d)
  out = {}
  for box, devices in groups.items():
    devices.sort(key=lambda d: d.id)
    if not box:  # a scalar: the first holder writes it
      out[devices[0]] = box
      continue
    start, stop = box[split_dim]
    k = len(devices)
    for j, d in enumerate(devices):
      a, b = start + (stop - start) * j // k, start + (stop - start) * (j + 1) // k
      if b > a:
        out[d] = box[:split_dim] + ((a, b),) + box[split_dim + 1:]
  return out


def chunks(box: Box, max_elems: int, order: tuple[int, ...]) -> list[Box]:
  """``box`` cut into boxes of at most ``max_elems`` elements (or one element row).

  ``order`` lists the dimensions from the outermost in the file: cuts fall along the
  first of them, then (when one slice along it is still too big) along the next.
  """
  if not order:
    return [box]
  d, rest = order[0], order[1:]
  row = math.prod(box[r][1] - box[r][0] for r in rest)
  start, stop = box[d]
  if row <= max_elems or not rest:
    step = max(1, max_elems // max(row, 1))
    return [box[:d] + ((a, min(a + step, stop)),) + box[d + 1:]
            for a in range(start, stop, step)]
  out = []
  for a in range(start, stop):
    out += chunks(box[:d] + ((a, a + 1),) + box[d + 1:], max_elems, rest)
  return out


def runs(shape: tuple[int, ...], box: Box) -> tuple[list[int], int]:
  """Where a box of a row-major array of ``shape`` lies: ``(element offset of each run,
  elements per run)``; the box's elements in row-major order are those runs in order."""
  if not shape:
    return [0], 1
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  k = len(shape) - 1  # the outermost dimension from which on the box is contiguous
  while k > 0 and box[k] == (0, shape[k]):
    k -= 1
  length = (box[k][1] - box[k][0]) * strides[k]
  offsets = [box[k][0] * strides[k]]
  for d in range(k - 1, -1, -1):
    offsets = [i * strides[d] + o for i in range(*box[d]) for o in offsets]
  return offsets, length
