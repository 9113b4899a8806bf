"""Global norm and clipping that stay correct when each device holds a slice.

Outside ``shard_map`` (``axis_name=None``) these equal ``optax.global_norm``
and ``optax.clip_by_global_norm``. Inside ``shard_map`` pass ``axis_name``:
squared norms of leaves that vary over the axis (slices) are summed across it;
leaves that every device holds whole (replicated) are counted once. Padding
must be zero, as `zero_jax.layout` makes it, so it adds nothing.

Example:
  >>> import jax.numpy as jnp, zero_jax as zj
  >>> clipped, norm = zj.clip_by_global_norm({"w": jnp.full(4, 3.0)}, 1.0)
  >>> float(norm)
  6.0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _varies_over(x, axis_name) -> bool:
  return axis_name in getattr(jax.typeof(x), "vma", frozenset())


def global_norm(tree, axis_name: str | None = None) -> jax.Array:
  """L2 norm of all elements of ``tree``, each element counted once."""
  sharded, whole = jnp.float32(0), jnp.float32(0)
  for x in jax.tree.leaves(tree):
    sq = jnp.sum(jnp.square(x.astype(jnp.float32)))
    if axis_name is not None and _varies_over(sq, axis_name):
      sharded = sharded + sq
    else:
      whole = whole + sq
  if axis_name is not None:
    sharded = jax.lax.psum(sharded, axis_name)
  return jnp.sqrt(sharded + whole)


def clip_by_global_norm(tree, max_norm: float, axis_name: str | None = None):
  """Scales ``tree`` so its global norm is at most ``max_norm``.

  Returns:
    ``(clipped_tree, norm)`` where ``norm`` is the norm before clipping.
    Same formula as ``optax.clip_by_global_norm``.
  """
  norm = global_norm(tree, axis_name)
  clip = norm >= max_norm
  def one(g):
    return jnp.where(clip, (g / norm.astype(g.dtype)) * max_norm, g).astype(g.dtype)
  return jax.tree.map(one, tree), norm
