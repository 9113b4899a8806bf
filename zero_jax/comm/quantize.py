"""The quantized collectives of ZeRO++ (qwZ, qgZ), inside ``shard_map``.

They work on the "rows" form of `zero_jax.comm.collectives`: row ``d`` belongs
to device ``d``, numbered row-major over the axes in mesh order, and travel in
the block format of `zero_jax.comm.blocks` (re-exported here: `quantize`,
`dequantize`). `all_gather_rows` is qwZ; `psum_scatter_rows` is qgZ: per hop
an all-to-all of quantized pieces, dequantized and summed in float32, never
in int8; `psum` is an all-reduce made of the two. Over axes of size 1 nothing
is sent and nothing is rounded. A row may hold several leaves (``segments=``);
a leaf too short to gain travels exactly, so a quantized collective never
sends more bytes than the exact one. A block holding a NaN or an infinity
arrives as NaN throughout, checked explicitly at every hop. Error bounds:
``docs/guides/zeropp_error.md``.

The bucket forms `gather_pieces`, `scatter_pieces` and `psum_pieces` take the
leaves as a list of arrays (one collective for all of them) and give a list
back: each leaf is quantized from where it lies and dequantized into its own
array, and only the int8 wire is concatenated.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zero_jax.comm.axes import as_tuple, axes_size, make_varying as _varying
from zero_jax.comm.blocks import (  # noqa: F401  (re-exported)
    MAX_BLOCK_SIZE, QMAX, _decode, _encode, _plan, check_quantizable, dequantize, quantize,
    quantized_bytes, sends_quantized)


# ----------------------------------------------------------------- collectives
def mesh_order(axes) -> tuple[str, ...]:
  """``axes`` sorted as the current (``shard_map``) mesh orders them."""
  order = tuple(jax.sharding.get_abstract_mesh().axis_names)
  axes = as_tuple(axes)
  return tuple(sorted(axes, key=order.index)) if set(axes) <= set(order) else axes


def join_pieces(pieces) -> jax.Array:
  """Pieces ``(..., L_i)`` as one ``(..., sum L_i)`` array."""
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)


def split_pieces(x: jax.Array, sizes) -> list:
  """The inverse of `join_pieces`: ``x`` cut along its last axis into pieces of ``sizes``."""
  sizes = [int(s) for s in sizes]
  if len(sizes) == 1:
    return [x]
  return jnp.split(x, [sum(sizes[:i]) for i in range(1, len(sizes))], axis=-1)


def _pieces(x: jax.Array, segments) -> list:
  """``x`` cut into pieces of the lengths ``segments`` (default: one), checked."""
  sizes = (x.shape[-1],) if segments is None else tuple(int(s) for s in segments)
  if sum(sizes) != x.shape[-1] or any(s < 0 for s in sizes):
    raise ValueError(f"segments={segments!r} must be lengths that add up to the row's "
                     f"{x.shape[-1]} elements.")
  return split_pieces(x, sizes)


def _dtype(pieces, *, block_size: int, bits: int):
  """The one dtype of ``pieces``, checked as `check_quantizable` checks a leaf's."""
  dtypes = {jnp.dtype(p.dtype) for p in pieces}
  if len(dtypes) != 1:
    raise TypeError(f"pieces of one collective must share a dtype; got {sorted(map(str, dtypes))}"
                    f": cast them first (the exact bytes travel in that dtype).")
  dtype = dtypes.pop()
  check_quantizable(dtype, block_size=block_size, bits=bits, name="pieces")
  return dtype


def all_gather_rows(row: jax.Array, axes, *, block_size: int, bits: int = 8,
                    to: str = "invarying", segments=None) -> jax.Array:
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
    segments: the lengths of the leaves the row holds, in order (default: one).
  """
  check_quantizable(row.dtype, block_size=block_size, bits=bits, name="row")
  return join_pieces(gather_pieces(_pieces(row, segments), axes, block_size=block_size,
                               bits=bits, to=to))


def gather_pieces(pieces, axes, *, block_size: int, bits: int = 8,
                  to: str = "invarying") -> list:
  """`all_gather_rows` of several leaves in one collective: pieces ``(L_i,)`` (one dtype)
  -> ``(n, L_i)`` float32 each."""
  axes = mesh_order(axes)
  if axes_size(axes) == 1:  # nothing on the wire: nothing rounded
    return [jax.lax.all_gather(p.astype(jnp.float32), axes, axis=0, to=to) for p in pieces]
  dtype = _dtype(pieces, block_size=block_size, bits=bits)
  plan = _plan([p.shape[-1] for p in pieces], dtype, block_size, bits)
  wire = jax.lax.all_gather(_encode(pieces, plan, bits, dtype), axes, axis=0, to=to)
  return _decode(wire, plan, bits, dtype, len(pieces))


def _check_hops(hops, n_rows: int) -> tuple[tuple[str, ...], ...]:
  hops = tuple(mesh_order(h) for h in ((hops,) if isinstance(hops, str) else hops))
  flat = [a for h in hops for a in h]
  if not hops or not all(hops) or len(set(flat)) != len(flat):
    raise ValueError(f"hops={hops!r}: expected a sequence of non-empty tuples of mesh axis "
                     f"names, each axis in one hop, e.g. (('data',), ('replica',)).")
  n = axes_size(flat)
  if n_rows != n:
    raise ValueError(f"psum_scatter_rows got {n_rows} rows, but the hops' axes {tuple(flat)} "
                     f"span {n} devices: pass one row per device (rows of shape ({n}, L)).")
  return hops


def psum_scatter_rows(rows: jax.Array, hops, *, block_size: int, bits: int = 8,
                      segments=None) -> jax.Array:
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
    segments: the lengths of the leaves each row holds, in order (default: one).

  Returns:
    ``(L,)`` float32, varying over the hops' axes.
  """
  check_quantizable(rows.dtype, block_size=block_size, bits=bits, name="rows")
  return join_pieces(scatter_pieces(_pieces(rows, segments), hops, block_size=block_size,
                                bits=bits))


def scatter_pieces(pieces, hops, *, block_size: int, bits: int = 8) -> list:
  """`psum_scatter_rows` of several leaves in one collective per hop: pieces ``(n, L_i)``
  (one dtype) -> this device's summed ``(L_i,)`` float32 each."""
  hops = _check_hops(hops, pieces[0].shape[0])
  dtype = _dtype(pieces, block_size=block_size, bits=bits)
  names = list(mesh_order([a for h in hops for a in h]))
  dims = [jax.lax.axis_size(a) for a in names]
  xs = [_varying(p.astype(jnp.float32), names).reshape(dims + [p.shape[-1]]) for p in pieces]
  plan = _plan([p.shape[-1] for p in pieces], dtype, block_size, bits)
  for hop in hops:
    k, m = len(hop), axes_size(hop)
    xs = [jnp.moveaxis(x, [names.index(a) for a in hop], list(range(k))) for x in xs]
    xs = [x.reshape((m,) + x.shape[k:]) for x in xs]
    names = [a for a in names if a not in hop]
    if m > 1:
      wire = jax.lax.all_to_all(_encode(xs, plan, bits, dtype), hop, 0, 0)
      xs = _decode(wire, plan, bits, dtype, len(xs), finish=_sum_rows)  # in float32
    else:
      xs = [x[0] for x in xs]
  return xs


def _sum_rows(x: jax.Array) -> jax.Array:
  """``x.sum(axis=0)`` as a tree of elementwise adds of the (few) rows.

  XLA:CPU hands a lone ``reduce`` over a leading axis to YNNPACK, which takes
  40x the time of the adds (16 ms against 0.4 ms for 4 x 262656 float32); adds
  also fuse with the dequantization that produces the rows.
  """
  rows = [x[i] for i in range(x.shape[0])]
  while len(rows) > 1:
    rows = [a + b for a, b in zip(rows[0::2], rows[1::2])] + rows[len(rows) // 2 * 2:]
  return rows[0]


def psum(row: jax.Array, axes, *, block_size: int, bits: int = 8, segments=None) -> jax.Array:
  """The sum of ``row`` over ``axes`` (an all-reduce), quantized where that sends less.

  Each segment is cut into one part per device; a segment whose parts send
  fewer bytes quantized (`sends_quantized` with ``parts``) is reduce-scattered
  (`psum_scatter_rows`) and all-gathered (`all_gather_rows`), rounded once
  each way; the others are summed by the exact ``lax.psum``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda r: psum(r[0], "data", block_size=64, segments=(3, 509)),
    ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
    >>> out = f(jnp.ones((jax.device_count(), 512)))
    >>> bool((out == jax.device_count()).all())
    True

  Args:
    row: ``(L,)`` floating.
    axes: the mesh axes to sum over (taken in mesh order).
    block_size: elements per scale.
    bits: 8 or 4.
    segments: the lengths of the leaves the row holds, in order (default: one).

  Returns:
    ``(L,)`` float32, the same on every device of ``axes``.
  """
  check_quantizable(row.dtype, block_size=block_size, bits=bits, name="row")
  return join_pieces(psum_pieces(_pieces(row, segments), axes, block_size=block_size, bits=bits))


def psum_pieces(pieces, axes, *, block_size: int, bits: int = 8) -> list:
  """`psum` of several leaves: pieces ``(L_i,)`` (one dtype) -> ``(L_i,)`` float32 each, the
  quantized ones in one reduce-scatter and one all-gather, the others in one ``lax.psum``."""
  axes = mesh_order(axes)
  n, dtype = axes_size(axes), _dtype(pieces, block_size=block_size, bits=bits)
  quant = [n > 1 and p.shape[-1] > 0 and sends_quantized(
      p.shape[-1], itemsize=dtype.itemsize, block_size=block_size, bits=bits, parts=n)
      for p in pieces]
  out = [p.astype(jnp.float32) for p in pieces]
  exact = [i for i, q in enumerate(quant) if not q and pieces[i].shape[-1]]
  if exact:
    summed = jax.lax.psum(join_pieces([pieces[i] for i in exact]), axes).astype(jnp.float32)
    out = _put(out, exact, _pieces(summed, [pieces[i].shape[-1] for i in exact]))
  idx = [i for i, q in enumerate(quant) if q]
  if idx:
    sizes = [pieces[i].shape[-1] for i in idx]
    rows = [jnp.pad(pieces[i], (0, -(-s // n) * n - s)).reshape(n, -1) for i, s in zip(idx, sizes)]
    mine = scatter_pieces(rows, (axes,), block_size=block_size, bits=bits)
    full = gather_pieces(mine, axes, block_size=block_size, bits=bits)  # the float32 sums
    out = _put(out, idx, [f.reshape(-1)[:s] for f, s in zip(full, sizes)])
  return out


def _put(out: list, idx, values) -> list:
  out = list(out)
  for i, v in zip(idx, values):
    out[i] = v
  return out


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
  n = axes_size([a for h in ((hops,) if isinstance(hops, str) else hops) for a in as_tuple(h)])
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
    if sorted(a for h in hops for a in as_tuple(h)) != sorted(axes):
      raise ValueError(f"hops={hops!r} must cover exactly the gathered axes {axes}: the "
                       f"gradient of a gather over them is a reduce-scatter over them.")
    hops = _check_hops(hops, axes_size(axes))
  elif hops is not None or grad_bits != bits:
    raise ValueError("hops= and grad_bits= apply to backward='quantized' only.")
  spec = _Gather(axes, int(block_size), bits, hops if backward == "quantized" else None,
                 grad_bits)
  return _gather(_varying(row, axes), spec)
