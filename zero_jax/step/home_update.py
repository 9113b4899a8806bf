"""The update of a step with ``whole_leaf_update=`` (see `zero_jax.step.whole_leaf`).

The leaves that stay split are updated as in `zero_jax.step.update`, under the compiler's
partitioning, the moved ones masked. The moved ones go through one ``shard_map`` over the
data axes: their gradient blocks (and, when the update reads them and they are not whole
on every device already, their parameters) move to the home devices
(`zero_jax.comm.homes`); each device runs the transformation on the tree of its home
units, every other leaf masked (a ``lax.switch`` on the device's index: branch ``d`` holds
device ``d``'s units, so the program holds each unit's update once); the updates move back
to the split layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zero_jax.comm import homes as homes_lib
from zero_jax.comm import layout as lay
from zero_jax.step.spec import StepSpec
from zero_jax.step.whole_leaf import Plan, WholeLeafState, mask_tree, owners, split_optimizer


class _Device(NamedTuple):
  """What device ``d``'s branch needs (static): its home units, its state's structure."""
  units: dict      # {leaf: [(group, slot, layer), ...]}
  mask: Any        # the params-shaped mask of its leaves
  abstract: Any    # its state's shape structs
  own: list        # per state leaf: (leaf, kind) or None (shared)
  shared: list     # per state leaf: its path when shared, else None


def device_index(axes):
  """This device's linear index over ``axes`` (row-major, as blocks are ordered)."""
  idx = 0
  for a in axes:
    idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
  return idx


def _layer(x, layer):
  return x if layer is None else x[layer]


def _tree(n_leaves, treedef, units: dict, value):
  """A parameter-shaped tree of a device's home units (a stacked leaf's layers stacked in
  order); a scalar where the leaf is masked."""
  leaves = []
  for i in range(n_leaves):
    if i not in units:
      leaves.append(jnp.zeros((), jnp.float32))
      continue
    xs = [value(g, t, layer) for g, t, layer in units[i]]
    leaves.append(xs[0] if units[i][0][2] is None else jnp.stack(xs))
  return jax.tree.unflatten(treedef, leaves)


def _device(plan: Plan, d: int, optimizer, treedef, paths, dtypes) -> _Device:
  units = plan.home_units(d)
  n = len(paths)
  def shape(i):
    g, _, layer = units[i][0]
    return plan.groups[g].shape if layer is None else (len(units[i]),) + plan.groups[g].shape
  tree = jax.tree.unflatten(treedef, [
      jax.ShapeDtypeStruct(shape(i), dtypes[i]) if i in units else
      jax.ShapeDtypeStruct((), jnp.float32) for i in range(n)])
  mask = mask_tree(treedef, [i in units for i in range(n)])
  abstract = jax.eval_shape(optax.masked(optimizer, mask).init, tree)
  own = owners(abstract, paths, [x.shape if i in units else None
                                 for i, x in enumerate(jax.tree.leaves(tree))])
  state_paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(abstract)[0]]
  return _Device(units, mask, abstract, own,
                 [p if o is None else None for p, o in zip(state_paths, own)])


def update(spec: StepSpec, meta, optimizer, treedef, run, grads, state: WholeLeafState,
           src, *, loss, whole_src):
  """The updates (one per parameter leaf) and the new `WholeLeafState`.

  Args:
    spec, meta, optimizer, treedef: the step's.
    run: ``run(opt, grads, state, params, loss) -> (updates, state)``, how the step calls a
      transformation (`zero_jax.step.opt_call.optimizer_update`).
    grads, src: per parameter leaf, its gradient and the value the optimizer updates
      (logical views, split over the data axes), in the optimizer's dtype.
    state: the `WholeLeafState` (logical views).
    loss: the step's global loss.
    whole_src: per parameter leaf, its value whole on every device (stages 1-2 without
      a master copy), else None.
  """
  plan: Plan = meta.whole
  ups, split = run(split_optimizer(optimizer, treedef, meta.trainable, plan.moved),
                   jax.tree.unflatten(treedef, grads), state.split,
                   jax.tree.unflatten(treedef, src), loss)
  ups = list(jax.tree.leaves(ups))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      jax.tree.unflatten(treedef, list(range(len(grads)))))[0]]
  devices = [_device(plan, d, optimizer, treedef, paths, [g.dtype for g in grads])
             for d in range(plan.n)]
  by_path = {jax.tree_util.keystr(p): x for p, x in
             jax.tree_util.tree_flatten_with_path(state.split)[0]}
  need = list(dict.fromkeys(p for dev in devices for p in dev.shared if p is not None))
  for p in need:
    if p not in by_path:
      raise ValueError(
          f"whole_leaf_update: the optimizer's state on a home device has a leaf at {p} that "
          f"its state over the other leaves lacks (its layout depends on which leaves it "
          f"updates), so it cannot update leaves on their home devices. Leave this "
          f"optimizer's leaves out of whole_leaf_update.")
  moved = [i for i, m in enumerate(plan.moved) if m]
  layouts = [meta.param_layouts[i] for i in moved]
  store = [l.spec(spec.data_axes) for l in layouts]
  g_in = [spec.constrain(lay.pad(grads[i], l), s) for i, l, s in zip(moved, layouts, store)]
  p_whole = all(whole_src[i] is not None for i in moved)
  p_in, p_specs = [], []
  if plan.uses_params:
    p_in = [whole_src[i] if p_whole else spec.constrain(lay.pad(src[i], l), s)
            for i, l, s in zip(moved, layouts, store)]
    p_specs = [P()] * len(moved) if p_whole else store
  homes_specs = [[P(spec.data_axes)] * len(k) for k in state.homes]

  def body(g_blocks, p_blocks, homes, shared, loss):
    pos = {i: j for j, i in enumerate(moved)}
    to_homes = lambda blocks: [group_home(plan, g, spec.data_axes, lambda i: blocks[pos[i]])
                               for g in range(len(plan.groups))]
    g_home = to_homes(g_blocks)
    p_home = p_blocks if p_whole or not plan.uses_params else to_homes(p_blocks)
    values = dict(zip(need, shared))
    branches = [_branch(dev, plan, optimizer, treedef, run, values, pos, p_whole)
                for dev in devices]
    up_home, new_homes = jax.lax.switch(device_index(spec.data_axes), branches, g_home, p_home,
                                        homes, loss)
    blocks = leaf_blocks(plan, spec.data_axes, up_home)
    return [blocks[i] for i in moved], new_homes

  fn = jax.shard_map(body, mesh=spec.auto_mesh,
                     in_specs=(store, p_specs, homes_specs, [P()] * len(need), P()),
                     out_specs=(store, homes_specs), check_vma=False)
  blocks, new_homes = fn(g_in, p_in, [list(k) for k in state.homes],
                         [by_path[p] for p in need], loss)
  for i, l, b in zip(moved, layouts, blocks):
    ups[i] = spec.to_logical(b, l)
  return ups, WholeLeafState(split, tuple(tuple(k) for k in new_homes))


def group_home(plan: Plan, g: int, axes, block_of) -> jax.Array:
  """``(s, *unit)``: this device's home units of group ``g``, whole, from ``block_of(leaf)``:
  this device's storage block of a moved leaf (or of a state of the same layout)."""
  grp = plan.groups[g]
  parts = [_layer(block_of(i), layer) for i, layer in (plan.units[u] for u in grp.units)]
  return homes_lib.to_homes(parts, grp.slots, axes, grp.dim, grp.shape[grp.dim])


def leaf_blocks(plan: Plan, axes, homes) -> dict:
  """``{leaf: this device's storage block}`` of the moved leaves, from ``homes``: per
  group, ``(s, *unit)`` as `group_home` gives (None: a group left out)."""
  parts: dict = {}
  for g, home in zip(plan.groups, homes):
    if home is None:
      continue
    for u, block in zip(g.units, homes_lib.from_homes(home, g.slots, axes, g.dim, g.padded)):
      i, layer = plan.units[u]
      parts.setdefault(i, {})[layer] = block
  return {i: p[None] if None in p else jnp.stack([p[k] for k in sorted(p)])
          for i, p in parts.items()}


def _branch(dev: _Device, plan: Plan, optimizer, treedef, run, shared: dict, pos: dict,
            p_whole: bool):
  """Device ``dev``'s update of its home units: one ``lax.switch`` branch."""
  n = len(jax.tree.leaves(dev.mask))

  def branch(g_home, p_home, homes, loss):
    grads = _tree(n, treedef, dev.units, lambda g, t, _: g_home[g][t])
    params = grads  # not read (Plan.uses_params), but some transformations want a tree
    if plan.uses_params:
      if p_whole:
        where = {(g, t): (i, layer) for i, us in dev.units.items() for g, t, layer in us}
        params = _tree(n, treedef, dev.units, lambda g, t, _: _layer(
            p_home[pos[where[(g, t)][0]]], where[(g, t)][1]))
      else:
        params = _tree(n, treedef, dev.units, lambda g, t, _: p_home[g][t])
    leaves = []
    for x, o, path in zip(jax.tree.leaves(dev.abstract), dev.own, dev.shared):
      if o is None:
        leaves.append(shared[path].astype(x.dtype))
      else:
        xs = [homes[g][o[1]][t] for g, t, _ in dev.units[o[0]]]
        leaves.append(xs[0] if dev.units[o[0]][0][2] is None else jnp.stack(xs))
    state = jax.tree.unflatten(jax.tree.structure(dev.abstract), leaves)
    ups, new = run(optax.masked(optimizer, dev.mask), grads, state, params, loss)
    ups = jax.tree.leaves(ups)
    up_home = [jnp.zeros((g.s,) + g.shape, h.dtype) for g, h in zip(plan.groups, g_home)]
    new_homes = [list(k) for k in homes]
    for i, units in dev.units.items():
      for j, (g, t, layer) in enumerate(units):
        up_home[g] = up_home[g].at[t].set(_layer(ups[i], None if layer is None else j)
                                          .astype(up_home[g].dtype))
    for x, o in zip(jax.tree.leaves(new), dev.own):
      if o is not None:
        i, r = o
        for j, (g, t, layer) in enumerate(dev.units[i]):
          v = _layer(x, None if layer is None else j)
          new_homes[g][r] = new_homes[g][r].at[t].set(v.astype(new_homes[g][r].dtype))
    return up_home, new_homes
  return branch
