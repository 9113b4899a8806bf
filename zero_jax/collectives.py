"""Reduce-scatter and all-gather over the data and replica axes for leaves in their `Layout`.

They run inside ``shard_map``: a gradient leaf becomes this device's summed block, a parameter
block becomes the full leaf. Small leaves of one dtype move together in buckets
(`plan_buckets`, `reduce_scatter_many`, `all_gather_many`), each device still getting exactly
its block of every leaf. Details: the docs' "How it works"."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zero_jax.layout import Layout, pad, unpad

DEFAULT_BUCKET_BYTES = 4 * 2**20


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (its "vma")."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax >= 0.9: ManualAxisType(varying=...)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def _axes(names) -> tuple[str, ...]:
  return (names,) if isinstance(names, str) else tuple(names)


def axes_size(names) -> int:
  """Devices along ``names`` (inside ``shard_map``)."""
  return math.prod(jax.lax.axis_size(a) for a in _axes(names))


def _wide(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def reduce_scatter(x: jax.Array, layout: Layout, data_axes, *, replica_axes=(),
                   comm_dtype=None, out_dtype=None) -> jax.Array:
  """Sum of ``x`` over the data and replica axes, each device keeping its block.

  The leaf is padded along ``layout.dim``, cast to ``comm_dtype`` for the
  wire, reduce-scattered over the data axes, all-reduced over the replica
  axes and cast to ``out_dtype`` (default: ``x``'s dtype promoted to at least
  float32). A layout replicated over the data axes (``dim=None``) is
  all-reduced over both.
  """
  data_axes, replica_axes = _axes(data_axes), _axes(replica_axes)
  out_dtype = out_dtype or _wide(x.dtype)
  wire = x.astype(comm_dtype or x.dtype)
  if layout.dim is None:
    out = jax.lax.psum(wire, data_axes + replica_axes)
  else:
    out = pad(wire, layout)
    if axes_size(data_axes) > 1:
      out = jax.lax.psum_scatter(out, data_axes, scatter_dimension=layout.dim, tiled=True)
    if replica_axes:
      out = jax.lax.psum(out, replica_axes)
  return out.astype(out_dtype)


def all_reduce(x: jax.Array, axes, *, comm_dtype=None, out_dtype=None) -> jax.Array:
  """Sum of ``x`` over ``axes`` (stage 1), in ``comm_dtype`` on the wire."""
  out_dtype = out_dtype or _wide(x.dtype)
  return jax.lax.psum(x.astype(comm_dtype or x.dtype), _axes(axes)).astype(out_dtype)


def all_gather(block: jax.Array, layout: Layout, data_axes, *,
               to: str = "invarying") -> jax.Array:
  """Rebuilds the full logical leaf from each device's storage block.

  ``to="invarying"`` gives a value every device agrees on (returnable with
  ``P()``); ``to="varying"`` is what a differentiated gather inside the loss
  needs, so that its transpose is a reduce-scatter of local gradients.
  """
  if layout.dim is None:
    return block
  if to == "varying" and axes_size(data_axes) == 1:
    return unpad(block, layout)
  full = jax.lax.all_gather(block, _axes(data_axes), axis=layout.dim, tiled=True, to=to)
  return unpad(full, layout)


# -------------------------------------------------------------------- buckets
def plan_buckets(layouts, dtypes, *, bucket_bytes: int, alone=None) -> tuple[tuple[int, ...], ...]:
  """Groups of leaf indices that move together (static; in leaf order).

  A leaf split over the data axes only, whose padded storage is smaller than
  ``bucket_bytes``, joins the open bucket of its dtype until that would pass
  ``bucket_bytes``; every other leaf (large, replicated, split over model
  axes, or marked in ``alone``: stacked layers) is a group of its own.
  ``bucket_bytes=0`` puts every leaf alone.
  """
  groups, open_ = [], {}
  alone = alone or [False] * len(layouts)
  for i, (l, dt) in enumerate(zip(layouts, dtypes)):
    size = math.prod(l.storage_shape) * jnp.dtype(dt).itemsize
    if l.dim is None or l.has_model or size >= bucket_bytes or alone[i]:
      groups.append([i])
      continue
    key = jnp.dtype(dt)
    g = open_.get(key)
    if g is None or g[1] + size > bucket_bytes:
      g = open_[key] = [[i], size]
      groups.append(g[0])
    else:
      g[0].append(i)
      g[1] += size
  return tuple(tuple(g) for g in groups)


def _rows(x: jax.Array, layout: Layout, n: int) -> jax.Array:
  """Padded storage view -> ``(n, block size)``: row ``d`` is device ``d``'s block."""
  return jnp.moveaxis(pad(x, layout), layout.dim, 0).reshape(n, -1)


def _block(row: jax.Array, layout: Layout, n: int) -> jax.Array:
  """One device's row -> its storage block (split dimension back in place)."""
  moved = [layout.padded // n] + [s for d, s in enumerate(layout.shape) if d != layout.dim]
  return jnp.moveaxis(row.reshape(moved), 0, layout.dim)


def _split(flat: jax.Array, sizes, axis: int) -> list:
  offsets = [sum(sizes[:i]) for i in range(1, len(sizes))]
  return jnp.split(flat, offsets, axis=axis)


def reduce_scatter_many(xs, layouts, groups, data_axes, *, replica_axes=(),
                        comm_dtype=None) -> list:
  """`reduce_scatter` of every leaf of ``xs``, one collective per group of ``groups``."""
  out = [None] * len(xs)
  n = axes_size(data_axes)
  for g in groups:
    if len(g) == 1 or n == 1:
      for i in g:
        out[i] = reduce_scatter(xs[i], layouts[i], data_axes, replica_axes=replica_axes,
                                comm_dtype=comm_dtype)
      continue
    wire = comm_dtype or xs[g[0]].dtype
    rows = [_rows(xs[i].astype(wire), layouts[i], n) for i in g]
    mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), _axes(data_axes),
                                scatter_dimension=0, tiled=True)[0]
    if replica_axes:
      mine = jax.lax.psum(mine, _axes(replica_axes))
    for i, piece in zip(g, _split(mine, [r.shape[1] for r in rows], 0)):
      out[i] = _block(piece, layouts[i], n).astype(_wide(xs[i].dtype))
  return out


def all_gather_many(blocks, layouts, groups, data_axes, *, to: str = "invarying") -> list:
  """`all_gather` of every block of ``blocks``, one collective per group of ``groups``."""
  out = [None] * len(blocks)
  n = axes_size(data_axes)
  for g in groups:
    if len(g) == 1 or n == 1:
      for i in g:
        out[i] = all_gather(blocks[i], layouts[i], data_axes, to=to)
      continue
    flat = [jnp.moveaxis(blocks[i], layouts[i].dim, 0).reshape(-1) for i in g]
    rows = jax.lax.all_gather(jnp.concatenate(flat), _axes(data_axes), axis=0, tiled=False,
                              to=to)
    for i, piece in zip(g, _split(rows, [f.shape[0] for f in flat], 1)):
      l = layouts[i]
      moved = [l.padded] + [s for d, s in enumerate(l.shape) if d != l.dim]
      out[i] = unpad(jnp.moveaxis(piece.reshape(moved), 0, l.dim), l)
  return out
