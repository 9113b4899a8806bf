"""Parameters in from safetensors files, each device reading only its own block.

Names, shapes and dtypes are checked against ``like`` from the files' headers alone
(`zero_jax.checkpoint.safetensors_format`), before any data is read; then each leaf
becomes a global array split the way the step splits it, each device's block read from
the file, opened once for the whole load (`zero_jax.checkpoint.safetensors_files`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zero_jax.step import init as init_lib
from zero_jax.layers import nnx as nnx_lib
from zero_jax.step import state as st
from zero_jax.step.options import stacked_flags
from zero_jax.checkpoint import progress as progress_lib
from zero_jax.checkpoint import layer_names
from zero_jax.checkpoint import safetensors_format as fmt
from zero_jax.checkpoint import safetensors_files as files_lib
from zero_jax.step.train_step import ShardedTrainStep


def _listing(names, n: int = 6) -> str:
  names = list(names)
  if not names:
    return "no tensors"
  more = f" and {len(names) - n} more" if len(names) > n else ""
  return ", ".join(repr(x) for x in names[:n]) + more


def _check(path, tensors: list[fmt.Tensor], entries: dict[str, fmt.Entry], cast: bool,
           strict: bool) -> None:
  """Every tensor present with its leaf's shape (and dtype unless ``cast``); with
  ``strict``, no tensor in the files that no leaf reads."""
  missing = [t for t in tensors if t.name not in entries]
  if missing:
    raise KeyError(
        f"{len(missing)} tensor(s) the leaves need are not in {path}: "
        + "; ".join(f"{t.name!r} (for {t.leaf})" for t in missing[:6])
        + f". The files hold {_listing(sorted(entries))}. Pass rename= mapping each leaf's "
        f"default name (its path joined with '.') to the file's name.")
  for t in tensors:
    e = entries[t.name]
    if e.shape != t.shape:
      hint = (" (the transpose: return (name, True) from rename= for this leaf)"
              if len(e.shape) == 2 and e.shape == t.shape[::-1] else "")
      raise ValueError(f"tensor {t.name!r} in {e.file} has shape {list(e.shape)}, and the leaf "
                       f"{t.leaf} needs {list(t.shape)}{hint}.")
    if e.dtype is None:
      raise TypeError(f"tensor {t.name!r} in {e.file} has the safetensors dtype {e.code}, which "
                      f"zero_jax does not read (for {t.leaf}); it reads "
                      f"{', '.join(fmt.DTYPES)}.")
    if e.dtype != t.dtype and not cast:
      raise TypeError(f"tensor {t.name!r} in {e.file} is {e.dtype.name}, and the leaf {t.leaf} "
                      f"in `like` is {t.dtype.name}; pass cast=True to convert it, or a "
                      f"`like` with the file's dtype.")
    if e.dtype != t.dtype and _kind(e.dtype) != _kind(t.dtype):
      raise TypeError(f"tensor {t.name!r} in {e.file} is {e.dtype.name}, and the leaf {t.leaf} "
                      f"in `like` is {t.dtype.name}: cast=True converts between floating "
                      f"dtypes (or between integer ones), not from one kind to the other. "
                      f"Give `like` the file's kind of dtype.")
  unused = sorted(set(entries) - {t.name for t in tensors})
  if unused and strict:
    raise ValueError(f"{path} holds {len(unused)} tensor(s) that no leaf of `like` reads: "
                     f"{_listing(unused)}. Map leaves onto them with rename=, or pass "
                     f"strict=False to leave them unread.")


def _check_layers(path, t: fmt.Tensor, ts: list[fmt.Tensor], entries: dict[str, fmt.Entry],
                  strict: bool) -> None:
  """The per-layer tensors ``ts`` of a stacked leaf (``t``: a layer's tensor, named with
  ``{i}``) all present, of one shape and dtype, and no layer past the leaf's in the files
  (an error with ``strict``, else a warning)."""
  layers = (f"one tensor per layer, {t.name!r} for {{i}} = 0..{len(ts) - 1}" if ts else
            f"no tensor of {t.name!r} (its first dimension is 0)")
  missing = [u for u in ts if u.name not in entries]
  if missing:
    raise KeyError(
        f"the stacked leaf {t.leaf} ({len(ts)} layers) reads {layers}, and {path} lacks "
        f"layer(s) {[u.layer for u in missing][:8]}: {_listing([u.name for u in missing])}. "
        f"Check that rename= returns the files' per-layer names (the files hold "
        f"{_listing(sorted(entries))}).")
  for what, key in (("shape", lambda e: list(e.shape)), ("dtype", lambda e: e.code)):
    first = key(entries[ts[0].name]) if ts else None
    odd = [u for u in ts if key(entries[u.name]) != first]
    if odd:
      raise ValueError(
          f"the per-layer tensors of the stacked leaf {t.leaf} differ in {what}: "
          f"{ts[0].name!r} is {first} and "
          + ", ".join(f"{u.name!r} is {key(entries[u.name])}" for u in odd[:4])
          + f" (in {entries[odd[0].name].file}); the layers of a stacked leaf are one "
          f"{what}. Name tensors of one {what} with '{{i}}' in rename=.")
  extra = sorted((k, n) for n in entries
                 if (k := layer_names.layer_of(t.name, n)) is not None and k >= len(ts))
  if extra:
    msg = (f"{path} holds layers past the {len(ts)} of the stacked leaf {t.leaf} (its first "
           f"dimension), which reads {layers}: {_listing([n for _, n in extra])}.")
    if strict:
      raise ValueError(f"{msg} Give `like` a leaf of {extra[-1][0] + 1} layers, or pass "
                       f"strict=False to leave the others unread.")
    warnings.warn(f"{msg} They are left unread (strict=False).", stacklevel=4)


def _kind(dtype) -> str:
  return "float" if jnp.issubdtype(dtype, jnp.inexact) else "other"


def _reader(files: files_lib.OpenFiles, ts: list[fmt.Tensor], shape, dtype, boxes) -> Callable:
  """The callback of ``jax.make_array_from_callback``: one device's block. The distinct
  blocks of this process's devices (``boxes``) are read from the file together, each once
  (jax copies a block into each device that holds it); ``ts``: the leaf's tensor, or its
  layers' (`OpenFiles.read_layers`; none for a stack of no layers)."""
  wanted = [b for b in boxes if math.prod(y - x for x, y in b)]
  if not wanted:
    got = {}
  elif ts[0].layer is None:
    got = dict(zip(wanted, files.read(ts[0], wanted)))
  else:
    got = dict(zip(wanted, files.read_layers(ts, wanted)))

  def read(index) -> np.ndarray:
    b = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
    if b not in got:  # nothing to read
      return np.zeros(tuple(y - x for x, y in b), dtype)
    return got[b]
  return read


def _held(sharding, shape) -> list:
  """The distinct blocks of ``shape`` this process's devices hold, as boxes."""
  return sorted({tuple(s.indices(n)[:2] for s, n in zip(index, shape))
                 for index in sharding.addressable_devices_indices_map(shape).values()})


def _abstract_rest(rest) -> list[str]:
  return [jax.tree_util.keystr(p).removesuffix(".value")
          for p, x in jax.tree_util.tree_flatten_with_path(rest)[0]
          if isinstance(x, jax.ShapeDtypeStruct)]


def load_safetensors(path, like, *, step: ShardedTrainStep, rename: Callable | None = None,
                     cast: bool = False, strict: bool = True,
                     progress: bool | None = None,
                     max_header_bytes: int = fmt.MAX_HEADER) -> Any:
  """Reads safetensors files into parameters split the way ``step`` splits them.

  Each device reads only its own block of each tensor from the file, with positioned
  reads into the block's buffer: no process holds a whole leaf (a leaf no dimension of
  which divides over the data axes comes replicated; such leaves are small: biases, odd
  shapes), and the file is never mapped (one that shrinks during the load is an error
  naming it, not a crash). Each file is opened and its header parsed once per load, and
  checked as the safetensors library checks it (offsets within the file, no overlap, no
  gap, no name twice). Names, shapes and dtypes are checked against ``like`` from the
  headers before any data is read. Pass
  the result to ``step.init(..., donate=True)``: the state then keeps the loaded blocks
  themselves, without a second copy of the model.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, numpy as np, optax, zero_jax as zj
    >>> from safetensors.numpy import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> save_file({"dense.weight": np.ones((16, 8), np.float32)}, path)   # (out, in)
    >>> loss_fn = lambda p, b: jnp.mean((b @ p["dense"]["kernel"]) ** 2)
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3)
    >>> like = {"dense": {"kernel": jax.ShapeDtypeStruct((8, 16), jnp.float32)}}
    >>> params = zj.load_safetensors(path, like, step=step,
    ...     rename=lambda name: (name.replace("kernel", "weight"), True))
    >>> params["dense"]["kernel"].sharding.spec   # split over "data", as at stage 3
    P(None, 'data')
    >>> state = step.init(params, donate=True)   # the state keeps the loaded blocks

    Per-layer tensors, as the Hub names them, into a stacked leaf (``{i}``: the layer):

    >>> layers = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> save_file({f"h.{i}.weight": np.full((16, 8), i, np.float32) for i in range(2)}, layers)
    >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
    ...                                   stacked={"w": True})
    >>> params = zj.load_safetensors(layers, {"w": jax.ShapeDtypeStruct((2, 8, 16), jnp.float32)},
    ...                              step=step, rename=lambda name: ("h.{i}.weight", True))
    >>> params["w"].sharding.spec, float(params["w"][1, 0, 0])   # layers whole, rows split
    (P(None, 'data', None), 1.0)

  Args:
    path: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a
      directory holding either (a Hugging Face model directory).
    like: what ``step.init`` would be given, read as ``step.init`` reads it
      (`zero_jax.step.init.resolve`): the zero-argument init function
      (``lambda: Model(nnx.Rngs(0))``: traced, not run; a module's variables
      outside the step's ``wrt``, which the files do not hold, are made by it
      under ``jit``); the parameters' tree as arrays or
      ``jax.ShapeDtypeStruct``s; or an ``nnx.Module`` (also an abstract one
      from ``nnx.eval_shape``, when all its variables outside ``wrt`` are
      concrete or absent).
    step: the `ShardedTrainStep` the parameters are for (its mesh, stage and
      ``param_specs`` decide the split).
    rename: as for `export_safetensors`: a leaf's default name -> the tensor's
      name, or ``(name, transpose)``; a name holding ``{i}`` reads a stacked leaf
      (``stacked=``) from one tensor per layer (``{i}`` = 0, 1, ...), each device only
      its rows of each layer.
    cast: convert a tensor whose dtype differs from its leaf's in ``like`` (else
      that is an error): between floating dtypes (rounding; a finite value past the
      leaf dtype's range is an error naming the leaf), or between integer ones when
      every value fits (a value that does not is an error naming the leaf).
    strict: a tensor of the files that no leaf reads is an error; False leaves
      it unread.
    progress: a progress bar of the bytes read (``tqdm``, on process 0): True, False,
      or None for one when this process reads 1 GiB or more and ``tqdm`` is installed.
    max_header_bytes: the largest JSON header read (the safetensors library's cap,
      100 MiB, by default); a file with a larger one is refused, naming this option.

  Returns:
    ``like``'s tree of ``jax.Array``s (for a module, or a function returning
    one, the module with the loaded parameters), ready for ``step.init``.

  Raises:
    KeyError: a tensor a leaf needs is missing (for a stacked leaf read per layer: which
      layer).
    ValueError: a shape differs, an unexpected tensor (``strict``), a file is
      truncated (also while it is read), its header points past its end, its
      tensors' bytes overlap or leave gaps, it names a tensor twice, an index's
      ``weight_map`` places a tensor in another file than the one holding it or in a
      file outside the index's folder, a stacked leaf's layers differ in shape or
      dtype or the files hold layers past its first dimension (``strict``), or
      a value does not fit the leaf's dtype (``cast``: an integer, or a finite
      float past its range).
    TypeError: a dtype differs and ``cast`` is False, or a leaf of ``like`` is
      big-endian.
  """
  if not isinstance(step, ShardedTrainStep):
    raise TypeError(f"load_safetensors(path, like, step=...): step must be a ShardedTrainStep, "
                    f"got {type(step).__name__}.")
  progress_lib.check(progress, "load_safetensors")
  if isinstance(max_header_bytes, bool) or not isinstance(max_header_bytes, int) or \
      max_header_bytes < 1:
    raise ValueError(f"max_header_bytes must be a positive int (bytes), got "
                     f"{max_header_bytes!r}.")
  source = init_lib.resolve(like, None, step.wrt)  # what step.init makes of it, traced
  module, params = source.module, source.params
  abstract = _abstract_rest(source.model_state) if source.make is None else []
  if module is not None and abstract:
    raise ValueError(f"`like` is an abstract module whose variables outside wrt= have no "
                     f"values ({', '.join(abstract[:4])}); the files hold parameters only. "
                     f"Pass the function that makes the module (lambda: Model(nnx.Rngs(0))): "
                     f"those variables are then made by it, under jit.")
  leaves = _tensors(params, rename, cast, stacked_flags(step.leaf_options.stacked, params))
  with files_lib.open_files(path, max_header_bytes=max_header_bytes) as files:
    return _load(path, files, leaves, step, source, cast=cast, strict=strict,
                 progress=progress)


def _tensors(params, rename, cast: bool, stacked) -> list[tuple[fmt.Tensor, list]]:
  """The tensors each leaf of ``params`` reads, as the file holds them, in the dtype JAX
  gives the leaf (a 64-bit dtype is 32-bit with ``jax_enable_x64`` off: refused unless
  ``cast``, then read as a conversion, integers only when every value fits): per leaf,
  ``(its tensor, the tensors read)``: ``[tensor]``, or one per layer for a ``stacked``
  leaf named with ``{i}`` (the tensor then a layer's, named with ``{i}``)."""
  variable = nnx_lib.holds_variables(params)
  out = []
  for (p, x), s in zip(jax.tree_util.tree_flatten_with_path(params)[0], stacked):
    leaf = f"params{jax.tree_util.keystr(p)}"
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
      raise TypeError(f"`like` holds {leaf} = {x!r}, a {type(x).__name__}; every leaf must be "
                      f"an array or a jax.ShapeDtypeStruct (its shape and dtype are what the "
                      f"file's tensor must have).")
    shape = tuple(np.shape(x))
    if not np.dtype(x.dtype).isnative:
      order = "big" if np.dtype(x.dtype).byteorder == ">" else "little"
      raise TypeError(f"`like` holds {leaf} of dtype {np.dtype(x.dtype).str}: a {order}-endian "
                      f"{np.dtype(x.dtype).name}, not this machine's byte order. JAX arrays are "
                      f"in the machine's byte order (safetensors files are little-endian): "
                      f"give `like` native-order dtypes, x.astype(x.dtype.newbyteorder('=')).")
    dtype = _jax_dtype(x.dtype, leaf, cast)
    name, transpose = layer_names.apply_rename(
        rename, fmt.default_name(p, variable=variable), leaf, len(shape), stacked=s)
    layers = layer_names.LAYER in name
    part = shape[1:] if layers else shape
    t = fmt.Tensor(name, part[::-1] if transpose else part, dtype, leaf, transpose)
    out.append((t, layer_names.layer_tensors(t, shape[0]) if layers else [t]))
  fmt.check_unique([t for _, ts in out for t in ts])
  return out


def _jax_dtype(dtype, leaf: str, cast: bool) -> np.dtype:
  """The dtype of the array JAX makes of a leaf of ``dtype``; one that JAX makes narrower
  (64 bits with ``jax_enable_x64`` off) is refused unless ``cast``, naming the leaf."""
  got = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
  if got != np.dtype(dtype) and not cast:
    raise TypeError(f"`like` holds {leaf} of dtype {np.dtype(dtype).name}, which JAX makes "
                    f"{got.name} (jax_enable_x64 is off): the loaded leaf would not hold the "
                    f"file's {np.dtype(dtype).name} values. Turn on "
                    f"jax.config.update('jax_enable_x64', True), or pass cast=True to read "
                    f"the leaf as {got.name} (integers only when every value fits).")
  return got


def _load(path, files: files_lib.OpenFiles, leaves, step, source, *, cast, strict,
          progress) -> Any:
  """`load_safetensors` once the files are open and ``like`` read (``leaves``: `_tensors`)."""
  module, params = source.module, source.params
  for t, ts in leaves:
    if layer_names.LAYER in t.name:
      _check_layers(path, t, ts, files.entries, strict)
  _check(path, [u for _, ts in leaves for u in ts], files.entries, cast, strict)
  flat, treedef = jax.tree_util.tree_flatten(params)
  _, meta = st.build_meta(step.spec, step.optimizer, params, step.leaf_options)
  shardings = [st.sharding(step.spec, init_lib.input_spec(step.spec, layout))
               for layout in meta.param_layouts]
  shapes = [tuple(np.shape(x)) for x in flat]
  dtypes = [np.dtype(jax.dtypes.canonicalize_dtype(x.dtype)) for x in flat]  # as `_tensors`
  held = [_held(sh, shape) for sh, shape in zip(shardings, shapes)]
  mine = [sum(math.prod(b - a for a, b in box) for box in boxes) * dt.itemsize
          for dt, boxes in zip(dtypes, held)]  # a bar counts each distinct block once
  arrays = []
  with progress_lib.bytes_bar(sum(mine), f"load {path}", progress) as done:
    for (_, ts), sh, shape, dt, boxes, n in zip(leaves, shardings, shapes, dtypes, held, mine):
      arrays.append(jax.make_array_from_callback(shape, sh,
                                                 _reader(files, ts, shape, dt, boxes)))
      done(n)
  loaded = jax.tree.unflatten(treedef, arrays)
  if module is None:
    return loaded
  return nnx.merge(module.graphdef, loaded, init_lib.model_state(step.spec, meta, source))
