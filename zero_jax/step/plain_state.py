"""A ``whole_leaf_update=`` state in its *plain* form, the one checkpoints store, and back.

The home slots of `zero_jax.step.whole_leaf.WholeLeafState` depend on the device count;
the plain form (`zero_jax.step.whole_leaf.PlainView`) is the optimizer state of the same
step without the option: each moved leaf's state split as a leaf is, which a checkpoint
restores onto any device count (padding cut or added) and into a step with or without
the option. `to_plain` moves each home's state to the split layout with the all-to-all
that carries updates home-to-split in the step; `from_plain` moves it home with the one
that carries gradients; both under one ``jit``, state kind by state kind. Small shared
leaves, kept whole on every device in the home form, are split in the plain one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax.comm import layout as lay
from zero_jax.step.home_update import device_index, group_home, leaf_blocks
from zero_jax.step.state import StateMeta, TrainState


def has_plain(meta: StateMeta) -> bool:
  """Whether a state with ``meta`` keeps a home form that a plain one stands for."""
  return meta.whole is not None and meta.whole.plain is not None


def plain_meta(meta: StateMeta) -> StateMeta:
  """The meta of the plain form (the optimizer state's tree and layouts without homes)."""
  view = meta.whole.plain
  return dataclasses.replace(meta, opt_layouts=view.layouts, opt_treedef=view.treedef,
                             whole=None)


def _axes(meta: StateMeta) -> tuple:
  return tuple(a for a, _ in meta.signature.data)


def _n_split(meta: StateMeta) -> int:
  return len(meta.opt_layouts) - sum(len(g.kinds) for g in meta.whole.groups)


def _moves(meta: StateMeta) -> tuple:
  """``(plain leaf, source)`` of the leaves that change between the forms: every home
  state, and the split leaves whose layouts differ."""
  view = meta.whole.plain
  return tuple((p, s) for p, (s, l) in enumerate(zip(view.sources, view.layouts))
               if s[0] == "home" or meta.opt_layouts[s[1]] != l)


def _moves_split(meta: StateMeta) -> list:
  """`_moves` of the split leaves: ``(plain leaf, split leaf)``."""
  return [(p, s[1]) for p, s in _moves(meta) if s[0] == "split"]


def _relayout(x, src: lay.Layout, dst: lay.Layout, axes, n: int):
  """One device's block of a leaf in layout ``src`` -> its block in ``dst`` (small leaves)."""
  if src.dim is not None:
    x = lay.unpad(jax.lax.all_gather(x, axes, axis=src.dim, tiled=True), src)
  if dst.dim is not None:
    size = dst.padded // n
    x = jax.lax.dynamic_slice_in_dim(lay.pad(x, dst), device_index(axes) * size, size,
                                     axis=dst.dim)
  return x


@functools.lru_cache(maxsize=32)
def _converter(meta: StateMeta, mesh, plain: bool, out_shardings):
  """The jitted move of `_moves`' leaves: home form -> plain form when ``plain``, else back.

  Home form in: the split leaves that move, then every homes array; plain form in: the
  plain leaves that move, in order. Out: the other form, in the same orders."""
  plan, view, axes = meta.whole, meta.whole.plain, _axes(meta)
  n, n_split = math.prod(s for _, s in meta.signature.data), _n_split(meta)
  moves, splits = _moves(meta), _moves_split(meta)
  homes = [(p, s[1], s[2]) for p, s in moves if s[0] == "home"]
  kinds = [(g, r) for g, grp in enumerate(plan.groups) for r in range(len(grp.kinds))]
  home_specs = tuple(meta.opt_layouts[n_split + k].spec(axes) for k in range(len(kinds)))
  split_specs = tuple(meta.opt_layouts[j].spec(axes) for _, j in splits)
  plain_specs = tuple(view.layouts[p].spec(axes) for p, _ in moves)

  def to_plain(small, home):
    at = dict(zip(kinds, home))
    out = {p: _relayout(x, meta.opt_layouts[j], view.layouts[p], axes, n)
           for (p, j), x in zip(splits, small)}
    for r in range(max((len(g.kinds) for g in plan.groups), default=0)):
      blocks = leaf_blocks(plan, axes, [at.get((g, r)) for g in range(len(plan.groups))])
      out.update({p: blocks[i] for p, i, k in homes if k == r})
    return tuple(out[p] for p, _ in moves)

  def from_plain(leaves):
    by = dict(zip([p for p, _ in moves], leaves))
    small = [_relayout(by[p], view.layouts[p], meta.opt_layouts[j], axes, n) for p, j in splits]
    of = {(i, r): by[p] for p, i, r in homes}
    home = [group_home(plan, g, axes, lambda i, r=r: of[(i, r)]) for g, r in kinds]
    return tuple(small), tuple(home)

  if plain:
    body = jax.shard_map(to_plain, mesh=mesh, in_specs=(split_specs, home_specs),
                         out_specs=plain_specs, check_vma=False)
    return jax.jit(body, out_shardings=out_shardings)
  body = jax.shard_map(from_plain, mesh=mesh, in_specs=(plain_specs,),
                       out_specs=(split_specs, home_specs), check_vma=False)
  return jax.jit(body, out_shardings=out_shardings, donate_argnums=(0,))


def _mesh(state: TrainState):
  return state.step.sharding.mesh


def _plain_structs(meta: StateMeta, mesh, like) -> list:
  """Shape structs of the plain leaves that `_moves` lists (``like``: any opt leaf, for its
  memory kind)."""
  view, axes = meta.whole.plain, _axes(meta)
  kind = getattr(like.sharding, "memory_kind", None)
  return [jax.ShapeDtypeStruct(view.layouts[p].storage_shape, view.dtypes[p],
                               sharding=NamedSharding(mesh, view.layouts[p].spec(axes),
                                                      memory_kind=kind))
          for p, _ in _moves(meta)]


def _assemble(meta: StateMeta, split, moved) -> list:
  """The plain form's leaves: those that move from ``moved`` (in `_moves` order), the
  others the home form's ``split`` leaves themselves."""
  view, got = meta.whole.plain, dict(zip([p for p, _ in _moves(meta)], moved))
  return [got[p] if p in got else split[s[1]] for p, s in enumerate(view.sources)]


def abstract_plain(target: TrainState) -> TrainState:
  """The plain form of an abstract state (``step.abstract_state``): what a checkpoint of
  it holds. A state without a home form is returned as it is."""
  meta = target.meta
  if not has_plain(meta):
    return target
  leaves = jax.tree.leaves(target.opt_state)
  moved = _plain_structs(meta, _mesh(target), leaves[0])
  opt = jax.tree.unflatten(meta.whole.plain.treedef,
                           _assemble(meta, leaves[:_n_split(meta)], moved))
  return target.replace(opt_state=opt, meta=plain_meta(meta))


def to_plain(state: TrainState) -> TrainState:
  """``state`` in its plain form (new arrays for the moved leaves; the others shared). A
  state without a home form is returned as it is."""
  meta = state.meta
  if not has_plain(meta):
    return state
  leaves, n_split = jax.tree.leaves(state.opt_state), _n_split(meta)
  shardings = tuple(s.sharding for s in _plain_structs(meta, _mesh(state), leaves[0]))
  moved = []
  if _moves(meta):
    fn = _converter(meta, _mesh(state), True, shardings)
    with jax.set_mesh(_mesh(state)):  # the state's mesh, whatever the caller's context
      moved = fn(tuple(leaves[j] for _, j in _moves_split(meta)), tuple(leaves[n_split:]))
  opt = jax.tree.unflatten(meta.whole.plain.treedef,
                           _assemble(meta, leaves[:n_split], moved))
  return state.replace(opt_state=opt, meta=plain_meta(meta))


def from_plain(state: TrainState, target: TrainState) -> TrainState:
  """A plain-form ``state`` (as read from a checkpoint) in the form of ``target``, the
  abstract state of the step it continues with; its moved leaves are donated."""
  meta = target.meta
  if not has_plain(meta) or state.meta.whole is not None:
    return state
  view, n_split = meta.whole.plain, _n_split(meta)
  t_leaves = jax.tree.leaves(target.opt_state)
  splits = _moves_split(meta)
  shardings = (tuple(t_leaves[j].sharding for _, j in splits),
               tuple(x.sharding for x in t_leaves[n_split:]))
  leaves = jax.tree.leaves(state.opt_state)
  small, home = (), ()
  if _moves(meta):
    fn = _converter(meta, _mesh(target), False, shardings)
    with jax.set_mesh(_mesh(target)), warnings.catch_warnings():
      # a donated leaf that no output can reuse is just freed
      warnings.filterwarnings("ignore", "Some donated buffers were not usable")
      small, home = fn(tuple(leaves[p] for p, _ in _moves(meta)))
  split = [leaves[p] for p, s in enumerate(view.sources) if s[0] == "split"]
  for (_, j), x in zip(splits, small):
    split[j] = x
  opt = jax.tree.unflatten(meta.opt_treedef, split + list(home))
  return state.replace(opt_state=opt, meta=meta)
