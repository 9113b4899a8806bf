"""Collectives over the data axis for leaves in their `Layout`.

These run inside ``shard_map``. A gradient leaf enters as the device's full,
local gradient (logical shape) and leaves as this device's block of the
storage view; a parameter block enters and the full logical leaf leaves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zero_jax.layout import Layout, pad, unpad


def reduce_scatter(x: jax.Array, layout: Layout, axis_name: str, *,
                   comm_dtype=None, out_dtype=jnp.float32) -> jax.Array:
  """Sum of ``x`` over the axis, each device keeping its block.

  The leaf is padded along ``layout.dim``, cast to ``comm_dtype`` for the
  wire, reduce-scattered and cast to ``out_dtype``. A replicated layout
  (``dim=None``) is all-reduced instead.
  """
  wire = x.astype(comm_dtype or x.dtype)
  if layout.dim is None:
    return jax.lax.psum(wire, axis_name).astype(out_dtype)
  wire = pad(wire, layout)
  out = jax.lax.psum_scatter(wire, axis_name, scatter_dimension=layout.dim, tiled=True)
  return out.astype(out_dtype)


def all_gather(block: jax.Array, layout: Layout, axis_name: str, *,
               to: str = "invarying") -> jax.Array:
  """Rebuilds the full logical leaf from each device's storage block.

  ``to="invarying"`` gives a value every device agrees on (returnable with
  ``P()``); ``to="varying"`` is what a differentiated gather inside the loss
  needs, so that its transpose is a reduce-scatter of local gradients.
  """
  if layout.dim is None:
    return block
  full = jax.lax.all_gather(block, axis_name, axis=layout.dim, tiled=True, to=to)
  return unpad(full, layout)
