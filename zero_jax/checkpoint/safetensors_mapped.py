"""The files of one load, each opened, its header parsed and its bytes mapped once.

`load_safetensors` reads many blocks (a block per device of a tensor per leaf) from few
files. `open_files` opens each file once for the whole load, parses its header
(`safetensors_format.parse_header`) and maps it; the index's ``weight_map``, when there is
one, is checked against the headers. A block is then one copy out of the page cache
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

ALIGN = 64  # bytes: a cache line, and the alignment jax's CPU client takes without a copy
CHUNK_BYTES = 2 << 20  # of a tensor mapped at a time
# A fault maps the pages around the one touched too (Linux's fault-around, and a whole
# large folio of the page cache, up to 2 MiB): the pages of a small tensor's neighbours,
# already dropped, come back with it. A release takes them as well.
AROUND = 2 << 20


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
  """Drops the pages holding bytes ``[begin, end)`` from the resident set, and those within
  `AROUND` bytes of them (they stay in the page cache; touching them maps them back)."""
  start = max(0, begin - AROUND)
  start -= start % mmap.PAGESIZE
  end = min(end + AROUND, len(mm))
  if end > start and hasattr(mmap, "MADV_DONTNEED"):
    mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def _close(mm: mmap.mmap) -> None:
  try:
    mm.close()
  except BufferError:  # a view is alive (in an error's traceback): unmapped when it goes
    pass


class MappedFiles:
  """The mapped files of one load and their tensors (`open_files` makes it).

  Attributes:
    entries: ``{tensor name: fmt.Entry}`` over every file.
  """

  def __init__(self, maps: dict[str, mmap.mmap], entries: dict[str, fmt.Entry]):
    self._maps = maps
    self.entries = entries

  def read(self, name: str, boxes: list[blocks.Box], transpose: bool,
           dtype) -> list[np.ndarray]:
    """The blocks ``boxes`` (non-empty) of the leaf read from tensor ``name`` (the file
    holds the leaf transposed when ``transpose``), converted to ``dtype``.

    The tensor is gone through once, a chunk of `CHUNK_BYTES` along its first dimension at
    a time: each chunk's part of every block is copied, then the chunk's pages are dropped
    from the resident set. A block may lie across the file's rows (a transposed leaf split
    along its rows): no page is then mapped twice.
    """
    e = self.entries[name]
    mm = self._maps[e.file]
    outs = _blocks([tuple(b - a for a, b in box) for box in boxes], dtype)
    view = np.frombuffer(mm, e.dtype, math.prod(e.shape), e.begin).reshape(e.shape)
    if not e.shape:  # a scalar
      for out in outs:
        out[...] = view
      del view
      return outs
    fboxes = [blocks.transpose_box(box, transpose) for box in boxes]
    row = math.prod(e.shape[1:]) * e.dtype.itemsize
    step = max(1, CHUNK_BYTES // max(row, 1))
    first, last = min(f[0][0] for f in fboxes), max(f[0][1] for f in fboxes)
    for r in range(first, last, step):
      stop = min(r + step, last)
      for out, f in zip(outs, fboxes):
        a, b = max(r, f[0][0]) - f[0][0], min(stop, f[0][1]) - f[0][0]
        if a < b:
          rows = (slice(f[0][0] + a, f[0][0] + b),) + tuple(slice(*d) for d in f[1:])
          _copy(out[:, a:b] if transpose else out[a:b], view[rows], transpose)
      _release(mm, e.begin + r * row, e.begin + stop * row)
    del view  # no view may outlive the mapping
    return outs


def _blocks(shapes: list[tuple[int, ...]], dtype) -> list[np.ndarray]:
  """Empty arrays of ``shapes`` in one buffer, each starting 16 bytes past a multiple of
  `ALIGN` bytes, on purpose.

  jax's CPU client takes a host array aligned to 64 bytes as the device's buffer itself,
  and XLA never donates a buffer it does not own: ``step.init(loaded, donate=True)``
  would then copy the whole model. An array off that alignment is copied into a buffer
  jax owns (the blocks here are freed right after), which ``step.init`` can take.
  """
  sizes = [math.prod(s) * np.dtype(dtype).itemsize for s in shapes]
  raw = np.empty(sum(-(-n // ALIGN) * ALIGN for n in sizes) + ALIGN, np.uint8)
  start, out = (16 - raw.ctypes.data) % ALIGN, []
  for shape, n in zip(shapes, sizes):
    out.append(raw[start:start + n].view(dtype).reshape(shape))
    start += -(-n // ALIGN) * ALIGN
  return out


def _copy(out: np.ndarray, part: np.ndarray, transpose: bool) -> None:
  """``out[...] = part`` (``part.T`` when ``transpose``), converting the dtype. A transposed
  copy goes a few rows of ``part`` at a time, each row of ``out`` then written a cache line
  at a time (twice as fast as numpy's copy of the whole transposed view)."""
  if not transpose:
    np.copyto(out, part, casting="unsafe")
    return
  rows = max(1, ALIGN // out.dtype.itemsize)
  for r in range(0, part.shape[0], rows):
    np.copyto(out[:, r:r + rows], part[r:r + rows].T, casting="unsafe")


@contextlib.contextmanager
def open_files(path) -> Iterator[MappedFiles]:
  """The safetensors files of ``path`` (`safetensors_format.find_files`), each mapped and
  its header parsed once, unmapped when the block ends.

  Raises:
    ValueError: a file is truncated or its header points past its end, a tensor is in two
      files, or the index's ``weight_map`` disagrees with the headers.

  Example:
    >>> import os, tempfile, numpy as np
    >>> from safetensors.numpy import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, path)
    >>> with open_files(path) as files:   # rows 1-2, columns 0-1
    ...   (block,) = files.read("w", [((1, 3), (0, 2))], False, np.float32)
    >>> block
    array([[4., 5.],
           [8., 9.]], dtype=float32)
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
