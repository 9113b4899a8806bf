"""Mesh axes as seen inside ``shard_map``: names, sizes and device variance.

Small helpers the collectives, the quantized collectives, the loss checks, the auxiliary
outputs and the clipping share.
"""

from __future__ import annotations

import math

import jax


def as_tuple(names) -> tuple[str, ...]:
  """An axis name or a sequence of names -> a tuple of names."""
  return (names,) if isinstance(names, str) else tuple(names)


def axes_size(names) -> int:
  """Devices along ``names`` (inside ``shard_map``)."""
  return math.prod(jax.lax.axis_size(a) for a in as_tuple(names))


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map`` (its "vma")."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # jax >= 0.9: ManualAxisType(varying=...)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def make_varying(x, axes):
  """``x`` marked device-varying over ``axes`` (those it does not vary over yet)."""
  missing = tuple(a for a in as_tuple(axes) if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x
