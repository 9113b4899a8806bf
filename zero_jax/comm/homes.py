"""Whole leaves to and from their home devices: one all-to-all per group of equal shapes.

A group's units (matrices of one shape, each split over the data axes along ``dim``) have
each a home device; every device holds ``s`` home slots of the group (some of them empty
on devices with fewer homes). `to_homes` sends every device's block of each unit to the
unit's home, which rebuilds it whole; `from_homes` sends each home's whole result back,
cut into the blocks of the split layout. They run inside ``shard_map``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def slot_count(slots) -> int:
  """Home slots per device of a group: the most units any device holds."""
  return max(len(s) for s in slots)


def to_homes(blocks, slots, axes, dim: int, length: int) -> jax.Array:
  """This device's blocks of a group's units -> its home units, whole.

  Args:
    blocks: per unit of the group, this device's block (split along ``dim``).
    slots: per device, the positions (in ``blocks``) of the units it is home to.
    axes: the data axes (their linear index is the device's place in ``slots``).
    dim: the dimension of a unit split over ``axes``.
    length: that dimension's logical size (the blocks carry padding past it).

  Returns:
    ``(s, *unit)``: the whole units this device is home to, in slot order; empty
    slots are zeros.
  """
  s, zero = slot_count(slots), jnp.zeros_like(blocks[0])
  send = jnp.stack([jnp.stack([blocks[mine[t]] if t < len(mine) else zero for t in range(s)])
                    for mine in slots])
  recv = jax.lax.all_to_all(send, axes, 0, 0, tiled=True)  # [i, t]: device i's block
  whole = jnp.moveaxis(recv, 0, 1 + dim)
  shape = whole.shape
  whole = whole.reshape(shape[:1 + dim] + (shape[1 + dim] * shape[2 + dim],) + shape[3 + dim:])
  return jax.lax.slice_in_dim(whole, 0, length, axis=1 + dim)


def from_homes(home: jax.Array, slots, axes, dim: int, padded: int) -> list:
  """This device's whole home units -> per unit of the group, this device's block.

  Args:
    home: ``(s, *unit)``, as `to_homes` gives (empty slots are sent and dropped).
    slots: as for `to_homes`.
    axes: the data axes.
    dim: the dimension of a unit split over ``axes``.
    padded: that dimension's size in the split layout (a multiple of the devices).

  Returns:
    One block per unit of the group, in unit order.
  """
  n = len(slots)
  widths = [(0, 0)] * home.ndim
  widths[1 + dim] = (0, padded - home.shape[1 + dim])
  x = jnp.pad(home, widths)
  x = x.reshape(x.shape[:1 + dim] + (n, padded // n) + x.shape[2 + dim:])
  recv = jax.lax.all_to_all(jnp.moveaxis(x, 1 + dim, 0), axes, 0, 0, tiled=True)
  out = [None] * sum(len(s) for s in slots)
  for j, mine in enumerate(slots):  # [j, t]: my block of device j's slot t
    for t, u in enumerate(mine):
      out[u] = recv[j, t]
  return out
