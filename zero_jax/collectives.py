"""Collectives over the data and replica axes for leaves in their `Layout`.

These run inside ``shard_map``. A gradient leaf enters as the device's full,
local gradient (logical shape, or the device's model block of it) and leaves
as this device's block of the storage view, summed over every device that
computes gradients: reduce-scattered over the data axes, then all-reduced
over the replica axes (only the 1/N block crosses them: hybrid sharding). A
parameter block enters `all_gather` and the full logical leaf leaves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zero_jax.layout import Layout, pad, unpad


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (its "vma")."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax >= 0.9: ManualAxisType(varying=...)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def _axes(names) -> tuple[str, ...]:
  return (names,) if isinstance(names, str) else tuple(names)


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
  out_dtype = out_dtype or jnp.promote_types(x.dtype, jnp.float32)
  wire = x.astype(comm_dtype or x.dtype)
  if layout.dim is None:
    out = jax.lax.psum(wire, data_axes + replica_axes)
  else:
    out = jax.lax.psum_scatter(pad(wire, layout), data_axes, scatter_dimension=layout.dim,
                               tiled=True)
    if replica_axes:
      out = jax.lax.psum(out, replica_axes)
  return out.astype(out_dtype)


def all_reduce(x: jax.Array, axes, *, comm_dtype=None, out_dtype=None) -> jax.Array:
  """Sum of ``x`` over ``axes`` (stage 1), in ``comm_dtype`` on the wire."""
  out_dtype = out_dtype or jnp.promote_types(x.dtype, jnp.float32)
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
  full = jax.lax.all_gather(block, _axes(data_axes), axis=layout.dim, tiled=True, to=to)
  return unpad(full, layout)
