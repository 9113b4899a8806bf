"""Block quantization and the byte layout of quantized rows on the wire (ZeRO++).

An array is split into blocks of ``block_size`` elements, each stored as int8
values (or int4, two to a byte) with one float32 scale: symmetric absmax,
``scale = max|block| / qmax`` (qmax 127 or 7). A row may hold several leaves
(``segments``): blocks never span two of them, a leaf's last block is as short
as the leaf, and a leaf whose quantized bytes would not be fewer than its exact
bytes (`sends_quantized`) travels as its exact bytes in the same int8 buffer.

Finiteness is carried explicitly, never by a NaN propagating through a
reduction (XLA:CPU's vectorized ``max`` drops NaN): a block holding a NaN or an
infinity gets a NaN scale, and `dequantize` turns the whole block into NaN
where ``isfinite(scale)`` fails. The collectives are in `zero_jax.comm.quantize`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

QMAX = {8: 127, 4: 7}
MAX_BLOCK_SIZE = 2**16  # beyond it the scales save < 0.01% and the error only grows
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
    block_size: elements per scale: a positive int up to `MAX_BLOCK_SIZE`, even
      for ``bits=4``.
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
  if block_size > MAX_BLOCK_SIZE:
    raise ValueError(f"block_size={block_size} for {name}: at most {MAX_BLOCK_SIZE}. Beyond "
                     f"that the scales save under 0.01% of the bytes while the rounding error "
                     f"keeps growing with the block; use 256 to 4096.")
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
  """(..., L) -> q (..., nb, B) int8 (int4: (..., nb, B/2) uint8) and scales (..., nb) float32.

  A block holding a NaN or an infinity gets a NaN scale, decided by an explicit
  finiteness test per value: XLA:CPU's vectorized ``max`` can drop a NaN (and
  return the maximum of the other values, or -inf), so each non-finite value
  enters the block's maximum as +inf, which no ``max`` drops.
  """
  length = x.shape[-1]
  nb = max(1, -(-length // block_size))
  x = _pad_last(x.astype(jnp.float32), nb * block_size)
  x = x.reshape(*x.shape[:-1], nb, block_size)
  qmax = QMAX[bits]
  absmax = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf), axis=-1)
  finite = absmax < jnp.inf
  scale = jnp.where(finite, absmax / qmax, jnp.nan)
  ok = finite & (scale > 0)  # zero blocks: scale 0, values 0
  q = jnp.clip(jnp.round(x / jnp.where(ok, scale, 1.0)[..., None]), -qmax, qmax)
  q = jnp.where(ok[..., None], q, 0).astype(jnp.int8)  # clip: subnormal scales
  return (_pack4(q) if bits == 4 else q), scale


@_quantize_last.defjvp
def _no_derivative(block_size, bits, primals, tangents):
  raise TypeError(
      "zero_jax.comm.quantize: rounding to int8/int4 has a zero derivative almost everywhere, so "
      "differentiating through quantize, all_gather_rows, all_gather, psum_scatter_rows, "
      "psum_scatter or psum would silently give zero gradients. Differentiate gather_rows_vjp "
      "instead (its backward pass is the reduce-scatter you choose), or apply "
      "jax.lax.stop_gradient to the input if no gradient is wanted.")


def _dequantize_last(q: jax.Array, scale: jax.Array, length: int) -> jax.Array:
  """The inverse of `_quantize_last` (bits read off ``q``'s dtype): (..., length) float32.

  A block whose scale is not finite comes back NaN throughout: the scale is checked
  (``isfinite``) and set to NaN, and a product with NaN is NaN for every value, zeros
  included. (A ``where`` per value instead costs 2.5x the time on CPU.)
  """
  vals = (_unpack4(q) if q.dtype == jnp.uint8 else q).astype(jnp.float32)
  scale = jnp.where(jnp.isfinite(scale), scale, jnp.nan)
  x = vals * scale[..., None]
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


# ------------------------------------------------------------------- the wire
def quantized_bytes(size: int, *, block_size: int, bits: int = 8) -> int:
  """Bytes a segment of ``size`` elements takes on the wire when quantized.

  Its values (``bits`` each) and one float32 scale per block of ``block_size``
  (the last block as short as the segment):

    >>> quantized_bytes(1000, block_size=256), quantized_bytes(1000, block_size=256, bits=4)
    (1016, 516)
  """
  return _value_bytes(size, bits) + _SCALE_BYTES * -(-size // block_size)


def _value_bytes(size: int, bits: int) -> int:
  return -(-size * bits // 8)


def sends_quantized(size: int, *, itemsize: int, block_size: int, bits: int = 8,
                    parts: int = 1) -> bool:
  """The rule: a segment of ``size`` elements travels quantized only if that sends
  fewer bytes than sending it exactly (``itemsize`` bytes an element).

  ``parts``: the segment is first split into that many equal parts, each
  quantized on its own (`psum`: an all-reduce as a reduce-scatter then an
  all-gather over ``parts`` devices).

    >>> sends_quantized(3, itemsize=2, block_size=256)   # 3 + 4 bytes against 6
    False
    >>> sends_quantized(8, itemsize=2, block_size=256)   # 12 against 16
    True
  """
  chunk = -(-size // parts)
  return parts * quantized_bytes(chunk, block_size=block_size, bits=bits) < size * itemsize


class _Group(NamedTuple):
  """Pieces of one length that travel together: stacked, then quantized (or sent exactly)
  in one op."""
  members: tuple[int, ...]  # indices into the list of pieces
  size: int  # elements of each piece
  block: int  # elements per scale; 0: the pieces travel exactly


def _plan(sizes, dtype, block_size: int, bits: int) -> tuple[_Group, ...]:
  """The static wire layout of pieces of ``sizes`` elements: by the rule (`sends_quantized`)
  quantized or exact, pieces of equal length grouped (in order of first appearance)."""
  itemsize = jnp.dtype(dtype).itemsize
  groups: dict = {}
  for i, s in enumerate(sizes):
    if s:
      q = sends_quantized(s, itemsize=itemsize, block_size=block_size, bits=bits)
      groups.setdefault((s, block_size if q else 0), []).append(i)
  return tuple(_Group(tuple(m), s, b) for (s, b), m in groups.items())


def _stack(pieces, members) -> jax.Array:
  """The pieces ``members`` of ``pieces`` (each ``(..., L)``) as one ``(..., k, L)`` array."""
  return jnp.stack([pieces[i] for i in members], axis=-2)


def _encode(pieces, plan, bits: int, dtype) -> jax.Array:
  """Pieces ``(..., L_i)`` -> one ``(..., W)`` int8 wire: per group its values (each piece's
  padding dropped) and its scales, or its exact bytes in ``dtype``."""
  lead = pieces[0].shape[:-1]
  parts = []
  for g in plan:
    x = _stack(pieces, g.members)
    if g.block:
      q, scale = _quantize_last(x, g.block, bits)
      vals = jax.lax.bitcast_convert_type(q, jnp.int8).reshape(*x.shape[:-1], -1)
      parts.append(vals[..., :_value_bytes(g.size, bits)].reshape(*lead, -1))
      parts.append(jax.lax.bitcast_convert_type(scale, jnp.int8).reshape(*lead, -1))
    else:
      raw = jax.lax.bitcast_convert_type(x.astype(dtype), jnp.int8)
      parts.append(raw.reshape(*lead, -1))
  return jnp.concatenate(parts, axis=-1) if parts else jnp.zeros((*lead, 0), jnp.int8)


def _decode(w: jax.Array, plan, bits: int, dtype, n: int, finish=None) -> list:
  """The inverse of `_encode`: ``(..., W)`` int8 -> ``n`` pieces ``(..., L_i)`` float32
  (empty pieces for indices no group holds). ``finish`` maps each group's ``(..., k, L)``
  values before they are split into pieces (a sum over the leading axis)."""
  lead, pos = w.shape[:-1], 0
  finish = finish or (lambda x: x)
  out = [finish(jnp.zeros((*lead, 1, 0), jnp.float32))[..., 0, :]] * n
  take = lambda k: w[..., pos:pos + k]
  for g in plan:
    k = len(g.members)
    if g.block:
      nb, vb = -(-g.size // g.block), _value_bytes(g.size, bits)
      vals = take(k * vb).reshape(*lead, k, vb)
      pos += k * vb
      vals = _pad_last(vals, nb * g.block * bits // 8).reshape(*lead, k, nb, -1)
      scale = take(k * nb * _SCALE_BYTES).reshape(*lead, k, nb, _SCALE_BYTES)
      pos += k * nb * _SCALE_BYTES
      if bits == 4:
        vals = jax.lax.bitcast_convert_type(vals, jnp.uint8)
      x = _dequantize_last(vals, jax.lax.bitcast_convert_type(scale, jnp.float32), g.size)
    else:
      b = jnp.dtype(dtype).itemsize
      raw = take(k * g.size * b).reshape(*lead, k, g.size, *((b,) if b > 1 else ()))
      pos += k * g.size * b
      x = jax.lax.bitcast_convert_type(raw, dtype).astype(jnp.float32)
    x = finish(x)
    for j, i in enumerate(g.members):
      out[i] = x[..., j, :]
  return out


def _pad_last(x: jax.Array, size: int) -> jax.Array:
  """``x`` zero-padded along its last axis to ``size``."""
  extra = size - x.shape[-1]
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x
