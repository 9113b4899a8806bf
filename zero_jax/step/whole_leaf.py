"""``whole_leaf_update=``: each selected matrix updated whole, once, on its home device.

Matrix optimizers (``optax.contrib.muon``'s Newton-Schulz, Shampoo-like transforms) need
each weight matrix whole. On the split layout XLA partitions every matmul of their update
into collectives, and gathering each matrix everywhere repeats the work on every device.
Here each selected matrix (each layer of a stacked leaf counts as one: a *unit*) gets a
home device, balanced by its cost (`newton_schulz_flops`); its gradient moves there whole
with one all-to-all per group of units of equal shape, the user's transformation updates it
there with the single-device math, and its update goes back to the split layout with one
all-to-all. The optimizer state of those units lives at home only: ``s`` slots per device
and group (`WholeLeafState.homes`), the split state of every other leaf as before.

The transformation runs twice per step: once under the compiler's partitioning for the
leaves that stay split, with the moved ones masked (``optax.masked``), and once on each
device for its home units, with every other leaf masked. That is exact when each moved
leaf's update and state depend only on that leaf and on state shared by all leaves (step
counts, coefficients), and the shared state depends on no moved leaf: `make_plan` checks
it on the traced update and refuses a transform that mixes leaves (global-norm clipping
inside the chain, factored second moments) naming the leaf.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
import numpy as np
import optax

from zero_jax.comm import layout as lay
from zero_jax.comm.homes import slot_count
from zero_jax.step.opt_call import optimizer_update


SMALL_SHARED = 4096  # elements: a shared state leaf this small is kept whole on every device


class WholeLeafState(NamedTuple):
  """The optimizer state of a step with ``whole_leaf_update=``.

  Attributes:
    split: the transformation's state for the leaves that stay split (the moved
      leaves masked, as ``optax.masked`` keeps them), split over the data axes.
    homes: per group of units of equal shape, per state leaf a unit keeps (Muon:
      its momentum), an array ``(devices * slots, *unit)`` split over the data
      axes along its first dimension: each device holds its home units' state.
  """
  split: Any
  homes: tuple


class Group(NamedTuple):
  """Units of equal shape that move together (static).

  Attributes:
    shape: a unit's shape.
    dim: the dimension of a unit split over the data axes.
    padded: that dimension's size in the split layout.
    kinds: the dtypes of the state leaves each unit keeps, in order.
    units: indices into `Plan.units`.
    slots: per device, positions in ``units`` of the units it is home to.
  """
  shape: tuple
  dim: int
  padded: int
  kinds: tuple
  units: tuple
  slots: tuple

  @property
  def s(self) -> int:
    return slot_count(self.slots)


class Plan(NamedTuple):
  """Where each moved unit lives (static, hashable; `StateMeta.whole`).

  Attributes:
    moved: per parameter leaf, whether its update is made whole at home.
    units: ``(leaf, layer)`` per unit; ``layer`` is None for a leaf that is not
      stacked (the leaf is the unit).
    groups: the `Group`s.
    n: devices on the data axes.
    uses_params: whether a moved leaf's update reads its parameter (weight
      decay): the parameter then moves home too.
    plain: the `PlainView` of the state (how checkpoints store it), or None for a
      transformation whose state it cannot map.
  """
  moved: tuple
  units: tuple
  groups: tuple
  n: int
  uses_params: bool
  plain: Any = None

  def home_units(self, d: int) -> dict:
    """``{leaf: [(group, slot, layer), ...]}`` of the units device ``d`` is home to."""
    out: dict = {}
    for g, grp in enumerate(self.groups):
      for t, pos in enumerate(grp.slots[d]):
        leaf, layer = self.units[grp.units[pos]]
        out.setdefault(leaf, []).append((g, t, layer))
    return out


class PlainView(NamedTuple):
  """A `WholeLeafState` as the optimizer state of the same step without
  ``whole_leaf_update=`` (static; `Plan.plain`): what checkpoints store, every leaf split
  as such a step splits it, so that they restore onto any device count (and into a step
  with or without the option).

  Attributes:
    treedef: that state's tree structure.
    layouts: per leaf of it, its `Layout`.
    dtypes: per leaf, its dtype.
    sources: per leaf, ``("split", j)``: the ``j``-th leaf of `WholeLeafState.split`; or
      ``("home", leaf, kind)``: state ``kind`` of parameter ``leaf``, kept at home.
  """
  treedef: Any
  layouts: tuple
  dtypes: tuple
  sources: tuple


def newton_schulz_flops(shape) -> int:
  """The cost that balances homes: ``m * n * min(m, n)`` for an ``(m, n)`` matrix (one
  Newton-Schulz matmul; every iteration costs a fixed multiple of it); for other ranks
  the size times the smallest dimension.

  >>> newton_schulz_flops((768, 3072))
  1811939328
  """
  shape = tuple(int(d) for d in shape)
  return math.prod(shape) * (min(shape) if shape else 1)


def assign_homes(costs, groups, n: int) -> list[int]:
  """A home device for each unit: costliest first, to the least loaded device that holds
  fewer than ``ceil(k / n)`` units of its group (k: the group's units), so that every
  group moves with the fewest slots.

  Args:
    costs: per unit, its cost (`newton_schulz_flops`).
    groups: per unit, its group (any hashable).
    n: the devices.

  Returns:
    Per unit, its device.

  >>> assign_homes([4, 4, 1, 1, 1], ["a", "a", "b", "b", "b"], 2)
  [0, 1, 0, 1, 0]
  """
  sizes: dict = {}
  for g in groups:
    sizes[g] = sizes.get(g, 0) + 1
  cap = {g: -(-k // n) for g, k in sizes.items()}
  load, held = [0] * n, {}
  out = [0] * len(costs)
  for u in sorted(range(len(costs)), key=lambda u: (-costs[u], u)):
    g = groups[u]
    free = [d for d in range(n) if held.get((g, d), 0) < cap[g]]
    d = min(free, key=lambda d: (load[d], d))
    out[u], load[d] = d, load[d] + costs[u]
    held[(g, d)] = held.get((g, d), 0) + 1
  return out


# ------------------------------------------------------------------- state leaves
def owners(state, paths, shapes) -> list:
  """Per leaf of an optimizer state: ``(leaf, kind)`` when it is the state of parameter
  ``leaf``, else None (state shared by the leaves). A state leaf belongs to the parameter
  whose path is the longest that its path ends with (``['blk']['l1']['w']``'s state is never
  ``['l1']['w']``'s; a single array's empty path ends every path), and only when it has
  that parameter's shape; ``kind`` counts that parameter's state leaves in order.
  ``shapes`` holds None for parameters not to look for (their state is None here too)."""
  out, count = [], {}
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    key = jax.tree_util.keystr(path)
    ends = [i for i, p in enumerate(paths) if key.endswith(p)]
    best = max(ends, key=lambda i: len(paths[i]), default=None)
    if best is None or shapes[best] is None or tuple(np.shape(x)) != tuple(shapes[best]):
      out.append(None)
      continue
    r = count.get(best, 0)
    count[best] = r + 1
    out.append((best, r))
  return out


def mask_tree(treedef, flags):
  return jax.tree.unflatten(treedef, [bool(f) for f in flags])


def split_optimizer(optimizer, treedef, trainable, moved):
  """The transformation for the leaves that stay split (moved and frozen ones masked)."""
  return optax.masked(optimizer, mask_tree(treedef, [t and not m for t, m in
                                                     zip(trainable, moved)]))


def stored_abstract(optimizer, treedef, src, trainable, plan: Plan) -> WholeLeafState:
  """Shape structs of the `WholeLeafState` a state keeps (``src``: the parameters' shape
  structs in the optimizer's dtypes)."""
  split = jax.eval_shape(split_optimizer(optimizer, treedef, trainable, plan.moved).init, src)
  homes = tuple(tuple(jax.ShapeDtypeStruct((plan.n * g.s,) + g.shape, k) for k in g.kinds)
                for g in plan.groups)
  return WholeLeafState(split, homes)


def home_layouts(plan: Plan) -> tuple:
  """The `Layout` of every ``homes`` array (split along the slots)."""
  return tuple(lay.Layout((plan.n * g.s,) + g.shape, 0, plan.n * g.s)
               for g in plan.groups for _ in g.kinds)


def init_homes(plan: Plan, full_state, paths, shapes) -> tuple:
  """The ``homes`` arrays from the transformation's state over every leaf (at ``init``)."""
  own = owners(full_state, paths, [s if m else None for s, m in zip(shapes, plan.moved)])
  kinds = {o: x for o, x in zip(own, jax.tree.leaves(full_state)) if o is not None}
  out = []
  for g in plan.groups:
    per_kind = []
    for r, dtype in enumerate(g.kinds):
      zero = jnp.zeros(g.shape, dtype)
      rows = []
      for mine in g.slots:
        for t in range(g.s):
          if t < len(mine):
            leaf, layer = plan.units[g.units[mine[t]]]
            x = kinds[(leaf, r)]
            rows.append(x if layer is None else x[layer])
          else:
            rows.append(zero)
      per_kind.append(jnp.stack(rows).astype(dtype))
    out.append(tuple(per_kind))
  return tuple(out)


def plain_view(plan: Plan, plain, plain_layouts, split, param_layouts, paths) -> PlainView | None:
  """How the state of ``plan``'s step maps onto ``plain``, the state (shape structs) of the
  step without ``whole_leaf_update=``, whose leaves have ``plain_layouts``; ``split``: the
  `WholeLeafState.split` shape structs. None where the two do not correspond leaf for leaf
  (a transformation whose state layout depends on which leaves it updates)."""
  kinds = {plan.units[u][0]: g.kinds for g in plan.groups for u in g.units}
  dims = {plan.units[u][0]: (g.dim + (plan.units[u][1] is not None), g.padded)
          for g in plan.groups for u in g.units}
  own = owners(plain, paths, [l.shape if m else None for l, m in zip(param_layouts, plan.moved)])
  rest = iter(enumerate(jax.tree.leaves(split)))
  sources, seen = [], set()
  for x, o, l in zip(jax.tree.leaves(plain), own, plain_layouts):
    if o is None:
      j, y = next(rest, (None, None))
      if y is None or (y.shape, y.dtype) != (x.shape, x.dtype):
        return None
      sources.append(("split", j))
    elif o[1] < len(kinds[o[0]]) and jnp.dtype(x.dtype) == kinds[o[0]][o[1]] and \
        (l.dim, l.padded) == dims[o[0]] and not l.model:
      sources.append(("home",) + o)
      seen.add(o)
    else:
      return None
  if next(rest, None) is not None or seen != {(i, r) for i, k in kinds.items()
                                              for r in range(len(k))}:
    return None
  return PlainView(jax.tree.structure(plain), tuple(plain_layouts),
                   tuple(jnp.dtype(x.dtype) for x in jax.tree.leaves(plain)), tuple(sources))


# --------------------------------------------------------------------- the plan
def make_plan(optimizer, treedef, paths, src, layouts, moved, stacked, trainable, *,
              n: int) -> Plan | None:
  """The `Plan` of a step (None when no leaf moves); raises ValueError naming a moved leaf
  whose update the transformation computes from other leaves.

  Args:
    optimizer: the user's transformation.
    treedef, paths: the parameters' tree and the ``keystr`` path of each leaf.
    src: per leaf, its shape struct in the optimizer's dtype.
    layouts: per leaf, its `Layout`.
    moved, stacked, trainable: per leaf, the flags.
    n: devices on the data axes.
  """
  moved = tuple(bool(m and l.dim is not None and not (s and l.dim == 0))
                for m, l, s in zip(moved, layouts, stacked))
  if not any(moved):
    return None
  src_tree = jax.tree.unflatten(treedef, src)
  full = jax.eval_shape(optax.masked(optimizer, mask_tree(treedef, trainable)).init, src_tree)
  shapes = [x.shape for x in src]
  own = owners(full, paths, [s if m else None for s, m in zip(shapes, moved)])
  kinds: dict = {}
  for o, x in zip(own, jax.tree.leaves(full)):
    if o is not None:
      kinds.setdefault(o[0], []).append(jnp.dtype(x.dtype))
  units, keys, costs = [], [], []
  for i, m in enumerate(moved):
    if not m:
      continue
    l = layouts[i]
    unit, dim = (l.shape[1:], l.dim - 1) if stacked[i] else (l.shape, l.dim)
    key = (tuple(unit), dim, l.padded, jnp.dtype(src[i].dtype), tuple(kinds.get(i, ())))
    for layer in (range(l.shape[0]) if stacked[i] else [None]):
      units.append((i, layer))
      keys.append(key)
      costs.append(newton_schulz_flops(unit))
  homes = assign_homes(costs, keys, n)
  groups = []
  for key in dict.fromkeys(keys):
    members = tuple(u for u, k in enumerate(keys) if k == key)
    slots = tuple(tuple(p for p, u in enumerate(members) if homes[u] == d) for d in range(n))
    groups.append(Group(key[0], key[1], key[2], key[4], members, slots))
  uses = _check_separable(optimizer, treedef, paths, src_tree, full, trainable, moved)
  return Plan(moved, tuple(units), tuple(groups), n, uses)


# ------------------------------------------------------------- the exactness check
def _tags_through(closed, in_tags) -> list:
  """Which inputs each output of a jaxpr depends on (a forward pass over its equations;
  calls into other jaxprs are followed, other structured ones joined whole)."""
  jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
  env = dict(zip(jaxpr.invars, in_tags))
  read = lambda v: frozenset() if isinstance(v, jax_core.Literal) else env.get(v, frozenset())
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
    inner = getattr(sub, "jaxpr", sub)
    if inner is not None and hasattr(inner, "invars") and len(inner.invars) == len(ins) \
        and len(inner.outvars) == len(eqn.outvars):
      outs = _tags_through(sub, ins)
    else:
      outs = [frozenset().union(*ins)] * len(eqn.outvars)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _check_separable(optimizer, treedef, paths, src_tree, full, trainable, moved) -> bool:
  """Raises unless each moved leaf's update and state depend only on that leaf and on
  shared state, and nothing else depends on a moved leaf. Returns whether a moved leaf's
  update reads its parameter."""
  opt = optax.masked(optimizer, mask_tree(treedef, trainable))
  shapes = [x.shape for x in jax.tree.leaves(src_tree)]
  own = owners(full, paths, shapes)
  leaf_tag = lambda i, p=False: (("p", i) if p else i) if moved[i] else "other"
  g_tags = [frozenset([leaf_tag(i)]) for i in range(len(paths))]
  p_tags = [frozenset([leaf_tag(i, True)]) for i in range(len(paths))]
  s_tags = [frozenset(["shared"] if o is None else [leaf_tag(o[0])]) for o in own]
  loss = jax.ShapeDtypeStruct((), jnp.float32)

  def fn(g, s, p, value):
    ups, new = optimizer_update(opt, jax.tree.unflatten(treedef, g), s,
                                jax.tree.unflatten(treedef, p), value)
    return jax.tree.leaves(ups), jax.tree.leaves(new)
  leaves = jax.tree.leaves(src_tree)
  closed = jax.make_jaxpr(fn)(leaves, full, leaves, loss)
  out = _tags_through(closed, g_tags + s_tags + p_tags + [frozenset(["shared"])])
  n_up = len(paths)
  checks = [(i, out[i]) for i in range(n_up)] + \
      [(None if o is None else o[0], t) for o, t in zip(own, out[n_up:])]
  uses = False
  for leaf, deps in checks:
    if leaf is not None and moved[leaf]:
      other = [d for d in deps if d not in (leaf, ("p", leaf), "shared")]
      uses |= ("p", leaf) in deps
    else:
      other = [d for d in deps if d not in ("other", "shared")]
    if other:
      bad = sorted(d[1] if isinstance(d, tuple) else d for d in other if d != "other")
      name = paths[leaf if leaf is not None and moved[leaf] else bad[0]]
      raise ValueError(
          f"whole_leaf_update: the optimizer computes the update or state of "
          f"params{name} from other leaves (or other leaves' from it), so it cannot run on "
          f"that leaf's home device alone: e.g. optax.clip_by_global_norm inside the "
          f"chain, or a state shared by several leaves. Leave params{name} out of "
          f"whole_leaf_update, or move the cross-leaf part out of the optimizer (the "
          f"step's max_grad_norm= clips by the global norm before the update).")
  return uses
