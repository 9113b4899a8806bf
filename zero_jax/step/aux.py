"""Auxiliary outputs (``has_aux=True``) combined over micro-batches and devices, per leaf.

Each leaf of ``aux`` has a rule, so that ``metrics["aux"]`` equals what
``loss_fn`` returns on the whole global batch on one device:

* ``"mean"``: the mean over micro-batches and devices (a per-example mean,
  e.g. accuracy; result at least float32);
* ``"sum"``: the sum (a count, e.g. of correct predictions);
* ``"max"``, ``"min"``: the maximum or minimum (a bool ``"max"`` is "any",
  ``"min"`` is "all");
* ``"concat"``: per-example values (leading dimension: the rows ``loss_fn``
  was given) concatenated in global batch order, sharded over the batch axes.

Defaults: a leaf whose leading dimension is the number of rows ``loss_fn`` is
given is ``"concat"``; other floating leaves ``"mean"``; integer leaves
``"sum"``. Bool leaves need a rule (``"max"``: any, ``"min"``: all), and
non-array leaves and PRNG keys are refused, naming the leaf. ``aux_reduce=``
takes one rule for every leaf, a pytree prefix of the aux (``None`` keeps a
subtree's defaults), or a function ``(path, leaf) -> rule or None``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from zero_jax.comm.axes import make_varying

RULES = ("mean", "sum", "max", "min", "concat")
_HOW = (f"pass make_sharded_train_step(..., aux_reduce=) one of {RULES} for every leaf, a "
        f"pytree prefix of the aux with such rules, or a function (path, leaf) -> rule")


@dataclasses.dataclass(frozen=True)
class PrefixRules:
  """``aux_reduce=`` given as a pytree prefix, kept hashable (flattened, None leaves kept)."""
  treedef: Any
  rules: tuple

  def tree(self):
    return jax.tree.unflatten(self.treedef, list(self.rules))


def parse_aux_reduce(aux_reduce, has_aux: bool):
  """Validates ``aux_reduce=`` once: None, a rule, a callable or a `PrefixRules`."""
  if aux_reduce is None or callable(aux_reduce):
    pass
  elif isinstance(aux_reduce, str):
    _check_rule(aux_reduce, "aux_reduce")
  else:
    leaves, treedef = jax.tree.flatten(aux_reduce, is_leaf=lambda x: x is None)
    for path, r in jax.tree_util.tree_flatten_with_path(
        aux_reduce, is_leaf=lambda x: x is None)[0]:
      if r is not None:
        _check_rule(r, f"aux_reduce{jax.tree_util.keystr(path)}")
    aux_reduce = PrefixRules(treedef, tuple(leaves))
  if aux_reduce is not None and not has_aux:
    raise ValueError("aux_reduce= says how aux leaves are combined, but has_aux=False: pass "
                     "has_aux=True (loss_fn returns (loss, aux)) or drop aux_reduce.")
  return aux_reduce


def _check_rule(rule, where: str) -> None:
  if not (isinstance(rule, str) and rule in RULES):
    raise ValueError(f"{where}={rule!r} is not a rule; choose one of {RULES}.")


def _given(aux_reduce, aux) -> list:
  """Per aux leaf: the rule ``aux_reduce`` gives it, or None (the default)."""
  paths = jax.tree_util.tree_flatten_with_path(aux)[0]
  if aux_reduce is None or isinstance(aux_reduce, str):
    return [aux_reduce] * len(paths)
  if isinstance(aux_reduce, PrefixRules):
    try:
      full = jax.tree.map(lambda r, sub: jax.tree.map(lambda _: r, sub), aux_reduce.tree(), aux,
                          is_leaf=lambda x: x is None)
    except ValueError as e:
      raise ValueError(f"aux_reduce= is not a pytree prefix of the aux loss_fn returned "
                       f"({jax.tree.structure(aux)}): {e}") from None
    return jax.tree.leaves(full, is_leaf=lambda x: x is None)
  out = []
  for path, x in paths:
    r = aux_reduce(path, x)
    if r is not None:
      _check_rule(r, f"aux_reduce(path, leaf) for aux{jax.tree_util.keystr(path)} returned")
    out.append(r)
  return out


def resolve(aux_reduce, aux, rows: int) -> tuple[str, ...]:
  """The rule of every aux leaf under ``aux_reduce`` (as `parse_aux_reduce` gives it;
  ``rows``: the rows ``loss_fn`` was given); raises
  TypeError/ValueError naming a leaf that cannot be combined.

  Example:
    >>> import jax.numpy as jnp
    >>> aux = {"acc": jnp.float32(0.5), "count": jnp.int32(3), "logits": jnp.zeros((4, 2))}
    >>> resolve(None, aux, rows=4)
    ('mean', 'sum', 'concat')
    >>> rules = parse_aux_reduce({"acc": "max", "count": None, "logits": "mean"}, True)
    >>> resolve(rules, aux, rows=4)
    ('max', 'sum', 'mean')
  """
  out = []
  for (path, x), r in zip(jax.tree_util.tree_flatten_with_path(aux)[0], _given(aux_reduce, aux)):
    where = f"aux{jax.tree_util.keystr(path)}"
    if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(f"loss_fn returned {where} as a {type(x).__name__} ({x!r}), not an "
                      f"array; the step combines aux leaves over devices, which needs arrays. "
                      f"Return jnp.asarray(...) for numbers, and keep other values out of aux.")
    dtype, shape = jnp.result_type(x), np.shape(x)
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
      raise TypeError(f"loss_fn returned {where} as a PRNG key; keys cannot be combined over "
                      f"devices (none of {RULES} applies). Return jax.random.key_data(key) "
                      f"with a rule, or keep keys out of aux.")
    per_example = len(shape) >= 1 and shape[0] == rows
    if r is None:
      if per_example:
        r = "concat"
      elif jnp.issubdtype(dtype, jnp.bool_):
        raise TypeError(f"{where} is a bool {list(shape)}, and bools are never combined "
                        f"implicitly: give it a rule, 'max' (true if any device's is) or "
                        f"'min' (true if all are); {_HOW}.")
      else:
        r = "sum" if jnp.issubdtype(dtype, jnp.integer) else "mean"
    if r == "concat" and not per_example:
      raise ValueError(f"aux_reduce gives {where} (shape {list(shape)}) the rule 'concat', "
                       f"which needs a leading per-example dimension of {rows} (the rows "
                       f"loss_fn was given); choose another rule for it.")
    out.append(r)
  return tuple(out)


def _wide(x):
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


@struct.dataclass
class Parts:
  """One device's aux on its way through the micro-batches (a pytree; rules static).

  Attributes:
    values: per leaf, the value combined over the micro-batches so far (None
      for per-example leaves); after `finish`, every leaf's output.
    rows: per leaf, the per-example value (None for the others, and after
      `finish`).
    rules: the rule of each leaf (static).
    treedef: the aux tree's structure (static).
  """
  values: list
  rows: list
  rules: tuple = struct.field(pytree_node=False)
  treedef: Any = struct.field(pytree_node=False)


def start(aux_reduce, aux, rows: int) -> Parts:
  """One micro-batch's aux -> its `Parts` (rules resolved, see `resolve`)."""
  rules, leaves = resolve(aux_reduce, aux, rows), jax.tree.leaves(aux)
  values = [None if r == "concat" else
            (_wide(x) if r == "mean" or (r == "sum" and not jnp.issubdtype(x.dtype, jnp.integer))
             else x.astype(jnp.int32) if r == "sum" else x) for r, x in zip(rules, leaves)]
  return Parts(values, [x if r == "concat" else None for r, x in zip(rules, leaves)], rules,
               jax.tree.structure(aux))


def carried(p: Parts | None) -> Parts | None:
  """What a ``lax.scan`` over micro-batches carries: the combined values only."""
  return None if p is None else p.replace(rows=[None] * len(p.rules))


def rows(p: Parts | None):
  """What a ``lax.scan`` over micro-batches stacks: the per-example values."""
  return None if p is None else p.rows


def merge(a: Parts | None, b: Parts | None) -> Parts | None:
  """The carried values of two micro-batches combined (``b``'s rows dropped)."""
  if a is None:
    return None
  ops = {"mean": jnp.add, "sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum}
  return carried(a.replace(values=[None if r == "concat" else ops[r](x, y)
                                   for r, x, y in zip(a.rules, a.values, b.values)]))


def joined(carry: Parts | None, first: Parts | None, stacked) -> Parts | None:
  """The carried values with the per-example rows of the first micro-batch and of the
  others (stacked by the scan), the device's rows in order."""
  if carry is None:
    return None
  return carry.replace(rows=[
      None if f is None else jnp.concatenate([f[None], y]).reshape((-1,) + f.shape[1:])
      for f, y in zip(first.rows, stacked)])


def finish(p: Parts | None, k: int, axes) -> Parts | None:
  """One device's leaves for the shard_map output (spec ``P(axes)``): a combined leaf with
  a leading axis of 1 (reduced over devices by `reduce_devices`), a per-example leaf with
  the device's rows in order."""
  if p is None:
    return None
  out = []
  for r, c, e in zip(p.rules, p.values, p.rows):
    x = e if r == "concat" else (c / k if r == "mean" else c)[None]
    out.append(make_varying(x, axes))
  return Parts(out, [None] * len(out), p.rules, p.treedef)


def reduce_devices(p: Parts, constrain: Callable, axes) -> Any:
  """The shard_map's output (per device stacked along axis 0) -> the aux tree: combined
  leaves replicated, per-example leaves in global batch order, split over ``axes``."""
  ops = {"mean": jnp.mean, "sum": jnp.sum, "max": jnp.max, "min": jnp.min}
  out = [constrain(x, P(axes)) if r == "concat" else constrain(ops[r](x, axis=0), P())
         for r, x in zip(p.rules, p.values)]
  return jax.tree.unflatten(p.treedef, out)


def specs(p: Parts, axes) -> Any:
  """PartitionSpecs of the reduced aux tree."""
  return jax.tree.unflatten(p.treedef, [P(axes) if r == "concat" else P() for r in p.rules])
