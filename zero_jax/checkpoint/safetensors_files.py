"""The files of one load, each opened and its header parsed once, read with positioned reads.

`load_safetensors` reads many blocks (a block per device of a tensor per leaf) from few
files. `find_files` finds them (one file, or the files a ``model.safetensors.index.json``
lists, its shape checked and each shard name held inside the index's folder:
`check_shard_name`); `open_files` opens each file once for the whole load and parses its
header (`safetensors_format.read_header`); the index's ``weight_map``, when there is one, is
checked against the headers (`check_index`). A block is read with positioned reads
(``os.preadv``) into its own buffer: straight into it when it lies in the file as long runs
of bytes in the leaf's dtype (a block of whole rows), else through one bounded buffer a
chunk of the tensor's rows at a time (a transposed or converted leaf, a column block).
Nothing is mapped: a file that shrinks while it is read gives a short read, an error naming
it (a memory map would kill the process with SIGBUS), and the resident set holds the blocks
read, never the files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.checkpoint import blocks
from zero_jax.checkpoint import safetensors_format as fmt
from zero_jax.checkpoint.safetensors_format import INDEX, SINGLE

ALIGN = 64  # bytes: a cache line, and the alignment jax's CPU client takes without a copy
CHUNK_BYTES = 2 << 20  # of a tensor's rows read into the staging buffer at a time
DIRECT_RUN_BYTES = 64 << 10  # runs at least this long are read straight into the block


def _read_into(file, buffer: memoryview, offset: int, path: str, name: str) -> None:
  """Fills ``buffer`` from byte ``offset`` of ``file``; a short read (the file shrank) is
  an error naming the file and the tensor."""
  done = 0
  while done < len(buffer):
    if hasattr(os, "preadv"):
      n = os.preadv(file.fileno(), [buffer[done:]], offset + done)
    else:  # pragma: no cover (Windows)
      file.seek(offset + done)
      n = file.readinto(buffer[done:])
    if not n:
      raise ValueError(
          f"{path} ended at byte {offset + done} while tensor {name!r} was read from it (its "
          f"bytes [{offset}, {offset + len(buffer)}) are past the end): the file was "
          f"truncated or replaced during the load. Load it again once nothing writes it, or "
          f"download or export it again.")
    done += n


class OpenFiles:
  """The open files of one load and their tensors (`open_files` makes it).

  Attributes:
    entries: ``{tensor name: fmt.Entry}`` over every file.
  """

  def __init__(self, files: dict, entries: dict[str, fmt.Entry]):
    self._files = files
    self.entries = entries
    self._staging = np.empty(0, np.uint8)

  def read(self, t: fmt.Tensor, boxes: list[blocks.Box]) -> list[np.ndarray]:
    """The blocks ``boxes`` (non-empty) of the leaf ``t`` reads (the file holds it
    transposed when ``t.transpose``), in ``t.dtype``.

    A block lying in the file as long runs of the leaf's bytes (`DIRECT_RUN_BYTES`, or one
    run) is read straight into its buffer; the others go through the tensor once, a chunk
    of `CHUNK_BYTES` along its first dimension at a time, each chunk read once and its part
    of every such block copied (transposed, converted) from it.

    Raises:
      ValueError: the file ends before the tensor's bytes (it shrank during the load), or
        converting would change an integer or make a finite float infinite or NaN
        (``t.dtype`` cannot hold it).
    """
    outs = _blocks([tuple(b - a for a, b in box) for box in boxes], t.dtype)
    self._fill(t, boxes, outs)
    return outs

  def read_layers(self, ts: list[fmt.Tensor], boxes: list[blocks.Box]) -> list[np.ndarray]:
    """The blocks ``boxes`` (non-empty) of a stacked leaf whose layers the per-layer tensors
    ``ts`` hold (`safetensors_format.layer_tensors`, in order), in their dtype: each block's
    part of each layer it spans read from that layer's tensor, as `read` reads it, straight
    into the block."""
    outs = _blocks([tuple(b - a for a, b in box) for box in boxes], ts[0].dtype)
    for i, t in enumerate(ts):
      mine = [(blocks.layer_box(box, i), out[i - box[0][0], ...])
              for box, out in zip(boxes, outs) if box[0][0] <= i < box[0][1]]
      if mine:
        self._fill(t, [b for b, _ in mine], [o for _, o in mine])
    return outs

  def _fill(self, t: fmt.Tensor, boxes: list[blocks.Box], outs: list[np.ndarray]) -> None:
    """Reads the blocks ``boxes`` of ``t`` into ``outs`` (C-contiguous, of their shapes)."""
    e = self.entries[t.name]
    staged = []
    for out, box in zip(outs, boxes):
      fbox = blocks.transpose_box(box, t.transpose)
      if t.transpose or e.dtype != t.dtype or not self._direct(e, t, out, fbox):
        staged.append((out, fbox))
    if staged:
      self._staged(e, t, staged)

  def _direct(self, e: fmt.Entry, t: fmt.Tensor, out: np.ndarray, fbox) -> bool:
    """Reads ``fbox`` of ``e`` into ``out`` run by run when its runs are long; False when
    they are not (nothing read)."""
    offsets, length = blocks.runs(e.shape, fbox)
    n = length * e.dtype.itemsize
    if len(offsets) > 1 and n < DIRECT_RUN_BYTES:
      return False
    raw = memoryview(out.reshape(-1).view(np.uint8))
    for j, o in enumerate(offsets):
      _read_into(self._files[e.file], raw[j * n:(j + 1) * n], e.begin + o * e.dtype.itemsize,
                 e.file, t.name)
    return True

  def _staged(self, e: fmt.Entry, t: fmt.Tensor, staged: list) -> None:
    """Goes through the rows the blocks of ``staged`` (``(out, box in the file)``) cover, a
    chunk at a time, copying each block's part of each chunk."""
    if not e.shape:  # a scalar
      part = self._chunk(e, t, 0, 1).reshape(())
      for out, _ in staged:
        _copy(out, part, t, e, in_range=_in_range(part, t.dtype))
      return
    row = math.prod(e.shape[1:]) * e.dtype.itemsize
    step = max(1, CHUNK_BYTES // max(row, 1))
    first, last = min(f[0][0] for _, f in staged), max(f[0][1] for _, f in staged)
    for r in range(first, last, step):
      stop = min(r + step, last)
      chunk = self._chunk(e, t, r, stop)
      in_range = _in_range(chunk, t.dtype)  # once per chunk, contiguous: quicker than per part
      for out, f in staged:
        a, b = max(r, f[0][0]) - f[0][0], min(stop, f[0][1]) - f[0][0]
        if a < b:
          rows = (slice(f[0][0] + a - r, f[0][0] + b - r),) + tuple(slice(*d) for d in f[1:])
          _copy(out[:, a:b] if t.transpose else out[a:b], chunk[rows], t, e,
                in_range=in_range)

  def _chunk(self, e: fmt.Entry, t: fmt.Tensor, r: int, stop: int) -> np.ndarray:
    """Rows ``[r, stop)`` of ``e`` (one element for a scalar), read into the staging
    buffer (grown to the largest chunk read, reused)."""
    row = math.prod(e.shape[1:]) * e.dtype.itemsize
    n = (stop - r) * row
    if self._staging.size < n:
      self._staging = np.empty(n, np.uint8)
    raw = self._staging[:n]
    _read_into(self._files[e.file], memoryview(raw), e.begin + r * row, e.file, t.name)
    return raw.view(e.dtype).reshape((stop - r,) + e.shape[1:])


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


def _in_range(part: np.ndarray, dtype: np.dtype) -> bool:
  """Every value of ``part`` converts to ``dtype`` without leaving its range: True for
  any conversion but a floating one into a smaller range, then a quick test of numpy's own
  floats (two passes; False, to be checked value by value, for NaN or other dtypes)."""
  if not fmt.shrinks(part.dtype, dtype):
    return True
  return part.dtype.kind == "f" and bool(
      not part.size or max(part.max(), -part.min()) <= jnp.finfo(dtype).max)


def _copy(out: np.ndarray, part: np.ndarray, t: fmt.Tensor, e: fmt.Entry, *,
          in_range: bool) -> None:
  """``out[...] = part`` (``part.T`` when ``t.transpose``), converting the dtype; an integer
  conversion that would change a value, or a floating one that would make a finite value
  infinite or NaN (unless ``in_range``: `_in_range`), is refused. A transposed copy goes a
  few rows of ``part`` at a time, each row of ``out`` then written a cache line at a time
  (twice as fast as numpy's copy of the whole transposed view)."""
  with np.errstate(over="ignore", invalid="ignore"):  # a value out of range is refused below
    if not t.transpose:
      np.copyto(out, part, casting="unsafe")
    else:
      rows = max(1, ALIGN // out.dtype.itemsize)
      for r in range(0, part.shape[0], rows):
        np.copyto(out[:, r:r + rows], part[r:r + rows].T, casting="unsafe")
  if not in_range:
    _check_range(out, part, t, e)
  if _narrows(part.dtype, out.dtype):
    lo, hi = (0, 1) if out.dtype == np.bool_ else \
        (int(np.iinfo(out.dtype).min), int(np.iinfo(out.dtype).max))
    if part.size and (part.min() < lo or part.max() > hi):  # (a round trip would miss -1
      bad = part[(part < lo) | (part > hi)].flat[0].item()  # into uint8: 255, back: -1)
      x64 = (" and turn on jax.config.update('jax_enable_x64', True) (without it JAX makes "
             "64-bit leaves 32-bit)"
             if np.dtype(jax.dtypes.canonicalize_dtype(part.dtype)) != part.dtype else "")
      raise ValueError(f"tensor {t.name!r} in {e.file} is {part.dtype.name} and holds "
                       f"{bad!r}, which {out.dtype.name} (the leaf {t.leaf} in `like`) "
                       f"cannot hold: cast=True converts integers only when every value fits. "
                       f"Give `like` the file's dtype, {part.dtype.name}, for this leaf{x64}.")


def _check_range(out: np.ndarray, part: np.ndarray, t: fmt.Tensor, e: fmt.Entry) -> None:
  """Raises naming the leaf when converting ``part`` into the floating dtype of ``out``, of a
  smaller range, made a finite value infinite or NaN (float32 1e5 into float16)."""
  back = out.T if t.transpose else out
  nonfinite = _nonfinite(back)
  if not nonfinite.any():
    return
  bad = nonfinite & np.isfinite(part)
  if bad.any():
    value = part[bad].flat[0].item()
    raise ValueError(f"tensor {t.name!r} in {e.file} is {part.dtype.name} and holds {value!r}, "
                     f"past the largest {out.dtype.name} ({float(jnp.finfo(out.dtype).max):g}"
                     f", the dtype of the leaf {t.leaf} in `like`): cast=True would make it "
                     f"{back[bad].flat[0].item()!r}. Give `like` the file's dtype, "
                     f"{part.dtype.name}, for this leaf (or another that holds its values).")


_EXPONENT = {np.dtype(np.float16): 0x7C00, np.dtype(jnp.bfloat16): 0x7F80}


def _nonfinite(a: np.ndarray) -> np.ndarray:
  """``~np.isfinite(a)``; for 16-bit floats from the exponent bits (3x quicker)."""
  bits = _EXPONENT.get(a.dtype)
  if bits is None:
    return ~np.isfinite(a)
  return (a.view(np.uint16) & bits) == bits


def _narrows(src: np.dtype, dst: np.dtype) -> bool:
  """An integer (or bool) conversion that some values do not survive."""
  exact = lambda d: np.issubdtype(d, np.integer) or d == np.bool_
  return exact(src) and exact(dst) and not np.can_cast(src, dst, "safe")


# ------------------------------------------------------- the files and the index
class Found(NamedTuple):
  """The safetensors files of a path (`find_files`).

  Attributes:
    files: their paths.
    index: the ``model.safetensors.index.json`` they come with, or None for one file.
    weight_map: the index's ``{tensor name: path of its file}``, or None for one file.
  """
  files: list[str]
  index: str | None = None
  weight_map: dict[str, str] | None = None


def find_files(path) -> Found:
  """The safetensors files of ``path``: a file, an index, or a directory holding
  ``model.safetensors`` or ``model.safetensors.index.json``. A directory holding both gives
  ``model.safetensors``, as transformers' ``from_pretrained`` takes it, with a warning
  naming both (one of them is almost surely stale)."""
  path = os.fspath(path)
  if os.path.isdir(path):
    single, index = (os.path.join(path, name) for name in (SINGLE, INDEX))
    if os.path.exists(single) and os.path.exists(index):
      warnings.warn(f"{path} holds both {SINGLE} and {INDEX}: reading {SINGLE}, as "
                    f"transformers' from_pretrained does; the index and the files it lists "
                    f"are left unread. Remove whichever is stale.", stacklevel=4)
    for name in (single, index):
      if os.path.exists(name):
        return find_files(name)
    raise FileNotFoundError(f"{path} holds neither {INDEX} nor {SINGLE}; pass the directory "
                            f"of a safetensors export or the path of one .safetensors file.")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} does not exist.")
  if not path.endswith(".json"):
    return Found([path])
  try:
    with open(path, "rb") as f:
      index = json.load(f)
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise ValueError(f"{path} is not a safetensors index: it is not JSON ({e}). Download or "
                     f"export the model again.") from None
  weight_map = _weight_map(path, index)
  base = os.path.dirname(path)
  for f, name in {f: k for k, f in reversed(weight_map.items())}.items():
    check_shard_name(path, name, f)  # once per file, naming its first tensor
  files = sorted(set(weight_map.values()))
  missing = [f for f in files if not os.path.exists(os.path.join(base, f))]
  if missing:
    raise FileNotFoundError(f"{path} lists {missing[:4]}, which are not in {base}: the "
                            f"download or export is incomplete.")
  return Found([os.path.join(base, f) for f in files], path,
               {k: os.path.join(base, v) for k, v in weight_map.items()})


def _json_kind(x) -> str:
  """What JSON calls the value ``x`` was read from (for messages)."""
  for types, kind in ((bool, "true/false"), (dict, "an object"), (list, "an array"),
                      (str, "a string"), ((int, float), "a number"), (type(None), "null")):
    if isinstance(x, types):
      return kind
  return type(x).__name__


def _weight_map(path: str, index) -> dict:
  """The ``weight_map`` of the index read from ``path``, its shape checked: an object
  ``{"metadata": {...}, "weight_map": {tensor name: file name}}``."""
  again = "Download or export the model again."
  if not isinstance(index, dict):
    raise ValueError(f"{path} is not a safetensors index: it holds {_json_kind(index)}, and an "
                     f"index is an object {{\"metadata\": {{...}}, \"weight_map\": {{tensor "
                     f"name: file name}}}}. {again}")
  if "weight_map" not in index:
    raise ValueError(f"{path} has no weight_map; it is not a safetensors index (an object "
                     f"{{\"metadata\": {{...}}, \"weight_map\": {{tensor name: file name}}}}). "
                     f"{again}")
  weight_map, metadata = index["weight_map"], index.get("metadata", {})
  if not isinstance(weight_map, dict):
    raise ValueError(f"{path}: its weight_map is {_json_kind(weight_map)}; it must be a JSON "
                     f"object {{tensor name: file name}}. {again}")
  if not weight_map:
    raise ValueError(f"{path}: its weight_map is empty, it places no tensor in any file. "
                     f"{again}")
  if not isinstance(metadata, dict):
    raise ValueError(f"{path}: its metadata is {_json_kind(metadata)}; it must be a JSON "
                     f"object ({{\"total_size\": bytes}}). {again}")
  for k, v in weight_map.items():
    if not isinstance(v, str) or not v:
      raise ValueError(f"{path} maps {k!r} to {v!r}, {_json_kind(v)}; a weight_map maps each "
                       f"tensor name to the name of its file, a non-empty string. {again}")
  return weight_map


def check_shard_name(index: str, name: str, file: str) -> None:
  """Raises naming the entry when ``file``, where ``index`` places tensor ``name``, is not a
  file inside the index's folder: an absolute path, a path through ``..``, or one whose
  symbolic links resolve outside the folder. Shard names are file names in the folder;
  one exception: a file of a Hugging Face cache snapshot (``.../snapshots/<revision>/``)
  may link into that repository's ``blobs/`` folder, as the cache stores every file."""
  base = os.path.dirname(index) or "."
  parts = file.replace("\\", "/").split("/")
  if os.path.isabs(file) or ".." in parts or file.startswith(("/", "\\")):
    why = "an absolute path" if os.path.isabs(file) or file[:1] in "/\\" else \
        "a path through '..'"
    raise ValueError(f"{index} places tensor {name!r} in {file!r}, {why}: shard names in an "
                     f"index are file names inside its folder {base}, and an index cannot "
                     f"reach outside it. Put the shards beside the index and list them by "
                     f"name.")
  root = os.path.realpath(base)
  target = os.path.realpath(os.path.join(base, file))
  if _inside(target, root) or _cache_blob(root, target):
    return
  raise ValueError(f"{index} places tensor {name!r} in {file!r}, which is a symbolic link (or "
                   f"in a linked folder) resolving to {target}, outside the index's folder "
                   f"{base}: an index cannot reach outside its folder. Copy the file into "
                   f"{base} in place of the link.")


def _inside(path: str, root: str) -> bool:
  return os.path.commonpath([path, root]) == root


def _cache_blob(root: str, target: str) -> bool:
  """``target`` is a file of the ``blobs/`` folder of the Hugging Face cache repository
  whose snapshot is ``root`` (``<repo>/snapshots/<revision>``)."""
  snapshots = os.path.dirname(root)
  if os.path.basename(snapshots) != "snapshots":
    return False
  blobs = os.path.join(os.path.dirname(snapshots), "blobs")
  return os.path.dirname(target) == blobs


def check_index(index: str, weight_map: dict[str, str], held: dict[str, dict]) -> None:
  """Raises naming the tensors when the index's ``weight_map`` ({name: file}) and what the
  files' headers hold (``held``: {file: {name: ...}}) disagree: a tensor the index places
  in one file but found in another or in none, or one a file holds that the index omits."""
  where = {name: f for f, names in held.items() for name in names}
  wrong = []
  for name, f in weight_map.items():
    if name not in held.get(f, ()):
      found = f"it is in {where[name]}" if name in where else \
          "none of the files the index lists holds it"
      wrong.append(f"{name!r} is placed in {f}, but {found}")
  wrong += [f"{name!r} is in {f}, which the index does not list for it"
            for name, f in where.items() if name not in weight_map]
  if wrong:
    raise ValueError(f"{index} does not match the headers of its files: " + "; ".join(wrong[:6])
                     + (f" and {len(wrong) - 6} more" if len(wrong) > 6 else "")
                     + ". Download or export the model again (the index and the files are "
                     "from different copies?).")


@contextlib.contextmanager
def open_files(path, *, max_header_bytes: int = fmt.MAX_HEADER) -> Iterator[OpenFiles]:
  """The safetensors files of ``path`` (`find_files`), each opened and
  its header parsed once, closed when the block ends.

  Raises:
    ValueError: a file is truncated, its header points past its end, its tensors' bytes
      overlap or leave gaps, it names a tensor twice, its header passes
      ``max_header_bytes``, a tensor is in two files, or the index's ``weight_map``
      disagrees with the headers.

  Example:
    >>> import os, tempfile, numpy as np
    >>> from safetensors.numpy import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, path)
    >>> with open_files(path) as files:   # rows 1-2, columns 0-1
    ...   (block,) = files.read(fmt.Tensor("w", (3, 4), np.dtype(np.float32)),
    ...                         [((1, 3), (0, 2))])
    >>> block
    array([[4., 5.],
           [8., 9.]], dtype=float32)
  """
  found = find_files(path)
  with contextlib.ExitStack() as stack:
    files, entries = {}, {}
    for f in found.files:
      files[f] = stack.enter_context(open(f, "rb", buffering=0))
      for name, e in fmt.read_header(files[f], f, max_header_bytes=max_header_bytes).items():
        if name in entries:
          raise ValueError(f"tensor {name!r} is in both {entries[name].file} and {f}.")
        entries[name] = e
    if found.weight_map is not None:
      held: dict[str, dict] = {f: {} for f in found.files}
      for name, e in entries.items():
        held[e.file][name] = e
      check_index(found.index, found.weight_map, held)
    yield OpenFiles(files, entries)
