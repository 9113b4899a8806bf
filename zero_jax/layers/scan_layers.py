"""The ``stacked`` argument of `zero_jax.scan`, as flat stacked leaves.

NNX modules are split into their variables (and rebuilt, one layer at a time,
for ``f``), `zero_jax.layers.stacked.ShardedParam`s and arrays are leaves as they
are; what ``f`` changes in a layer's module (BatchNorm statistics, RNG
counters) is collected and written back to the stacked module, as ``nnx.scan``
does. The schedule itself is `zero_jax.layers.prefetch`'s.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from zero_jax.layers import nnx as nnx_lib
from zero_jax.layers.stacked import ShardedParam


def _is_sharded(x) -> bool:
  return isinstance(x, ShardedParam)


class Layers:
  """``stacked`` as a flat list of stacked leaves (`ShardedParam`s and arrays), NNX modules
  split into their variables; rebuilds one layer for ``f`` and writes module updates back.

  Attributes:
    leaves: the stacked leaves, in order.
    sharded: indices of the `ShardedParam` leaves.
    state_idx: indices of the leaves of module variables that ``f`` may update (a
      module's variables other than its sharded parameters: BatchNorm statistics, RNG
      counters; at stage 1 its parameters too).
    length: the number of layers.
  """

  def __init__(self, stacked):
    is_top = lambda x: nnx_lib.is_module(x) or _is_sharded(x)
    paths_top, self.topdef = jax.tree_util.tree_flatten_with_path(stacked, is_leaf=is_top)
    self.leaves, self.parts, paths = [], [], []
    for path, t in paths_top:
      start = len(self.leaves)
      if nnx_lib.is_module(t):
        graphdef, state = nnx.split(t)
        sub, sdef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_sharded)
        self.parts.append((t, graphdef, sdef, start, len(sub)))
        self.leaves += [x for _, x in sub]
        paths += [jax.tree_util.keystr(path) + jax.tree_util.keystr(p) for p, _ in sub]
      else:
        self.parts.append((None, None, None, start, 1))
        self.leaves.append(t)
        paths.append(jax.tree_util.keystr(path))
    self.sharded = [i for i, x in enumerate(self.leaves) if _is_sharded(x)]
    self.state_idx = [i for m, _, _, s, n in self.parts if m is not None
                      for i in range(s, s + n) if not _is_sharded(self.leaves[i])]
    self.length = _length(self.leaves, paths)

  def layer(self, leaves: list) -> tuple[Any, list]:
    """One layer's tree for ``f`` from its leaves (gathered where sharded), and its modules."""
    top, modules = [], []
    for m, graphdef, sdef, s, n in self.parts:
      if m is None:
        top.append(leaves[s])
      else:
        modules.append(nnx.merge(graphdef, jax.tree.unflatten(sdef, leaves[s:s + n])))
        top.append(modules[-1])
    return jax.tree.unflatten(self.topdef, top), modules

  def state_of(self, modules: list) -> list:
    """The leaves at `state_idx` of a layer's modules after ``f`` ran on them."""
    full: list = [None] * len(self.leaves)
    for module, (_, _, sdef, s, n) in zip(modules, [p for p in self.parts if p[0] is not None]):
      sub, got = jax.tree.flatten(nnx.split(module)[1], is_leaf=_is_sharded)
      if got != sdef:
        raise ValueError(
            f"zero_jax.scan: f changed which variables a layer's module holds ({n} leaves "
            f"before, {len(sub)} after); create every variable in __init__, as nnx.scan "
            f"requires.")
      full[s:s + n] = sub
    return [full[i] for i in self.state_idx]

  def write_back(self, changed: list[bool], new: list) -> None:
    """Puts the stacked new values of the changed module variables into the modules."""
    got = dict(zip([i for i, c in zip(self.state_idx, changed) if c], new))
    for m, graphdef, sdef, s, n in self.parts:
      if m is not None and any(i in got for i in range(s, s + n)):
        nnx.update(m, jax.tree.unflatten(sdef, [got.get(i, self.leaves[i])
                                                 for i in range(s, s + n)]))


def _length(leaves: list, paths: list) -> int:
  """The common leading (layer) dimension of the stacked leaves."""
  sizes = []
  for x, path in zip(leaves, paths):
    shape = np.shape(x.block if _is_sharded(x) else x)
    if not shape:
      raise ValueError(f"zero_jax.scan: stacked{path} is a scalar; every leaf of stacked "
                       f"has the layers along its leading dimension.")
    sizes.append(shape[0])
  if not sizes:
    raise ValueError("zero_jax.scan: stacked holds no arrays; pass the stacked layers "
                     "(leaves with the layers along their leading dimension).")
  if len(set(sizes)) > 1:
    detail = ", ".join(f"stacked{p}: {s}" for p, s in zip(paths, sizes))
    raise ValueError(f"zero_jax.scan: the leaves of stacked have different numbers of "
                     f"layers (leading dimensions {detail}); they must agree.")
  return sizes[0]


def layer_fn(f: Callable, layers: Layers, changed: list) -> Callable:
  """``body(carry, leaves) -> (carry, y, new state leaves)`` for one layer; records in
  ``changed`` which module variables ``f`` updated (only those leave the loop)."""
  def body(carry, leaves):
    tree, modules = layers.layer(list(leaves))
    out = f(carry, tree)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(f"zero_jax.scan: f(carry, layer) must return a pair (carry, y), as "
                      f"for jax.lax.scan; it returned {type(out).__name__}.")
    _check_values(out)
    new = layers.state_of(modules)
    flags = [n is not leaves[i] for n, i in zip(new, layers.state_idx)]
    changed[:] = flags
    return out[0], out[1], [n for n, c in zip(new, flags) if c]
  return body


def _check_values(out) -> None:
  """Every leaf of ``f``'s ``(carry, y)`` is an array or a number; one that is not is named
  by its path."""
  for path, x in jax.tree_util.tree_flatten_with_path(out)[0]:
    try:
      jax.typeof(x)
    except TypeError:
      name = ("carry", "y")[path[0].idx] + jax.tree_util.keystr(path[1:])
      raise TypeError(f"zero_jax.scan: f(carry, layer) returned {name} = {x!r} "
                      f"({type(x).__name__}), which is not an array; carry and y hold arrays "
                      f"(or numbers), as for jax.lax.scan.") from None
