"""Parameters out to safetensors files, written from the shards where they lie.

Every process computes the same headers from names, shapes and dtypes alone; process 0
creates each file under a temporary name, full size, header in place; then every process
writes the parts of the leaves its devices hold (`zero_jax.checkpoint.blocks`) with
positioned writes, one bounded chunk at a time (sliced, transposed and converted on its
device), and syncs; process 0 renames the files and writes the index last. No leaf is
gathered anywhere, and a failure on any process removes what was written.
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.processes import distributed
from zero_jax.layers import nnx as nnx_lib
from zero_jax.checkpoint import blocks
from zero_jax.checkpoint import layer_names
from zero_jax.checkpoint import progress as progress_lib
from zero_jax.checkpoint import safetensors_format as fmt
from zero_jax.checkpoint import writer
from zero_jax.step.train_step import ShardedTrainStep, TrainState

MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")
CHUNK_BYTES = 16 << 20
HOST_VIEWS = True  # read CPU devices' blocks through numpy views (tests turn it off)
_SHARDS = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")


class _Leaf:
  """One tensor to write: the tensor, its source array, the leaf's logical shape (the
  tensor is one layer of it when ``tensor.layer`` is not None)."""

  def __init__(self, tensor: fmt.Tensor, array: jax.Array, shape: tuple[int, ...]):
    self.tensor, self.array, self.shape = tensor, array, shape

  @property
  def part_shape(self) -> tuple[int, ...]:
    """The logical shape of what the tensor holds: the leaf's, or one layer's."""
    return self.shape if self.tensor.layer is None else self.shape[1:]


def _plan(state: TrainState, rename, dtype) -> list[_Leaf]:
  """The tensors to write, in the params' order (a stacked leaf named with ``{i}``: one per
  layer, in order): the master copy where there is one."""
  meta = state.meta
  paths = jax.tree_util.tree_flatten_with_path(state.params)[0]
  arrays = [x for _, x in paths]
  for m, i in zip(state.master or [], meta.train_idx):
    if m is not None:
      arrays[i] = m
  variable = nnx_lib.holds_variables(state.params)
  out = []
  for (path, _), x, layout, stacked in zip(paths, arrays, meta.param_layouts, meta.stacked):
    leaf = f"params{jax.tree_util.keystr(path)}"
    shape = tuple(layout.shape)
    name, transpose = layer_names.apply_rename(
        rename, fmt.default_name(path, variable=variable), leaf, len(shape), stacked=stacked)
    dt = _file_dtype(x.dtype, dtype, leaf)
    fmt.dtype_code(dt, leaf)
    layers = layer_names.LAYER in name
    part = shape[1:] if layers else shape
    t = fmt.Tensor(name, part[::-1] if transpose else part, dt, leaf, transpose)
    tensors = layer_names.layer_tensors(t, shape[0]) if layers else [t]
    out += [_Leaf(u, x, shape) for u in tensors]
  fmt.check_unique([l.tensor for l in out])
  return out


def _file_dtype(leaf_dtype, dtype, leaf: str) -> np.dtype:
  """The dtype ``leaf`` is written in: ``dtype`` for a floating leaf, its own otherwise.
  A floating leaf is not converted to a dtype that is not floating (it would be truncated)."""
  if dtype is None or not jnp.issubdtype(leaf_dtype, jnp.floating):
    return np.dtype(leaf_dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"export_safetensors(dtype={np.dtype(dtype).name}): {leaf} is "
                    f"{np.dtype(leaf_dtype).name}, and converting floating weights to "
                    f"{np.dtype(dtype).name} would truncate them. dtype= converts floating "
                    f"leaves only: pass a floating dtype (jnp.bfloat16, jnp.float16) or None "
                    f"to write each leaf as get_params returns it.")
  return np.dtype(dtype)


@jax.jit
def _largest(arrays: list) -> list:
  """The largest magnitude of each array's finite values (0 for an empty one)."""
  return [jnp.max(jnp.abs(jnp.where(jnp.isfinite(x), x, 0)), initial=0) for x in arrays]


def _check_range(leaves: list[_Leaf]) -> None:
  """Raises naming the leaf when converting it to its file dtype would make a finite value
  infinite or NaN (one program over every such leaf, before anything is written)."""
  narrowed = list({id(l.array): l for l in leaves  # a stacked leaf's layers: checked once
                   if fmt.shrinks(l.array.dtype, l.tensor.dtype)}.values())
  arrays = [l.array if getattr(l.array.sharding, "memory_kind", None) in (None, "device") else
            jax.device_put(l.array, l.array.sharding.with_memory_kind("device"))
            for l in narrowed]
  for l, big in zip(narrowed, _largest(arrays) if arrays else []):
    big = np.asarray(big)
    with np.errstate(over="ignore", invalid="ignore"):
      written = big.astype(l.tensor.dtype).item()
    big = big.item()
    if not np.isfinite(written):
      raise ValueError(
          f"export_safetensors(dtype={l.tensor.dtype.name}): {l.tensor.leaf} holds {big:g} "
          f"(in magnitude), past the largest {l.tensor.dtype.name} "
          f"({float(jnp.finfo(l.tensor.dtype).max):g}): it would be written as {written}. "
          f"Export in a dtype of larger range (jnp.bfloat16, float32, or None for the "
          f"leaves' own); nothing was written.")


# ------------------------------------------------------------------ the data
@functools.lru_cache(maxsize=256)
def _slicer(sizes: tuple[int, ...], transpose: bool, dtype: np.dtype,
            layer: bool = False) -> Callable:
  def piece(x, starts):
    y = jax.lax.dynamic_slice(x, starts, sizes) if sizes else x
    y = y[0] if layer else y
    return (y.T if transpose else y).astype(dtype)
  return jax.jit(piece)


def _reader(x: jax.Array, transpose: bool, dtype: np.dtype, layer: int | None = None,
            moved: dict | None = None) -> Callable:
  """``piece(box) -> host array``: a box of one device's block (of its layer ``layer``, when
  not None: the box then spans the dimensions after the first), transposed and converted,
  in the file's row-major order. CPU devices share their buffers with numpy (the box is
  a view; one copy makes it contiguous); elsewhere the box is sliced on its device (one
  small program per piece shape and device) and copied to the host alone. An offloaded
  block is brought to its device once for the layers written from it in a row (``moved``:
  ``{device: (block, its copy on the device)}``, the last block of each device: what that
  device held before, while the block was written)."""
  if next(iter(x.devices())).platform == "cpu" and HOST_VIEWS:
    block = np.asarray(x) if layer is None else np.asarray(x)[layer]
    return lambda box: np.ascontiguousarray(
        _t(block[tuple(slice(a, b) for a, b in box)], transpose), dtype=dtype)
  if getattr(x.sharding, "memory_kind", None) not in (None, "device"):
    moved = {} if moved is None else moved
    device = next(iter(x.devices()))
    if moved.get(device, (None,))[0] is not x:  # offloaded: one block per device at a time
      moved.pop(device, None)
      moved[device] = (x, jax.device_put(x, x.sharding.with_memory_kind("device")))
    x = moved[device][1]
  if layer is None:
    return lambda box: np.asarray(_slicer(tuple(b - a for a, b in box), transpose, dtype)(
        x, tuple(np.int32(a) for a, _ in box)))
  return lambda box: np.asarray(_slicer((1,) + tuple(b - a for a, b in box), transpose, dtype,
                                        True)(x, (np.int32(layer),) + tuple(np.int32(a)
                                                                            for a, _ in box)))


def _t(a: np.ndarray, transpose: bool) -> np.ndarray:
  return a.T if transpose else a


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
  while data:
    n = os.pwrite(fd, data, offset)
    data, offset = data[n:], offset + n


def _my_parts(leaf: _Leaf) -> list:
  """``(shard, box)``: the part of ``leaf`` each of this process's devices writes (a block
  held by several devices is divided among them)."""
  x = leaf.array
  index = x.sharding.devices_indices_map(x.shape)
  boxes = {d: blocks.shard_box(i, x.shape, leaf.shape) for d, i in index.items()}
  if leaf.tensor.layer is not None:
    boxes = {d: blocks.layer_box(b, leaf.tensor.layer) for d, b in boxes.items()}
  parts = blocks.assign(boxes, 1 if leaf.tensor.transpose else 0)
  return [(s, parts[s.device]) for s in x.addressable_shards if s.device in parts]


def _my_bytes(leaves) -> int:
  """The bytes this process writes of ``leaves``."""
  return sum(math.prod(b - a for a, b in box) * leaf.tensor.dtype.itemsize
             for leaf in leaves for _, box in _my_parts(leaf))


def _write_leaf(fd: int, base: int, leaf: _Leaf, chunk_bytes: int, done,
                moved: dict | None = None) -> None:
  """Writes the parts of ``leaf`` this process's devices are assigned; ``done(n)`` after
  each chunk of ``n`` bytes (``moved``: see `_reader`)."""
  t, x = leaf.tensor, leaf.array
  ndim = len(leaf.part_shape)
  order = tuple(reversed(range(ndim))) if t.transpose else tuple(range(ndim))
  for shard, part in _my_parts(leaf):
    origin = [s.indices(n)[0] for s, n in zip(shard.index, x.shape)]
    layer = None
    if t.layer is not None:  # the box spans a layer's dimensions: the shard's from the second
      layer, origin = t.layer - origin[0], origin[1:]
    piece = _reader(shard.data, t.transpose, t.dtype, layer, moved)
    max_elems = max(1, chunk_bytes // max(x.dtype.itemsize, t.dtype.itemsize))
    for c in blocks.chunks(part, max_elems, order):
      host = piece(tuple((a - o, b - o) for (a, b), o in zip(c, origin)))
      raw = np.ascontiguousarray(host).reshape(-1).view(np.uint8)
      offsets, length = blocks.runs(t.shape, blocks.transpose_box(c, t.transpose))
      n = length * t.dtype.itemsize
      for j, o in enumerate(offsets):
        _pwrite_all(fd, memoryview(raw[j * n:(j + 1) * n]), base + o * t.dtype.itemsize)
      done(raw.size)


# ------------------------------------------------------------ the directory
def _tmp(directory: str, name: str) -> str:
  return os.path.join(directory, f".{name}.zero_jax-tmp")


def _existing(directory: str) -> list[str]:
  if not os.path.isdir(directory):
    return []
  return sorted(f for f in os.listdir(directory)
                if f in (fmt.SINGLE, fmt.INDEX) or _SHARDS.match(f))


def _create(directory: str, files, names, headers, force: bool) -> None:
  """Process 0: the temporary files, full size, each with its header."""
  writer.make_directory(directory)
  writer.check_writable(directory)
  old = _existing(directory)
  if old and not force:
    raise FileExistsError(f"{directory} already holds {old[:4]}; pass force=True to replace "
                          f"them, or export into another directory.")
  for ts, name, (head, _) in zip(files, names, headers):
    size = len(head) + sum(t.nbytes for t in ts)
    with open(_tmp(directory, name), "wb") as f:
      f.write(head)
      f.truncate(size)


def _fill(directory: str, leaves: dict[str, _Leaf], files, names, headers,
          chunk_bytes: int, progress) -> None:
  """Every process: its parts of every tensor, at their offsets, synced to disk."""
  with progress_lib.bytes_bar(_my_bytes(leaves.values()), f"export {directory}",
                              progress) as done:
    moved = {}  # a stacked leaf's offloaded blocks, brought to the devices once for its layers
    for ts, name, (_, offsets) in zip(files, names, headers):
      _fill_file(_tmp(directory, name), [leaves[t.name] for t in ts],
                 [offsets[t.name] for t in ts], chunk_bytes, done, moved)


def _fill_file(path: str, leaves, offsets, chunk_bytes: int, done, moved: dict) -> None:
  try:
    fd = os.open(path, os.O_WRONLY)
  except FileNotFoundError:
    raise FileNotFoundError(
        f"{path} (created by process 0) is not visible to process {jax.process_index()}: "
        f"with several processes, export into a directory on a file system they share.") \
        from None
  try:
    for leaf, offset in zip(leaves, offsets):
      _write_leaf(fd, offset, leaf, chunk_bytes, done, moved)
    os.fsync(fd)
  finally:
    os.close(fd)


def _sync_dir(directory: str) -> None:
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _commit(directory: str, files, names) -> None:
  """Process 0: the files under their names, the index last, stale files of an earlier
  export (``force``) removed."""
  old = _existing(directory)
  if fmt.INDEX in old:  # while the files change, no index points at a mixture
    os.remove(os.path.join(directory, fmt.INDEX))
    old.remove(fmt.INDEX)
  for name in names:
    os.replace(_tmp(directory, name), os.path.join(directory, name))
  _sync_dir(directory)
  final = list(names)
  if len(names) > 1:
    tmp = _tmp(directory, fmt.INDEX)
    with open(tmp, "wb") as f:
      f.write(fmt.index(files, names))
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, fmt.INDEX))
    final.append(fmt.INDEX)
  for f in old:
    if f not in final:
      os.remove(os.path.join(directory, f))
  _sync_dir(directory)


def _cleanup(directory: str, names) -> None:
  for name in list(names) + [fmt.INDEX]:
    try:
      os.remove(_tmp(directory, name))
    except OSError:
      pass


def _together(fn, *args) -> None:
  """Runs ``fn`` on this process; raises on every process if it failed on any."""
  error = None
  try:
    fn(*args)
  except Exception as e:  # pylint: disable=broad-except
    error = e
  if not distributed.all_processes_agree(error is None):
    if error is not None:
      raise error
    raise RuntimeError(f"exporting safetensors failed on another process (see its log); "
                       f"process {jax.process_index()} stops too.")


def _check_args(step, state, max_shard_bytes, chunk_bytes) -> None:
  if not isinstance(step, ShardedTrainStep):
    raise TypeError(f"export_safetensors(step, state, directory): step must be the "
                    f"ShardedTrainStep that made the state, got {type(step).__name__}.")
  for name, v in (("max_shard_bytes", max_shard_bytes), ("chunk_bytes", chunk_bytes)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be a positive int (bytes), got {v!r}.")


def export_safetensors(step: ShardedTrainStep, state: TrainState, directory, *,
                       rename: Callable | None = None, dtype=None,
                       max_shard_bytes: int = MAX_SHARD_BYTES, metadata: dict | None = None,
                       force: bool = False, chunk_bytes: int = CHUNK_BYTES,
                       progress: bool | None = None) -> list[str]:
  """Writes a state's parameters as safetensors files, from the shards where they lie.

  The files hold what ``step.get_params(state)`` returns (the float32 master copy
  where there is one), bit for bit, in the Hugging Face layout: ``model.safetensors``,
  or ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` when
  the parameters pass ``max_shard_bytes``. No leaf is gathered: each process writes
  the rows its devices hold at their offsets in the file (a block held by several
  devices is divided among them), one chunk of at most ``chunk_bytes`` at a time, so
  host memory does not grow with the model. The files are written under temporary
  names and renamed when complete, the index last: they are complete or absent. With
  several processes, every process calls it, and ``directory`` must be on a file
  system they share.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> from safetensors.numpy import load_file
    >>> loss_fn = lambda p, b: jnp.mean((b @ p["dense"]["kernel"]) ** 2)
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3)
    >>> state = step.init({"dense": {"kernel": jnp.ones((3, 5))}})
    >>> path = tempfile.mkdtemp()
    >>> zj.export_safetensors(step, state, path,   # PyTorch's (out, in) layout
    ...                       rename=lambda name: (name.replace("kernel", "weight"), True))
    ['model.safetensors']
    >>> load_file(os.path.join(path, "model.safetensors"))["dense.weight"].shape
    (5, 3)

    A stacked leaf (``stacked=``: layers along its first dimension) under the Hub's
    per-layer names, ``{i}`` the layer index:

    >>> step = zj.make_sharded_train_step(lambda p, b: jnp.sum(p["w"]) * b, optax.sgd(0.1),
    ...                                   mesh=mesh, stage=3, stacked={"w": True})
    >>> state = step.init({"w": jnp.ones((2, 3, 5))})   # 2 layers of (3, 5)
    >>> zj.export_safetensors(step, state, path, force=True,
    ...                       rename=lambda name: ("model.layers.{i}.weight", True))
    ['model.safetensors']
    >>> {k: v.shape for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    {'model.layers.0.weight': (5, 3), 'model.layers.1.weight': (5, 3)}

  Args:
    step: the `ShardedTrainStep` that made ``state``.
    state: its `TrainState`.
    directory: where to write (created if needed; other files in it are left alone).
    rename: a function of a leaf's default name (its pytree path joined with ``.``:
      ``layers.0.attn.kernel``; NNX Variables without ``.value``) that returns the
      tensor's name, or ``(name, transpose)``: ``transpose=True`` writes a 2-D leaf
      transposed (Flax kernels are ``(in, out)``, PyTorch ``Linear`` weights
      ``(out, in)``). A name holding ``{i}`` writes a leaf the step holds as a stack of
      layers (``stacked=``) as one tensor per layer, ``{i}`` the index along its first
      dimension (``model.layers.{i}.mlp.up_proj.weight``); ``transpose`` then applies to
      each layer. No other brace may appear in a name. `load_safetensors` takes the same
      function back.
    dtype: write floating leaves in this dtype (e.g. ``jnp.bfloat16``), converted on
      the devices; default: as ``get_params`` returns them. Other leaves keep theirs.
    max_shard_bytes: start a new file when the next tensor would pass this size
      (Hugging Face's 5 GB by default); a larger tensor gets a file of its own.
    metadata: entries added to every file's ``__metadata__`` (str to str), which holds
      ``{"format": "pt"}`` unless they set ``"format"``: ``transformers`` 4.x refuses a
      file whose metadata has no ``"format"``.
    force: replace an earlier export in ``directory`` (its files, once the new
      ones are complete).
    chunk_bytes: the most bytes a device copies to the host at a time.
    progress: a progress bar of the bytes written (``tqdm``, on process 0): True, False,
      or None for one when this process writes 1 GiB or more and ``tqdm`` is installed.

  Returns:
    The names of the files written in ``directory`` (the index last).

  Raises:
    ValueError: ``rename`` maps two leaves (or layers) to one name, transposes a leaf
      (a layer) that is not 2-D, returns ``{i}`` for a leaf that is not stacked, or a
      name with another brace.
    TypeError: ``dtype`` is not floating (a floating leaf would be truncated).
    ValueError: a leaf holds a finite value past ``dtype``'s range (it would be written as
      inf or NaN); nothing is written.
    FileExistsError: ``directory`` holds an export and ``force`` is False.
    OSError: ``directory`` cannot be written (nothing is left behind).
  """
  _check_args(step, state, max_shard_bytes, chunk_bytes)
  progress_lib.check(progress, "export_safetensors")
  state = step._prepare(state, "export_safetensors")  # pylint: disable=protected-access
  leaves = _plan(state, rename, dtype)
  _check_range(leaves)
  files = fmt.split_files([l.tensor for l in leaves], max_shard_bytes)
  names = fmt.file_names(len(files))
  meta = {"format": "pt", **(metadata or {})}  # transformers 4.x needs "format"
  headers = [fmt.header(ts, meta) for ts in files]
  directory = writer.abs_path(directory)
  main = jax.process_index() == 0
  try:
    _together(lambda: main and _create(directory, files, names, headers, force))
    _together(_fill, directory, {l.tensor.name: l for l in leaves}, files, names, headers,
              chunk_bytes, progress)
    _together(lambda: main and _commit(directory, files, names))
  except BaseException:
    if main:
      _cleanup(directory, names)
    raise
  return names + ([fmt.INDEX] if len(names) > 1 else [])
