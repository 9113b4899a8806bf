"""The safetensors layout as pure functions: names, headers, files and the index.

A safetensors file is 8 bytes (little-endian header length ``N``), ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the end of the header), then every tensor's row-major bytes. The
header depends on names, shapes and dtypes alone, so every tensor's byte range is known
before any data is written. Several files come with ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), as Hugging Face
writes them (`index`); finding the files and checking an index someone else wrote is
`zero_jax.checkpoint.safetensors_files`' job. A stacked leaf may be named per layer, as the
Hub names layers: a name with ``{i}`` is one tensor per layer
(`zero_jax.checkpoint.layer_names`). Reading and writing data is
`zero_jax.checkpoint.safetensors_read` (with ``safetensors_files``) /
``safetensors_write``'s job.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # the safetensors library's own limit

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16), "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    "F8_E5M2": np.dtype(jnp.float8_e5m2), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in DTYPES.items()}


def dtype_code(dtype, where: str) -> str:
  """The safetensors name of a dtype (``"F32"``, ``"BF16"``, ...)."""
  code = _CODES.get(np.dtype(dtype))
  if code is None:
    raise TypeError(f"{where}: safetensors has no name for dtype {np.dtype(dtype).name}; "
                    f"pass dtype= one of {sorted(d.name for d in _CODES)}.")
  return code


def shrinks(src, dst) -> bool:
  """A floating conversion into a smaller range, which large values do not survive (float32
  into float16, bfloat16 or a float8 dtype)."""
  return bool(jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)) and \
      float(jnp.finfo(dst).max) < float(jnp.finfo(src).max)


class Tensor(NamedTuple):
  """One tensor of an export or a file.

  Attributes:
    name: its name in the file (``model.layers.0.mlp.up_proj.weight``).
    shape: its shape in the file.
    dtype: its numpy dtype in the file.
    leaf: the pytree leaf it comes from or goes to, for messages (``['w']``).
    transpose: the file holds the 2-D leaf (or layer) transposed.
    layer: the tensor is this layer (index along the first dimension) of a stacked leaf,
      written under a per-layer name (`layer_tensors`); None for a whole leaf.
  """
  name: str
  shape: tuple[int, ...]
  dtype: np.dtype
  leaf: str = ""
  transpose: bool = False
  layer: int | None = None

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


# --------------------------------------------------------------------- names
def _key_str(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def default_name(path, *, variable: bool = False) -> str:
  """A pytree path joined with ``.``: ``{"layers": {"0": {"w": x}}}`` -> ``layers.0.w``.

  ``variable``: the path ends inside an NNX Variable (its ``.value``), which is dropped.
  """
  keys = list(path)
  if variable and keys and getattr(keys[-1], "name", None) == "value":
    keys = keys[:-1]
  return ".".join(_key_str(k) for k in keys)


def check_unique(tensors: list[Tensor]) -> None:
  """Raises naming both leaves when two leaves map to one tensor name."""
  seen: dict[str, str] = {}
  for t in tensors:
    if t.name in seen:
      raise ValueError(f"the leaves {seen[t.name]} and {t.leaf} both map to the tensor name "
                       f"{t.name!r}; rename= must give every leaf its own name.")
    seen[t.name] = t.leaf


# -------------------------------------------------------------------- writing
def file_names(n: int) -> list[str]:
  """Hugging Face's names for ``n`` files: ``model.safetensors`` or ``model-0000k-of-0000n``."""
  if n == 1:
    return [SINGLE]
  return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def split_files(tensors: list[Tensor], max_bytes: int) -> list[list[Tensor]]:
  """Tensors in order, a new file whenever the next would pass ``max_bytes`` (a larger
  tensor gets a file of its own), as Hugging Face shards a model."""
  files: list[list[Tensor]] = [[]]
  size = 0
  for t in tensors:
    if files[-1] and size + t.nbytes > max_bytes:
      files.append([])
      size = 0
    files[-1].append(t)
    size += t.nbytes
  return files


def header(tensors: list[Tensor], metadata: dict | None = None) -> tuple[bytes, dict[str, int]]:
  """``(the 8-byte length and the JSON header, {name: offset of its data in the file})``.

  Tensors are laid out by decreasing item size (each stays aligned), then by name, and
  the JSON is padded with spaces to a multiple of 8 bytes: for tensors of one dtype, the
  bytes the safetensors library's ``save_file`` writes (it orders equal item sizes by
  dtype; either order is a valid file).
  """
  order = sorted(range(len(tensors)), key=lambda i: (-tensors[i].dtype.itemsize,
                                                     tensors[i].name))
  entries: dict = {}
  if metadata:
    entries["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  begin, offsets = 0, {}
  for i in order:
    t = tensors[i]
    entries[t.name] = {"dtype": dtype_code(t.dtype, t.leaf), "shape": list(t.shape),
                       "data_offsets": [begin, begin + t.nbytes]}
    offsets[t.name] = begin
    begin += t.nbytes
  text = json.dumps(entries, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  start = 8 + len(text)
  return struct.pack("<Q", len(text)) + text, {k: start + v for k, v in offsets.items()}


def index(files: list[list[Tensor]], names: list[str]) -> bytes:
  """The ``model.safetensors.index.json`` of several files."""
  weight_map = {t.name: f for ts, f in zip(files, names) for t in ts}
  total = sum(t.nbytes for ts in files for t in ts)
  return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                    indent=2).encode() + b"\n"


# -------------------------------------------------------------------- reading
class Entry(NamedTuple):
  """A tensor found in a file: where its data lies."""
  file: str
  dtype: np.dtype | None  # None: a safetensors dtype zero_jax does not read (`code`)
  shape: tuple[int, ...]
  begin: int  # absolute byte offsets in the file
  end: int
  code: str = ""  # the header's dtype name


def _bad(path: str, why: str) -> ValueError:
  return ValueError(f"{path} is not a complete safetensors file: {why}. Download or export it "
                    f"again (a truncated copy or an interrupted download?).")


def _invalid(path: str, why: str) -> ValueError:
  return ValueError(f"{path} is not a valid safetensors file: {why}; the safetensors library "
                    f"refuses it too. Download or export it again.")


def check_length(path: str, n: int, size: int, max_header_bytes: int) -> None:
  """Raises naming ``path`` when its header length ``n`` passes the file's ``size`` or the
  cap ``max_header_bytes``."""
  if 8 + n > size:
    raise _bad(path, f"its header length says {n} bytes, and the file has {size - 8} after it")
  if n > max_header_bytes:
    mib = f" ({n / 2**20:.1f} MiB)" if n >= 2**20 else ""
    library = (", which the safetensors library refuses too: its cap is 100 MiB"
               if n > MAX_HEADER else "")
    raise ValueError(f"{path} has a header of {n} bytes{mib}, more than the cap of "
                     f"{max_header_bytes} bytes{library}. If the file is what you expect, "
                     f"raise the cap: zj.load_safetensors(..., max_header_bytes={n}).")


def _no_repeats(pairs: list) -> dict:
  """``json.loads``' ``object_pairs_hook``: an object naming a key twice is refused (json
  would keep the last)."""
  out = {}
  for k, v in pairs:
    if k in out:
      raise _Repeated(k)
    out[k] = v
  return out


class _Repeated(Exception):
  pass


def _entry(path: str, name: str, e, start: int) -> Entry:
  """One header entry, its fields checked (``start``: where the data begins in the file)."""
  try:
    code, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    ints = [*shape, *offsets]
    if not isinstance(code, str) or len(offsets) != 2 or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ints):
      raise TypeError(code)
  except (KeyError, TypeError, ValueError):
    raise _invalid(path, f"the header entry of tensor {name!r} ({e!r}) is not a dtype name, "
                         f"a shape and data_offsets (non-negative integers)") from None
  begin, end = offsets
  dtype = DTYPES.get(code)  # another dtype (C64, F4, ...) is refused only if a leaf reads it
  if end < begin or dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
    raise _invalid(path, f"tensor {name!r} has data_offsets [{begin}, {end}], which do not "
                         f"hold {list(shape)} x {code}")
  return Entry(path, dtype, tuple(shape), start + begin, start + end, code)


def _check_coverage(path: str, out: dict[str, Entry], start: int, size: int) -> None:
  """The tensors' bytes follow one another from the start of the data to the file's end,
  as the safetensors library requires: no overlap, no gap, nothing past the end."""
  expected, previous = start, None
  for name, e in sorted(out.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
    if e.end > size:
      raise _bad(path, f"tensor {name!r} ends at byte {e.end - start} of the data, and the "
                       f"file holds {size - start} bytes of data after its header")
    if e.begin < expected:
      raise _invalid(path, f"the bytes of tensor {name!r} (data_offsets [{e.begin - start}, "
                           f"{e.end - start}]) overlap those of tensor {previous!r}, which end "
                           f"at {expected - start}: an invalid offset")
    if e.begin > expected:
      after = f"after tensor {previous!r}" if previous else "at the start of the data"
      raise _invalid(path, f"bytes [{expected - start}, {e.begin - start}) of the data, "
                           f"{after} and before tensor {name!r}, belong to no tensor: an "
                           f"invalid offset")
    expected, previous = e.end, name
  if expected < size:
    raise _invalid(path, f"its last {size - expected} bytes belong to no tensor (the "
                         f"tensors end at byte {expected - start} of {size - start} bytes of "
                         f"data): the header does not cover the file")


def parse_header(path: str, head: bytes, size: int, *,
                 max_header_bytes: int = MAX_HEADER) -> dict[str, Entry]:
  """The tensors of a safetensors file from its first bytes (``head``: at least the 8-byte
  length and the header) and its size in bytes, checked as the safetensors library checks
  them: every offset within the file, the tensors' bytes covering the data exactly (no
  overlap, no gap), no name twice, ``__metadata__`` (if any) strings only, the header at
  most ``max_header_bytes``."""
  if size < 8 or len(head) < 8:
    raise _bad(path, f"it has {size} bytes, fewer than the 8-byte header length")
  n = struct.unpack("<Q", head[:8])[0]
  check_length(path, n, size, max_header_bytes)
  if len(head) < 8 + n:
    raise _bad(path, f"its header length says {n} bytes, and {len(head) - 8} could be read")
  try:
    raw = json.loads(head[8:8 + n], object_pairs_hook=_no_repeats)
  except _Repeated as e:
    raise _invalid(path, f"its header names {e.args[0]!r} twice") from None
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    raise _bad(path, f"its header is not JSON ({e})") from None
  if not isinstance(raw, dict):
    raise _bad(path, "its header is not a JSON object")
  meta = raw.get("__metadata__")
  if meta is not None and not (isinstance(meta, dict) and
                               all(isinstance(v, str) for v in meta.values())):
    raise _invalid(path, f"its __metadata__ ({meta!r}) is not an object of strings")
  out = {name: _entry(path, name, e, 8 + n) for name, e in raw.items() if name != "__metadata__"}
  _check_coverage(path, out, 8 + n, size)
  return out


def read_header(file, path: str, *, max_header_bytes: int = MAX_HEADER) -> dict[str, Entry]:
  """The tensors of the safetensors file open as ``file`` (binary), found at ``path``:
  its header read (never more than its length, checked against the file's size and
  ``max_header_bytes`` first) and parsed by `parse_header`."""
  size = os.fstat(file.fileno()).st_size
  file.seek(0)
  head = file.read(8)
  if len(head) == 8 and size >= 8:
    n = struct.unpack("<Q", head)[0]
    check_length(path, n, size, max_header_bytes)
    parts = [head]
    while n and (part := file.read(n)):  # an unbuffered file may return less than asked
      parts.append(part)
      n -= len(part)
    head = b"".join(parts)
  return parse_header(path, head, size, max_header_bytes=max_header_bytes)


def header_of(path, *, max_header_bytes: int = MAX_HEADER) -> dict[str, Entry]:
  """`read_header` of the file at ``path``."""
  path = os.fspath(path)
  with open(path, "rb") as f:
    return read_header(f, path, max_header_bytes=max_header_bytes)
