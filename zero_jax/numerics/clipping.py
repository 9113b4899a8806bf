"""Global norm and clipping that stay correct when each device holds a slice.

Outside ``shard_map`` (``axis_name=None``) these equal ``optax.tree.norm``
and ``optax.clip_by_global_norm``. Inside ``shard_map`` pass ``axis_name``:
squared norms of leaves that vary over the axis (slices) are summed across it;
leaves that every device holds whole (replicated) are counted once. Which is
which comes from jax's tracking of device variance, so the ``shard_map`` must
have ``check_vma=True`` (the default; otherwise a ValueError says so). Padding
must be zero, as `zero_jax.comm.layout` makes it, so it adds nothing.

Example:
  >>> import jax.numpy as jnp, zero_jax as zj
  >>> clipped, norm = zj.clip_by_global_norm({"w": jnp.full(4, 3.0)}, 1.0)
  >>> float(norm)
  6.0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zero_jax.comm.axes import varying_axes


def _check_tracks_variance(axis_name) -> None:
  """Raises unless the enclosing shard_map tracks which values vary over the axis."""
  if axis_name not in varying_axes(jax.lax.axis_index(axis_name)):
    raise ValueError(
        f"global_norm(..., axis_name={axis_name!r}) tells a device's slice of a leaf from a "
        f"replicated leaf by whether it varies over the axis, which jax only tracks under "
        f"jax.shard_map(..., check_vma=True) (the default); this shard_map has "
        f"check_vma=False. Drop check_vma=False, or psum the squared norms of the sliced "
        f"leaves yourself.")


def global_norm(tree, axis_name: str | None = None) -> jax.Array:
  """L2 norm of all elements of ``tree``, each element counted once.

  Example (inside ``shard_map``, ``w`` split over "data", ``b`` replicated):
    >>> import jax, jax.numpy as jnp, zero_jax as zj
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    >>> norm = jax.shard_map(lambda w, b: zj.global_norm({"w": w, "b": b}, "data"),
    ...                      mesh=mesh, in_specs=(P("data"), P()), out_specs=P())
    >>> round(float(norm(jnp.ones(2 * n), jnp.ones(3))) ** 2) == 2 * n + 3  # b counted once
    True

  Args:
    tree: a pytree of arrays (any float dtype; squares are summed in float32).
    axis_name: inside ``shard_map`` (with ``check_vma=True``, the default), the
      axis the slices are spread over; ``None`` outside.

  Returns:
    A float32 scalar, the same on every device.
  """
  if axis_name is not None:
    _check_tracks_variance(axis_name)
  sharded, whole = jnp.float32(0), jnp.float32(0)
  for x in jax.tree.leaves(tree):
    sq = jnp.sum(jnp.square(x.astype(jnp.float32)))
    if axis_name is not None and axis_name in varying_axes(sq):
      sharded = sharded + sq
    else:
      whole = whole + sq
  if axis_name is not None:
    sharded = jax.lax.psum(sharded, axis_name)
  return jnp.sqrt(sharded + whole)


def clip_by_global_norm(tree, max_norm: float, axis_name: str | None = None):
  """Scales ``tree`` so its global norm is at most ``max_norm``.

  Same formula as ``optax.clip_by_global_norm``: leaves are unchanged when the
  norm is below ``max_norm``, else multiplied by ``max_norm / norm``.

  Example:
    >>> import jax.numpy as jnp, zero_jax as zj
    >>> clipped, norm = zj.clip_by_global_norm({"w": jnp.array([3.0, 4.0])}, 1.0)
    >>> clipped["w"].tolist(), float(norm)
    ([0.6000000238418579, 0.800000011920929], 5.0)

  Args:
    tree: a pytree of arrays, or inside ``shard_map`` of per-device slices
      (zero padding allowed) and replicated leaves.
    max_norm: the largest norm allowed.
    axis_name: as for `global_norm`.

  Returns:
    ``(clipped_tree, norm)`` where ``norm`` is the norm before clipping.
  """
  norm = global_norm(tree, axis_name)
  return clip_with_norm(tree, norm, max_norm), norm


def clip_with_norm(tree, norm: jax.Array, max_norm: float):
  """``tree`` scaled to global norm ``max_norm`` given its ``norm`` (optax's formula).

  For callers that have the norm already (the step computes it once for the
  metrics and the finite check).
  """
  keep = norm < max_norm  # optax's test: a nan norm clips (to nan) rather than passing
  def one(g):
    return jnp.where(keep, g, (g / norm.astype(g.dtype)) * max_norm).astype(g.dtype)
  return jax.tree.map(one, tree)
