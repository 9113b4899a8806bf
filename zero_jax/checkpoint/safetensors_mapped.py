"""The files of one load, each opened, its header parsed and its bytes mapped once.

`load_safetensors` reads many blocks (a block per device of a tensor per leaf) from few
files. `open_files` maps each file once for the whole load and parses its header from that
mapping (`safetensors_format.parse_header`); the index's ``weight_map``, when there is one,
is checked against the headers. A block is then one copy out of the page cache
(`MappedFiles.read`), after which the block's pages are handed back to the kernel
(``madvise(MADV_DONTNEED)``): the resident set holds the blocks read, never the files.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
from typing import Iterator

import numpy as np

from zero_jax.checkpoint import blocks
from zero_jax.checkpoint import safetensors_format as fmt


def _map(path: str) -> tuple[mmap.mmap, dict[str, fmt.Entry]]:
  """``(the file mapped read-only, its tensors)``, its header read and checked first."""
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) == 8:
      head += f.read(min(struct.unpack("<Q", head)[0], fmt.MAX_HEADER))
    entries = fmt.parse_header(path, head, size)
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), entries


def _release(mm: mmap.mmap, begin: int, end: int) -> None:
  """Drops the pages holding bytes ``[begin, end)`` from the resident set (they stay in the
  page cache; touching them again maps them back)."""
  start = begin - begin % mmap.PAGESIZE
  if end > start and hasattr(mmap, "MADV_DONTNEED"):
    mm.madvise(mmap.MADV_DONTNEED, start, min(end, len(mm)) - start)


def _close(mm: mmap.mmap) -> None:
  try:
    mm.close()
  except BufferError:  # a view is still alive (an error while copying): closed when it goes
    pass


def span(shape: tuple[int, ...], box: blocks.Box) -> tuple[int, int]:
  """The elements ``[first, stop)`` of a row-major array of ``shape`` that hold ``box``
  (a non-empty box): its first element and one past its last.

  Example:
    >>> span((4, 6), ((1, 3), (2, 4)))   # rows 1-2, columns 2-3: elements 8 to 15
    (8, 16)
  """
  strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
  first = sum(a * s for (a, _), s in zip(box, strides))
  last = sum((b - 1) * s for (_, b), s in zip(box, strides))
  return first, last + 1


class MappedFiles:
  """The mapped files of one load and their tensors (`open_files` makes it).

  Attributes:
    entries: ``{tensor name: fmt.Entry}`` over every file.
  """

  def __init__(self, maps: dict[str, mmap.mmap], entries: dict[str, fmt.Entry]):
    self._maps = maps
    self.entries = entries

  def read(self, name: str, box: blocks.Box, transpose: bool, dtype) -> np.ndarray:
    """A copy of the block ``box`` of the leaf read from tensor ``name`` (the file holds
    the leaf transposed when ``transpose``), converted to ``dtype``; the pages the block
    lies in are dropped from the resident set once it is copied."""
    e = self.entries[name]
    fbox = blocks.transpose_box(box, transpose)
    mm = self._maps[e.file]
    view = np.ndarray(e.shape, e.dtype, buffer=mm, offset=e.begin)
    part = view[tuple(slice(a, b) for a, b in fbox)]
    out = np.array(part.T if transpose else part, dtype=dtype, order="C")  # the one copy
    del view, part  # no view may outlive the mapping
    first, stop = span(e.shape, fbox)
    _release(mm, e.begin + first * e.dtype.itemsize, e.begin + stop * e.dtype.itemsize)
    return out


@contextlib.contextmanager
def open_files(path) -> Iterator[MappedFiles]:
  """The safetensors files of ``path`` (`safetensors_format.find_files`), each mapped and
  its header parsed once, unmapped when the block ends.

  Raises:
    ValueError: a file is truncated or its header points past its end, a tensor is in two
      files, or the index's ``weight_map`` disagrees with the headers.
  """
  found = fmt.find_files(path)
  with contextlib.ExitStack() as stack:
    maps, held, entries = {}, {}, {}
    for f in found.files:
      maps[f], held[f] = _map(f)
      stack.callback(_close, maps[f])
      for name, e in held[f].items():
        if name in entries:
          raise ValueError(f"tensor {name!r} is in both {entries[name].file} and {f}.")
        entries[name] = e
    if found.weight_map is not None:
      fmt.check_index(found.index, found.weight_map, held)
    yield MappedFiles(maps, entries)
