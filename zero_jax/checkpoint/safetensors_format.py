"""The safetensors layout as pure functions: names, headers, files and the index.

A safetensors file is 8 bytes (little-endian header length ``N``), ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``,
offsets relative to the end of the header), then every tensor's row-major bytes. The
header depends on names, shapes and dtypes alone, so every tensor's byte range is known
before any data is written. Several files come with ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``), as Hugging Face
writes them; its file names are files inside the index's folder (`check_shard_name`).
A stacked leaf may be named per layer, as the Hub names layers: a name with ``{i}``
(`LAYER`) is one tensor per layer (`layer_tensors`). Reading and writing data is
`zero_jax.checkpoint.safetensors_read` (with ``safetensors_files``) /
``safetensors_write``'s job.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from typing import Callable, NamedTuple

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


LAYER = "{i}"  # in a name from rename=: one tensor per layer of a stacked leaf


def _check_braces(name: str, default: str, leaf: str) -> None:
  """Refuses braces in a name other than `LAYER`'s (another format field, an escape)."""
  if "{" in name.replace(LAYER, "") or "}" in name.replace(LAYER, ""):
    raise ValueError(f"rename({default!r}) for the leaf {leaf} returned {name!r}, which holds "
                     f"braces other than '{LAYER}': a tensor name may hold '{LAYER}' (replaced "
                     f"by the layer index of a stacked leaf, one tensor per layer) and no other "
                     f"'{{' or '}}' (no other field such as '{{j}}', '{{}}' or '{{i:02d}}').")


def apply_rename(rename: Callable | None, default: str, leaf: str, ndim: int, *,
                 stacked: bool = False) -> tuple[str, bool]:
  """``rename(default)`` checked: ``(name, transpose)``.

  ``rename`` returns a name, or ``(name, transpose)`` with ``transpose`` a bool (the
  file holds the 2-D leaf transposed: PyTorch's ``Linear.weight`` is ``(out, in)``,
  Flax's ``kernel`` ``(in, out)``). A name holding ``{i}`` on a ``stacked`` leaf (layers
  along its first dimension) names one tensor per layer (`layer_tensors`); ``transpose``
  then applies to each layer's 2-D slice.

  >>> apply_rename(lambda n: ("model.layers.{i}.w", True), "blocks.w", "params['blocks']",
  ...              3, stacked=True)
  ('model.layers.{i}.w', True)
  """
  if rename is None:
    return default, False
  out = rename(default)
  name, transpose = (out if isinstance(out, tuple) and len(out) == 2 else (out, False))
  if not isinstance(name, str) or not name or not isinstance(transpose, (bool, np.bool_)):
    raise TypeError(f"rename({default!r}) for the leaf {leaf} returned {out!r}; it must return "
                    f"a non-empty str, or (name, transpose) with transpose a bool.")
  if name == "__metadata__":
    raise ValueError(f"rename({default!r}) for the leaf {leaf} returned '__metadata__', the "
                     f"name of a safetensors file's metadata entry; give the tensor another name.")
  _check_braces(name, default, leaf)
  layers = LAYER in name
  if layers and not stacked:
    raise ValueError(f"rename({default!r}) for the leaf {leaf} returned {name!r}, whose "
                     f"'{LAYER}' asks for one tensor per layer, but the step does not hold "
                     f"{leaf} as a stack of layers. Mark it with make_sharded_train_step(..., "
                     f"stacked=...) if its first dimension is the layers, or return a name "
                     f"without '{LAYER}'.")
  if transpose and ndim - layers != 2:
    what = (f"named per layer ('{LAYER}'), whose layers have {ndim - 1} dimensions" if layers
            else f"which has {ndim} dimensions")
    raise ValueError(f"rename({default!r}) asks to transpose the leaf {leaf}, {what}; only "
                     f"2-D {'layers' if layers else 'leaves'} (kernels) can be transposed.")
  return name, bool(transpose)


def layer_tensors(t: Tensor, layers: int) -> list[Tensor]:
  """The per-layer tensors of a stacked leaf's ``t`` (its name holding `LAYER`, its shape
  a layer's in the file): ``{i}`` replaced by 0, 1, ..., ``layers - 1``.

  >>> [u.name for u in layer_tensors(Tensor("h.{i}.w", (2,), np.dtype("f4"), "w"), 3)]
  ['h.0.w', 'h.1.w', 'h.2.w']
  """
  return [t._replace(name=t.name.replace(LAYER, str(i)), layer=i,
                     leaf=f"{t.leaf} (layer {i} of {layers})") for i in range(layers)]


def layer_of(template: str, name: str) -> int | None:
  """The layer index ``name`` has under ``template`` (``"h.{i}.w"``, ``"h.12.w"`` -> 12), or
  None when it is not one of its names (a layer index as `layer_tensors` writes it: no
  leading zeros)."""
  first, *rest = (re.escape(p) for p in template.split(LAYER))
  fields = ["(?P<i>0|[1-9][0-9]*)"] + ["(?P=i)"] * (len(rest) - 1)
  m = re.fullmatch(first + "".join(f + p for f, p in zip(fields, rest)), name)
  return int(m.group("i")) if m else None


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
