"""`scan`: a loop over stacked layers that gathers the next layer while this one computes.

A drop-in for ``jax.lax.scan(f, init, stacked)`` over stacked layers (``stacked=`` leaves,
``nnx.vmap``-built modules, per-layer arrays) where ``f(carry, layer)`` receives the layer
gathered. With ``prefetch=1`` inside a stage-3 step the forward loop issues layer i+1's
all-gather before layer i's compute and carries it (a double buffer); the backward pass,
one ``custom_vjp`` over the whole stack, issues layer i-1's re-gather before layer i's
backward and reduces layer i's gradient one iteration late, so that it overlaps layer i-1's
backward (with hpZ or replica axes its hop across hosts comes one iteration later still:
`zero_jax.layers.stacked.scatter_outer`, so that neither hop waits for the other). At
stage 2 (and with ``gather_once``) only the delayed reduction applies.
Each layer is recomputed in the backward pass from its input carry, as under
``jax.checkpoint``. `zero_jax.layers.scan_layers` turns ``stacked`` (arrays, `ShardedParam`s,
NNX modules) into flat leaves. See the docs' stage 3 guide and "How it works".
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.comm.axes import make_varying, varying_axes
from zero_jax.layers.scan_layers import Layers, layer_fn
from zero_jax.layers.stacked import (gather, gather_many, has_outer_hop, scatter_inner,
                                     scatter_many, scatter_outer)

PREFETCH_CHOICES = (0, 1)


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _at(x, i):
  """Layer ``i`` (an int or a traced index) of a stacked array."""
  return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(buf, x, i):
  return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def _match_vma(ct, like):
  """``ct`` with the device variance of ``like``: summed over the axes only it varies over
  (the transpose of an implicit broadcast), marked varying over the ones it lacks."""
  if ct is None:
    return None
  extra = tuple(sorted(varying_axes(ct) - varying_axes(like)))
  ct = jax.lax.psum(ct, extra) if extra else ct
  return make_varying(ct, tuple(sorted(varying_axes(like))))


def _barrier(tree):
  """``jax.lax.optimization_barrier`` over the leaves of ``tree`` that vary over the most
  axes (the barrier would make the others as varying; they are not collectives' results)."""
  leaves, treedef = jax.tree.flatten(tree)
  most = frozenset().union(*map(varying_axes, leaves))
  idx = [i for i, x in enumerate(leaves) if varying_axes(x) == most]
  for i, x in zip(idx, jax.lax.optimization_barrier([leaves[i] for i in idx])):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def _after(sps: list, x) -> list:
  """The `ShardedParam`s ``sps``, their split blocks computed from a value of ``x`` (a
  cotangent) so that their gathers cannot start before ``x`` exists, and unchanged.

  XLA:GPU keeps the ordering barriers until it has scheduled; XLA:CPU drops them first,
  and would otherwise issue the backward pass's first gathers at the start of the step
  and keep them through the forward pass. A sign bit is never above 1, but XLA cannot
  tell (the select fuses into the gather's packing).
  """
  xs = [v for v in jax.tree.leaves(x) if _is_float(v) and v.size]
  if not xs:
    return sps
  bits = jax.lax.bitcast_convert_type(xs[0].reshape(-1)[0].astype(jnp.float32), jnp.uint32)
  never = jax.lax.shift_right_logical(bits, jnp.uint32(31)) > 1
  # Only blocks that vary over every axis ``never`` varies over: the select must not make a
  # block vary over more (a frozen block is the same on every replica).
  held = lambda p: varying_axes(never) <= varying_axes(p.block)
  return [p.with_block(jnp.where(never, jnp.zeros((), p.block.dtype), p.block))
          if p.layout.dim is not None and _is_float(p.block) and held(p) else p for p in sps]


def _vma(x) -> tuple:
  """The axes an array, or a struct from ``jax.eval_shape`` inside ``shard_map``, varies over."""
  if isinstance(x, jax.ShapeDtypeStruct):  # (its aval cannot always be rebuilt: model axes)
    return tuple(sorted(getattr(x.manual_axis_type, "varying", ())))
  return tuple(sorted(varying_axes(x)))


def _zeros(s, lead: tuple = ()):
  """Zeros shaped ``lead + s.shape`` with the device variance of ``s``."""
  return make_varying(jnp.zeros(lead + tuple(s.shape), s.dtype), _vma(s))



# ------------------------------------------------------------------- the scan
def scan(f: Callable, init: Any, stacked: Any, *, prefetch: int = 1) -> tuple[Any, Any]:
  """``jax.lax.scan(f, init, stacked)`` over stacked layers, gathering the next layer
  while this one computes.

  ``f(carry, layer)`` gets one layer of ``stacked`` with its `ShardedParam`s
  gathered (and an ``nnx.vmap``-built module as one layer's module); it
  returns ``(carry, y)``. Each layer is recomputed in the backward pass from
  its input carry, as under ``jax.checkpoint`` (only the carries are kept). At
  stage 3 with ``prefetch=1`` the forward loop gathers layer i+1 while layer i
  computes and the backward loop gathers layer i-1 while layer i's backward
  runs, reducing layer i's gradient one iteration late; at stage 2 only the
  delayed reduction applies. Outside the step, at stage 1, or with
  ``prefetch=0`` it is ``jax.lax.scan`` over a ``jax.checkpoint``-ed body that
  calls `gather` (today's schedule). Module variables that ``f`` updates
  (BatchNorm statistics, RNG counters) are written back, as ``nnx.scan`` does.
  It runs over every layer in order: ``lax.scan``'s ``reverse=``, ``length=``
  and ``unroll=`` are not taken (reverse the stack with ``jax.tree.map`` and
  ``jnp.flip`` outside the step, or use ``lax.scan`` with `gather`).

  Example:
    >>> import jax, jax.numpy as jnp, zero_jax as zj
    >>> def loss_fn(params, batch):
    ...   layer = lambda h, w: (jnp.tanh(h @ w), None)   # w: one layer, gathered
    ...   h, _ = zj.scan(layer, batch["x"], params["layers"])
    ...   return jnp.mean((h - batch["y"]) ** 2)
    >>> params = {"layers": jnp.zeros((4, 3, 3))}       # 4 layers, stacked
    >>> batch = {"x": jnp.ones((2, 3)), "y": jnp.ones((2, 3))}
    >>> float(loss_fn(params, batch))                 # outside the step: lax.scan
    1.0

    In ``zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, stage=3,
    stacked={"layers": True})`` it prefetches.

  Args:
    f: ``f(carry, layer) -> (carry, y)``. It may close over other values
      (parameters, tables): their gradients flow.
    init: the initial carry.
    stacked: a pytree of stacked layers: `ShardedParam`s (``stacked=``
      leaves as ``loss_fn`` receives them), arrays and ``nnx.Module``s whose
      variables have the layers along their leading dimension.
    prefetch: 1 (gather one layer ahead, reduce one layer behind) or 0.

  Returns:
    ``(carry, ys)`` as ``jax.lax.scan`` returns them.
  """
  check_prefetch(prefetch, "zero_jax.scan")
  layers = Layers(stacked)
  if prefetch == 0 or not layers.sharded or layers.length == 0:
    return _scan_plain(f, init, layers)
  return _scan_prefetched(f, init, layers)


def check_prefetch(prefetch, where: str) -> None:
  """``prefetch=`` is the int 0 or 1 (`scan`, `zero_jax.memory_report`)."""
  if (isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral)
      or prefetch not in PREFETCH_CHOICES):
    raise ValueError(f"{where}: prefetch={prefetch!r}; choose 1 (gather the next layer while "
                     f"this one computes) or 0 (gather each layer in its own iteration).")


def _scan_plain(f, init, layers: Layers):
  """Today's schedule: ``lax.scan`` of a ``jax.checkpoint``-ed body that gathers its layer."""
  changed: list = []
  body = layer_fn(f, layers, changed)

  @jax.checkpoint  # the backward pass gathers each layer again
  def step(carry, leaves):
    carry, y, new = body(carry, gather(list(leaves)))
    return carry, (y, new)

  carry, (ys, new) = jax.lax.scan(step, init, layers.leaves)
  layers.write_back(changed, new)
  return carry, ys


def _split(flat: list, sizes: list[int]) -> list[list]:
  out, at = [], 0
  for k in sizes:
    out.append(list(flat[at:at + k]))
    at += k
  return out


def _pullback(fn: Callable, args: list[list], diff: list[list], cts: list) -> list[list]:
  """The gradients of ``fn(*args)`` (lists in, a tuple of lists out) with respect to the
  leaves marked in ``diff``, given the flat outputs' cotangents ``cts`` (None: zero);
  unmarked leaves get None."""
  flat, mask, sizes = sum(args, []), sum(diff, []), [len(a) for a in args]

  def part(*d):
    it = iter(d)
    full = [next(it) if m else a for a, m in zip(flat, mask)]
    return sum(map(list, fn(*_split(full, sizes))), [])

  outs, pull = jax.vjp(part, *[a for a, m in zip(flat, mask) if m])
  cts = [np.zeros(o.shape, jax.dtypes.float0) if not _is_float(o) else
         _match_vma(jnp.zeros(o.shape, o.dtype) if ct is None else ct, o)
         for o, ct in zip(outs, cts)]
  got = iter(pull(cts))
  return _split([next(got) if m else None for m in mask], sizes)


def _ct(x):
  """A cotangent from a ``symbolic_zeros`` rule: None for a symbolic zero."""
  return None if isinstance(x, jax.custom_derivatives.SymbolicZero) else x


class _Sharded:
  """The stack's `ShardedParam`s as flat stacked leaves (blocks, and at stage 2 the values).

  At stage 3 a layer's values are gathered one iteration ahead and carried (``ahead``);
  at stage 2 they are this device's own, taken where they are used.
  """

  def __init__(self, sps: list):
    self.leaves, self.treedef = jax.tree.flatten(sps)
    self.ahead = all(x.full is None for x in sps)
    # the flat index of each one's differentiated child (`ShardedParam.differentiated`)
    starts = np.cumsum([0] + [len(jax.tree.leaves(x)) for x in sps])[:-1]
    self.diff_pos = [int(s) + x.differentiated for s, x in zip(starts, sps)]

  def at(self, leaves, i) -> list:
    """Layer ``i``'s `ShardedParam`s."""
    return jax.tree.unflatten(self.treedef, [_at(x, i) for x in leaves])

  def fetch(self, leaves, i, after=None):
    """What a loop carries for layer ``i``: its gathered values (stage 3), or None;
    gathered only once ``after`` exists (see `_after`)."""
    return gather_many(_after(self.at(leaves, i), after)) if self.ahead else None

  def use(self, leaves, i, w) -> list:
    """Layer ``i``'s values for ``f``: the carried ``w``, or taken here (stage 2)."""
    return w if self.ahead else gather_many(self.at(leaves, i))


def _scan_prefetched(f, init, layers: Layers):
  """The schedule of the module docstring; see `scan`."""
  n, length = len(layers.leaves), layers.length
  plain_idx = [i for i in range(n) if i not in set(layers.sharded)]
  sharded = _Sharded([layers.leaves[i] for i in layers.sharded])
  plain = [layers.leaves[i] for i in plain_idx]
  init_leaves, init_def = jax.tree.flatten(init)
  changed: list = []
  body, defs = layer_fn(f, layers, changed), {}

  def flat(c, w, x):
    leaves: list = [None] * n
    for i, v in zip(layers.sharded + plain_idx, list(w) + list(x)):
      leaves[i] = v
    carry, y, new = body(jax.tree.unflatten(init_def, c), leaves)
    c_out, defs["carry"] = jax.tree.flatten(carry)
    y_out, defs["y"] = jax.tree.flatten(y)
    return c_out, y_out, list(new)

  ex_w = [_zeros(s) for s in jax.eval_shape(lambda ls: gather_many(sharded.at(ls, 0)),
                                             sharded.leaves)]
  ex_x = [_zeros(s) for s in jax.eval_shape(lambda xs: [x[0] for x in xs], plain)]
  init_leaves = _carry_like(init_leaves, init_def, defs,
                            jax.eval_shape(flat, init_leaves, ex_w, ex_x)[0])
  conv, consts = jax.closure_convert(flat, init_leaves, ex_w, ex_x)
  out_s = jax.eval_shape(conv, init_leaves, ex_w, ex_x, *consts)
  loop = _Loop(conv, sharded, length, out_s)
  perturbed: dict = {}

  @jax.custom_vjp
  def run(c, sp, xs, ks):
    return _forward(loop, c, sp, xs, ks, save=False)[0]

  def run_fwd(c, sp, xs, ks):
    value = lambda t: [a.value for a in t]
    perturbed.update(sp=[a.perturbed for a in sp], xs=[a.perturbed for a in xs],
                     ks=[a.perturbed for a in ks])
    c, sp, xs, ks = value(c), value(sp), value(xs), value(ks)
    out, saved = _forward(loop, c, sp, xs, ks, save=True)
    return out, (saved, sp, xs, ks)

  def run_bwd(res, cts):
    saved, sp, xs, ks = res
    return tuple(_backward(loop, saved, sp, xs, ks, perturbed,
                           [[_ct(x) for x in part] for part in cts]))

  run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
  c, ys, new = run(init_leaves, sharded.leaves, plain, list(consts))
  layers.write_back(changed, new)
  return jax.tree.unflatten(init_def, c), jax.tree.unflatten(defs["y"], ys)


def _carry_like(init_leaves, init_def, defs, out_s) -> list:
  """``init``'s leaves, checked against ``f``'s carry and as device-varying as it."""
  if defs["carry"] != init_def or any(
      np.shape(a) != s.shape or jnp.result_type(a) != s.dtype for a, s in zip(init_leaves, out_s)):
    have = [(np.shape(a), str(jnp.result_type(a))) for a in init_leaves]
    got = [(s.shape, str(s.dtype)) for s in out_s]
    raise TypeError(f"zero_jax.scan: f(carry, layer) must return a carry of the same structure, "
                    f"shapes and dtypes as init, as for jax.lax.scan; init is {init_def} with "
                    f"{have}, f returned {defs['carry']} with {got}.")
  return [make_varying(a, _vma(s)) for a, s in zip(init_leaves, out_s)]


class _Loop(NamedTuple):
  """What the forward and backward loops run, fixed once traced.

  Attributes:
    conv: the closure-converted layer, ``conv(carry, w, x, *consts) -> (carry, ys, new)``.
    sharded: the stack's sharded leaves (`_Sharded`).
    length: the number of layers.
    out_s: ``conv``'s output shapes (carry, ys, new states).
  """
  conv: Callable
  sharded: _Sharded
  length: int
  out_s: Any


def _forward(loop: _Loop, c, sp, xs, ks, *, save: bool):
  """Layer i+1 gathered while layer i computes; with ``save``, each layer's input carry
  kept for the backward pass. Returns ``((carry, ys, new states), saved carries)``."""
  conv, sharded, length, (c_s, y_s, new_s) = loop
  bufs = ([_zeros(s, (length,)) for s in y_s], [_zeros(s, (length,)) for s in new_s],
          [_zeros(s, (length,)) for s in c_s] if save else [])

  def compute(i, c, w, bufs):
    ys, news, saved = bufs
    saved = [_put(b, x, i) for b, x in zip(saved, c)]
    c, y, new = conv(c, sharded.use(sp, i, w), [_at(x, i) for x in xs], *ks)
    return c, ([_put(b, v, i) for b, v in zip(ys, y)],
               [_put(b, v, i) for b, v in zip(news, new)], saved)

  def step(i, st):
    c, w, bufs = st
    w_next = sharded.fetch(sp, i + 1)  # issued before layer i's compute
    c, bufs = compute(i, c, w, bufs)
    w_next, c = _barrier((w_next, c))
    return c, w_next, bufs

  w = sharded.fetch(sp, 0)
  if length > 1:
    c, w, bufs = jax.lax.fori_loop(0, length - 1, step, (c, w, bufs))
  c, (ys, news, saved) = compute(length - 1, c, w, bufs)
  return (c, ys, news), saved


def _backward(loop: _Loop, saved, sp, xs, ks, perturbed: dict, cts) -> list:
  """Layer i-1 re-gathered and layer i+1's gradient reduced while layer i's backward runs.

  Returns the cotangents of ``run``'s inputs (init, sharded leaves, per-layer arrays,
  closed-over values); None where nothing flows.
  """
  conv, sharded, length, _ = loop
  layer_sps, pos = sharded.at(sp, 0), sharded.diff_pos
  masks = ([_is_float(x) for x in saved],
           [_is_float(x.block) and perturbed["sp"][p] for x, p in zip(layer_sps, pos)],
           [_is_float(x) and p for x, p in zip(xs, perturbed["xs"])],
           [_is_float(k) and p for k, p in zip(ks, perturbed["ks"])])
  red = [j for j, m in enumerate(masks[1]) if m]
  add = lambda a, b: [None if x is None else x + y for x, y in zip(a, b)]
  put = lambda bufs, vals, i: [None if b is None else _put(b, v, i) for b, v in zip(bufs, vals)]

  def back(i, dc, w):  # layer i's backward, recomputing its forward from its input carry
    at = lambda bufs: [None if b is None else _at(b, i) for b in bufs]
    return _pullback(lambda c, w, x, k: conv(c, w, x, *k),
                     [at(saved), sharded.use(sp, i, w), at(xs), list(ks)], list(masks),
                     dc + at(cts[1]) + at(cts[2]))

  def reduce(i, g, hop=scatter_many):  # gather's transpose for layer i's gradient
    layer = sharded.at(sp, i)
    return hop([layer[j] for j in red], [g[j] for j in red])

  # With a hop across hosts (hpZ, replica axes) layer i+1's gradient is reduced within the
  # host while layer i+2's crosses: neither waits for the other, both span layer i's backward.
  two = has_outer_hop([layer_sps[j] for j in red])
  top = length - 1
  dc = list(cts[0])  # the backward pass's gathers wait for a cotangent (`_after`)
  w = sharded.fetch(sp, top, after=cts[:2])
  w_prev = sharded.fetch(sp, top - 1, after=cts[:2]) if length > 1 else None
  dc, g, dx, dk = back(top, dc, w)
  dxb = put([None if d is None else _zeros(d, (length,)) for d in dx], dx, top)
  dbl = [_zeros(s, (length,)) for s in jax.eval_shape(lambda g: reduce(top, g), g)]
  if length == 1:
    dbl = put(dbl, reduce(0, g), 0)
  else:
    w_prev, dc = _barrier((w_prev, dc))

    def step(k, st):
      i = top - 1 - k
      dc, w, pending, half, dk, dxb, dbl = st
      w_prev = sharded.fetch(sp, i - 1, after=dc)  # layer i-1, before layer i's backward
      if two:  # layer i+1 within the host, layer i+2 across hosts
        h = reduce(i + 1, pending, scatter_inner)
        r = None if half is None else reduce(i + 2, half, scatter_outer)
      else:  # layer i+1's gradient, one iteration late
        h, r = None, reduce(i + 1, pending)
      dc, g, dx, dk_i = back(i, dc, w)
      w_prev, r, h, dc = _barrier((w_prev, r, h, dc))
      dbl = dbl if r is None else put(dbl, r, i + 1 + two)
      return dc, w_prev, g, h, add(dk, dk_i), put(dxb, dx, i), dbl

    st, first = (dc, w_prev, g, None, dk, dxb, dbl), int(two)
    if length > 2 and two:  # the first iteration has no layer i+2 yet
      st = step(0, st)
    if length - 2 > first:
      st = jax.lax.fori_loop(first, length - 2, step, st)
    dc, w, pending, half, dk, dxb, dbl = st
    if half is not None:
      dbl = put(dbl, reduce(2, half, scatter_outer), 2)
    dbl = put(dbl, reduce(1, pending), 1)
    dc, g, dx, dk_0 = back(0, dc, w)
    dk, dxb = add(dk, dk_0), put(dxb, dx, 0)
    dbl = put(dbl, reduce(0, g), 0)
  d_sp: list = [None] * len(sp)
  for j, b in zip(red, dbl):
    d_sp[pos[j]] = _match_vma(b, sp[pos[j]])
  return [[_match_vma(d, _at(s, 0)) for d, s in zip(dc, saved)], d_sp,
          [_match_vma(d, x) for d, x in zip(dxb, xs)], [_match_vma(d, k) for d, k in zip(dk, ks)]]
