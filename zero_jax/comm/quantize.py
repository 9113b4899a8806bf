"""Block quantization and the quantized collectives of ZeRO++ (qwZ, qgZ).

An array is flattened, padded to whole blocks of ``block_size`` elements, and
each block is stored as int8 values (or int4, two to a byte) with one float32
scale: symmetric absmax, ``scale = max|block| / qmax`` (qmax 127 or 7). The
collectives run inside ``shard_map`` on the "rows" form of
`zero_jax.comm.collectives`: row ``d`` belongs to device ``d``, numbered row-major
over the axes in mesh order. Values and scales travel as one int8 buffer.
`all_gather_rows` is qwZ; `psum_scatter_rows` is qgZ: per hop an all-to-all of
quantized pieces, dequantized and summed in float32, never in int8. Over axes
of size 1 nothing is sent and nothing is rounded. A block holding a NaN or an
infinity dequantizes to NaN throughout, so a non-finite value never becomes
finite. Error bounds: ``docs/guides/zeropp_error.md``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.comm.axes import make_varying as _varying

QMAX = {8: 127, 4: 7}
_SCALE_BYTES = 4  # float32 scales, bit-cast to 4 int8 bytes on the wire


def check_quantizable(dtype, *, block_size, bits, name: str = "the array") -> None:
  """Raises a clear error unless ``dtype``, ``block_size`` and ``bits`` can be quantized.

  Call it at build time with the leaf's ``jax.tree_util.keystr`` path as ``name``.

  Example:
    >>> import jax.numpy as jnp
    >>> check_quantizable(jnp.bfloat16, block_size=256, bits=8, name="params['w']")
    >>> check_quantizable(jnp.int32, block_size=256, bits=8, name="params['step']")
    Traceback (most recent call last):
    ...
    TypeError: quantization of a non-float leaf: params['step'] has dtype int32; ...

  Args:
    dtype: the dtype of the array to quantize.
    block_size: elements per scale: a positive int, even for ``bits=4``.
    bits: 8 (int8) or 4 (int4, two values a byte).
    name: what to call the array in the message.
  """
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"quantization of a non-float leaf: {name} has dtype {jnp.dtype(dtype)}; quantization "
        f"needs a floating leaf (float32, bfloat16, float16). Leave it out of the quantized "
        f"collectives (move it exactly) or cast it to a float dtype.")
  if bits not in QMAX:
    raise ValueError(f"bits={bits!r} for {name}: expected 8 (int8) or 4 (int4, two values a "
                     f"byte).")
  if (isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer))
      or block_size <= 0):
    raise ValueError(f"block_size={block_size!r} for {name}: expected a positive int (the "
                     f"elements that share one scale), e.g. 256 or 2048.")
  if bits == 4 and block_size % 2:
    raise ValueError(f"block_size={block_size} for {name}: int4 packs two values a byte, so "
                     f"block_size must be even; use {block_size + 1}.")


# ----------------------------------------------------------- block quantization
def _pack4(q: jax.Array) -> jax.Array:
  """int8 values in [-7, 7] (..., B) -> (..., B/2) uint8, two nibbles a byte."""
  u = jax.lax.bitcast_convert_type(q, jnp.uint8) & 0xF
  return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack4(p: jax.Array) -> jax.Array:
  """The inverse of `_pack4`, sign-extending each nibble."""
  nib = jnp.stack([p & 0xF, p >> 4], axis=-1).astype(jnp.int8)
  nib = jnp.where(nib >= 8, nib - 16, nib).astype(jnp.int8)
  return nib.reshape(*p.shape[:-1], 2 * p.shape[-1])


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _quantize_last(x: jax.Array, block_size: int, bits: int):
  """(..., L) -> q (..., nb, B) int8 (int4: (..., nb, B/2) uint8) and scales (..., nb) float32."""
  length = x.shape[-1]
  nb = max(1, -(-length // block_size))
  x = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, nb * block_size - length)])
  x = x.reshape(*x.shape[:-1], nb, block_size)
  qmax = QMAX[bits]
  absmax = jnp.max(jnp.abs(x), axis=-1)
  scale = jnp.where(jnp.isfinite(absmax), absmax / qmax, jnp.nan)
  ok = jnp.isfinite(scale) & (scale > 0)  # zero blocks: scale 0, values 0
  q = jnp.clip(jnp.round(x / scale[..., None]), -qmax, qmax)  # clip: subnormal scales
  q = jnp.where(ok[..., None], q, 0).astype(jnp.int8)
  return (_pack4(q) if bits == 4 else q), scale


@_quantize_last.defjvp
def _no_derivative(block_size, bits, primals, tangents):
  raise TypeError(
      "zero_jax.comm.quantize: rounding to int8/int4 has a zero derivative almost everywhere, so "
      "differentiating through quantize, all_gather_rows, all_gather, psum_scatter_rows or "
      "psum_scatter would silently give zero gradients. Differentiate gather_rows_vjp "
      "instead (its backward pass is the reduce-scatter you choose), or apply "
      "jax.lax.stop_gradient to the input if no gradient is wanted.")


def _dequantize_last(q: jax.Array, scale: jax.Array, length: int) -> jax.Array:
  """The inverse of `_quantize_last` (bits read off ``q``'s dtype): (..., length) float32."""
  vals = _unpack4(q) if q.dtype == jnp.uint8 else q
  x = vals.astype(jnp.float32) * scale[..., None]
  return x.reshape(*x.shape[:-2], -1)[..., :length]


def quantize(x: jax.Array, *, block_size: int, bits: int = 8):
  """Block-quantizes the flattened ``x``: one float32 scale per ``block_size`` elements.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.array([64.0, -127.0, 32.0, 0.0, 0.5])
    >>> q, scale = quantize(x, block_size=4)
    >>> q.shape, q.dtype, scale.shape
    ((2, 4), dtype('int8'), (2,))
    >>> dequantize(q, scale, shape=x.shape).tolist()  # exactly representable here
    [64.0, -127.0, 32.0, 0.0, 0.5]

  Args:
    x: a floating array of any shape (padded with zeros to whole blocks).
    block_size: elements per scale.
    bits: 8 or 4.

  Returns:
    ``(q, scale)``: ``q`` of shape ``(blocks, block_size)`` int8 (bits=4:
    ``(blocks, block_size // 2)`` uint8, two values a byte), ``scale`` of
    shape ``(blocks,)`` float32 (0 for an all-zero block, NaN for a block
    holding a non-finite value).
  """
  check_quantizable(x.dtype, block_size=block_size, bits=bits, name="x")
  return _quantize_last(x.reshape(-1), block_size, bits)


def dequantize(q: jax.Array, scale: jax.Array, *, shape, dtype=jnp.float32) -> jax.Array:
  """The array `quantize` was given (to within its error), with ``shape`` and ``dtype``.

  Example:
    >>> import jax.numpy as jnp
    >>> q, scale = quantize(jnp.full((2, 3), 7.0), block_size=2, bits=4)
    >>> dequantize(q, scale, shape=(2, 3), dtype=jnp.bfloat16).tolist()
    [[7.0, 7.0, 7.0], [7.0, 7.0, 7.0]]
  """
  shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
  return _dequantize_last(q, scale, math.prod(shape)).reshape(shape).astype(dtype)


def _to_wire(q: jax.Array, scale: jax.Array) -> jax.Array:
  """Values and scales as one int8 buffer (..., nb, B(/2) + 4)."""
  s = jax.lax.bitcast_convert_type(scale, jnp.int8)  # (..., nb, 4)
  return jnp.concatenate([jax.lax.bitcast_convert_type(q, jnp.int8), s], axis=-1)


def _from_wire(w: jax.Array, bits: int):
  q = w[..., :-_SCALE_BYTES]
  scale = jax.lax.bitcast_convert_type(w[..., -_SCALE_BYTES:], jnp.float32)
  return (jax.lax.bitcast_convert_type(q, jnp.uint8) if bits == 4 else q), scale


# ----------------------------------------------------------------- collectives
def _axes(names) -> tuple[str, ...]:
  return (names,) if isinstance(names, str) else tuple(names)


def mesh_order(axes) -> tuple[str, ...]:
  """``axes`` sorted as the current (``shard_map``) mesh orders them."""
  order = tuple(jax.sharding.get_abstract_mesh().axis_names)
  axes = _axes(axes)
  return tuple(sorted(axes, key=order.index)) if set(axes) <= set(order) else axes


def _size(axes) -> int:
  return math.prod(jax.lax.axis_size(a) for a in axes)


def all_gather_rows(row: jax.Array, axes, *, block_size: int, bits: int = 8,
                    to: str = "invarying") -> jax.Array:
  """Every device's ``row``, int8 (int4) on the wire: ``(n, L)`` float32 (qwZ).

  Row ``d`` is device ``d``'s ``row`` (row-major over ``axes`` in mesh order),
  each dequantized to within half a quantization step of its block.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda r: all_gather_rows(r[0], "data", block_size=4),
    ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
    >>> x = jnp.tile(jnp.array([[127.0, -64.0, 2.0, 0.0]]), (jax.device_count(), 1))
    >>> bool((f(x) == x).all())  # exactly representable: integers up to 127
    True

  Args:
    row: this device's row, shape ``(L,)``, floating.
    axes: the mesh axis name (or tuple of names) to gather over.
    block_size: elements per scale.
    bits: 8 or 4.
    to: ``"invarying"`` (returnable with ``P()``) or ``"varying"``.
  """
  check_quantizable(row.dtype, block_size=block_size, bits=bits, name="row")
  axes = mesh_order(axes)
  if _size(axes) == 1:  # nothing on the wire: nothing rounded
    return jax.lax.all_gather(row.astype(jnp.float32), axes, axis=0, to=to)
  wire = jax.lax.all_gather(_to_wire(*_quantize_last(row, block_size, bits)), axes, axis=0,
                            to=to)
  return _dequantize_last(*_from_wire(wire, bits), row.shape[-1])


def _check_hops(hops, n_rows: int) -> tuple[tuple[str, ...], ...]:
  hops = tuple(mesh_order(h) for h in ((hops,) if isinstance(hops, str) else hops))
  flat = [a for h in hops for a in h]
  if not hops or not all(hops) or len(set(flat)) != len(flat):
    raise ValueError(f"hops={hops!r}: expected a sequence of non-empty tuples of mesh axis "
                     f"names, each axis in one hop, e.g. (('data',), ('replica',)).")
  n = _size(flat)
  if n_rows != n:
    raise ValueError(f"psum_scatter_rows got {n_rows} rows, but the hops' axes {tuple(flat)} "
                     f"span {n} devices: pass one row per device (rows of shape ({n}, L)).")
  return hops


def psum_scatter_rows(rows: jax.Array, hops, *, block_size: int, bits: int = 8) -> jax.Array:
  """This device's row of the sum of ``rows`` over the hops' axes, quantized per hop (qgZ).

  Equals ``lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)[0]``
  with ``axes`` the hops' axes in mesh order, to within the quantization
  error. Each hop quantizes the pieces bound for each peer, all-to-alls them
  and sums the dequantized pieces in float32; the next hop carries only the
  partial sums (1/n of the data after a hop over n devices).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(
    ...     lambda r: psum_scatter_rows(r, [("data",)], block_size=4)[None],
    ...     mesh=mesh, in_specs=P(), out_specs=P("data"))
    >>> rows = jnp.ones((n, 4))  # the same rows on every device
    >>> bool((f(rows) == n).all())
    True

  Args:
    rows: ``(n, L)`` floating, row ``d`` bound for device ``d``.
    hops: a sequence of axis-name tuples, in the order the data moves,
      e.g. ``(("data",), ("replica",))``: within a host, then across.
    block_size: elements per scale.
    bits: 8 or 4.

  Returns:
    ``(L,)`` float32, varying over the hops' axes.
  """
  check_quantizable(rows.dtype, block_size=block_size, bits=bits, name="rows")
  hops = _check_hops(hops, rows.shape[0])
  names = list(mesh_order([a for h in hops for a in h]))
  x = _varying(rows.astype(jnp.float32), names)
  x = x.reshape([jax.lax.axis_size(a) for a in names] + [rows.shape[-1]])
  for hop in hops:
    k = len(hop)
    x = jnp.moveaxis(x, [names.index(a) for a in hop], list(range(k)))
    names = [a for a in names if a not in hop]
    m = _size(hop)
    x = x.reshape((m,) + x.shape[k:])
    if m > 1:
      wire = jax.lax.all_to_all(_to_wire(*_quantize_last(x, block_size, bits)), hop, 0, 0)
      x = _dequantize_last(*_from_wire(wire, bits), rows.shape[-1])
    x = jnp.sum(x, axis=0)  # in float32
  return x


# --------------------------------------------------------- any-dimension forms
def all_gather(x: jax.Array, axes, *, axis: int = 0, block_size: int, bits: int = 8,
               to: str = "invarying") -> jax.Array:
  """`all_gather_rows` of any block: ``lax.all_gather(x, axes, axis=axis, tiled=True)``.

  ``axes`` are taken in mesh order (as `all_gather_rows` does).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda b: all_gather(b, "data", axis=1, block_size=8),
    ...                   mesh=mesh, in_specs=P(None, "data"), out_specs=P())
    >>> x = jnp.ones((3, 2 * jax.device_count()))
    >>> bool((f(x) == x).all())  # exactly representable: integers up to 127
    True
  """
  moved = jnp.moveaxis(x, axis, 0)
  rows = all_gather_rows(moved.reshape(-1), axes, block_size=block_size, bits=bits, to=to)
  full = rows.reshape((rows.shape[0] * moved.shape[0],) + moved.shape[1:])
  return jnp.moveaxis(full, 0, axis)


def psum_scatter(x: jax.Array, hops, *, scatter_dimension: int = 0, block_size: int,
                 bits: int = 8) -> jax.Array:
  """`psum_scatter_rows` of any array: ``lax.psum_scatter(x, axes, tiled=True)``.

  ``axes`` are the hops' axes in mesh order; ``x.shape[scatter_dimension]``
  must be a multiple of the devices they span (pad first). Float32 result.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda g: psum_scatter(g, [("data",)], scatter_dimension=1,
    ...                                          block_size=8),
    ...                   mesh=mesh, in_specs=P(), out_specs=P(None, "data"))
    >>> bool((f(jnp.ones((3, 2 * n))) == n).all())
    True
  """
  n = _size([a for h in ((hops,) if isinstance(hops, str) else hops) for a in _axes(h)])
  if x.ndim == 0 or x.shape[scatter_dimension] % n:
    raise ValueError(f"psum_scatter of shape {x.shape} along dimension {scatter_dimension}: "
                     f"its size must be a multiple of the {n} devices of the hops' axes; pad "
                     f"it first (zero_jax.comm.layout.pad).")
  moved = jnp.moveaxis(x, scatter_dimension, 0)
  mine = psum_scatter_rows(moved.reshape(n, -1), hops, block_size=block_size, bits=bits)
  return jnp.moveaxis(mine.reshape((moved.shape[0] // n,) + moved.shape[1:]), 0,
                      scatter_dimension)


# ------------------------------------------------------- differentiable gather
class _Gather(NamedTuple):
  """The static description of a differentiable quantized gather."""
  axes: tuple
  block_size: int
  bits: int
  hops: tuple | None  # None: the exact reduce-scatter on the way back
  grad_bits: int


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather(row: jax.Array, spec: _Gather) -> jax.Array:
  return all_gather_rows(row, spec.axes, block_size=spec.block_size, bits=spec.bits,
                         to="varying")


def _gather_fwd(row, spec):
  return _gather(row, spec), jnp.zeros((), row.dtype)


def _gather_bwd(spec, zero, ct):
  if spec.hops is None:
    g = jax.lax.psum_scatter(ct, spec.axes, scatter_dimension=0, tiled=True)[0]
  else:
    g = psum_scatter_rows(ct, spec.hops, block_size=spec.block_size, bits=spec.grad_bits)
  return (g.astype(zero.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_rows_vjp(row: jax.Array, axes, *, block_size: int, bits: int = 8,
                    backward: str = "exact", hops=None, grad_bits: int | None = None
                    ) -> jax.Array:
  """`all_gather_rows` (``to="varying"``) whose gradient is a reduce-scatter you choose.

  For stage 3 inside ``shard_map``: the forward pass sees the quantized rows
  (qwZ); ``jax.grad`` gives this device the sum over ``axes`` of every
  device's cotangent of its row, by the exact ``lax.psum_scatter``
  (``backward="exact"``) or by `psum_scatter_rows` (``"quantized"``: qgZ).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> def grad(r):
    ...   loss = lambda r: gather_rows_vjp(r, "data", block_size=4).sum()
    ...   return jax.grad(loss)(r[0])[None]
    >>> f = jax.shard_map(grad, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> g = f(jnp.ones((jax.device_count(), 4)))
    >>> bool((g == jax.device_count()).all())  # every device's ones, summed
    True

  Args:
    row: this device's row ``(L,)``, floating.
    axes: the mesh axes to gather over (taken in mesh order).
    block_size: elements per scale (forward and backward).
    bits: 8 or 4, the forward gather.
    backward: ``"exact"`` or ``"quantized"``.
    hops: with ``"quantized"``: the hops of the reduce-scatter, covering
      exactly ``axes`` (default: one hop over ``axes``).
    grad_bits: with ``"quantized"``: bits of the gradient (default ``bits``).

  Returns:
    ``(n, L)`` float32, varying over ``axes``.
  """
  check_quantizable(row.dtype, block_size=block_size, bits=bits, name="row")
  axes = mesh_order(axes)
  if backward not in ("exact", "quantized"):
    raise ValueError(f"backward={backward!r}: expected 'exact' or 'quantized'.")
  grad_bits = bits if grad_bits is None else grad_bits
  if backward == "quantized":
    check_quantizable(row.dtype, block_size=block_size, bits=grad_bits, name="row's gradient")
    hops = (axes,) if hops is None else hops
    if sorted(a for h in hops for a in _axes(h)) != sorted(axes):
      raise ValueError(f"hops={hops!r} must cover exactly the gathered axes {axes}: the "
                       f"gradient of a gather over them is a reduce-scatter over them.")
    hops = _check_hops(hops, _size(axes))
  elif hops is not None or grad_bits != bits:
    raise ValueError("hops= and grad_bits= apply to backward='quantized' only.")
  spec = _Gather(axes, int(block_size), bits, hops if backward == "quantized" else None,
                 grad_bits)
  return _gather(_varying(row, axes), spec)
