"""The forward and backward loops of `zero_jax.scan` over sharded stacked layers.

The forward loop gathers layer i+1 while layer i computes (``prefetch=1`` at stage 3) and
keeps each layer's residuals (`zero_jax.layers.residuals`); the backward loop re-gathers
layer i-1 and reduces layer i+1's gradient while layer i's pullback runs. With hpZ or
replica axes each hop across hosts comes one iteration after the one before it
(`zero_jax.layers.stacked.hops`), so that no hop waits for another. With
``prefetch=0`` each layer is gathered, and its gradient reduced, in its own iteration.

Each iteration ends at one `barrier` that everything it computed (carry, outputs, saved
residuals; backward: the gradients) passes together with the collective results it hands to
the next iteration; only the stores into the stacked buffers follow it. XLA:GPU's
latency-hiding scheduler works from the end of the iteration: it places a collective's done
early in that walk (late in time) once its uses are placed, and its start where its own cost
estimate, which varies with the target and the shapes, says the latency is covered. With only
stores after the barrier, the done lands after the layer's last matmul, which then runs inside
the window (every case of benchmarks/bench_overlap_sweep.py; where the start goes stays
XLA's choice). Before, the layer's stores and other work came after the barrier's inputs and
an A100 MLP's gather waited before its layer's second matmul.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.comm.axes import varying_axes
from zero_jax.layers import residuals
from zero_jax.layers.residuals import Linear, is_float, match_vma, split, zeros
from zero_jax.layers.stacked import gather_many, hops, scatter_many


# Layers an iteration of a prefetching loop runs (`forward`, `_Backward.delayed`): two, so
# that what a layer hands to the next travels in the other layer's buffers. Each loop carries
# what one layer gathers (forward: the next layer's weights; backward: the layer before's, and
# this layer's gradient to the reduce-scatter): in a loop of one layer an iteration, that
# value is made while the carried one is still read and XLA copies it into the carry (a copy
# of every weight and gradient a layer). Unrolled by two, the first layer's collectives land
# in buffers of their own and the second's start after the first layer has read the carried
# ones (they wait for its outputs: `_after`), so XLA writes them in place. The loops run a
# multiple of two layers (`span`). Where the layer's blocks cannot wait (`unroll`), one.
UNROLL = 2


def at(x, i):
  """Layer ``i`` (an int or a traced index) of a stacked array."""
  return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def put(buf, x, i):
  """``buf`` with layer ``i`` set to ``x`` (an array, or a number: a constant's literal)."""
  return jax.lax.dynamic_update_index_in_dim(buf, jnp.asarray(x, buf.dtype), i, 0)


def barrier(tree):
  """``jax.lax.optimization_barrier`` over the leaves of ``tree`` that vary over the most
  axes (the barrier would make the others as varying; they are not collectives' results)."""
  leaves, treedef = jax.tree.flatten(tree)
  most = frozenset().union(*map(varying_axes, leaves))
  idx = [i for i, x in enumerate(leaves) if varying_axes(x) == most]
  for i, x in zip(idx, jax.lax.optimization_barrier([leaves[i] for i in idx])):
    leaves[i] = x
  return jax.tree.unflatten(treedef, leaves)


def token(x):
  """One element of ``x``'s first non-empty float leaf (None if it has none): what a loop
  hands to its next layer's collectives to wait for (`_after`). A value of their own, read
  by nothing else: waiting on ``x`` itself, XLA fused the wait into a later consumer of ``x``
  (a layer's residual add) and started the gather after that layer's last matmul."""
  xs = [v for v in jax.tree.leaves(x) if hasattr(v, "dtype") and is_float(v) and np.size(v)]
  return jnp.asarray(xs[0]).reshape(-1)[0] if xs else None


def _after(sps: list, x) -> list:
  """The `ShardedParam`s ``sps``, their split blocks computed from a value of ``x`` (a
  cotangent) so that their gathers cannot start before ``x`` exists, and unchanged.

  XLA:GPU keeps the ordering barriers until it has scheduled; XLA:CPU drops them first,
  and would otherwise issue the backward pass's first gathers at the start of the step
  and keep them through the forward pass. A sign bit is never above 1, but XLA cannot
  tell (the select fuses into the gather's packing).
  """
  xs = [v for v in jax.tree.leaves(x) if is_float(v) and np.size(v)]
  if not xs:
    return sps
  bits = jax.lax.bitcast_convert_type(xs[0].reshape(-1)[0].astype(jnp.float32), jnp.uint32)
  never = jax.lax.shift_right_logical(bits, jnp.uint32(31)) > 1
  # Only blocks that vary over every axis ``never`` varies over: the select must not make a
  # block vary over more (a frozen block is the same on every replica).
  held = lambda p: varying_axes(never) <= varying_axes(p.block)
  return [p.with_block(jnp.where(never, jnp.zeros((), p.block.dtype), p.block))
          if p.layout.dim is not None and is_float(p.block) and held(p) else p for p in sps]


class Stack:
  """The stack's `ShardedParam`s as flat stacked leaves (blocks, and at stage 2 the values).

  With ``ahead`` (stage 3, ``prefetch=1``) a layer's values are gathered one iteration
  ahead and carried; otherwise they are gathered (at stage 2: taken) where they are used. A
  layer moves the same way whatever ``bucket_bytes``: its leaves split along their first
  dimension (already contiguous rows) in collectives of their own, which XLA:GPU joins into
  one each way (`zero_jax.step.compile_options`), the others joined into one buffer per
  dtype (`zero_jax.comm.collectives.Comm.pack`). Buckets gave a 1B layer four all-gathers,
  more than XLA:GPU keeps in flight (two of them exposed); the joined buffer cost a copy of
  every weight out of it and of every gradient into it.
  """

  def __init__(self, sps: list, prefetch: int):
    sps = [p.in_one_bucket() for p in sps]
    self.leaves, self.treedef = jax.tree.flatten(sps)
    self.prefetch = prefetch
    self.ahead = prefetch == 1 and all(x.full is None for x in sps)
    # the flat index of each one's differentiated child (`ShardedParam.differentiated`)
    starts = np.cumsum([0] + [len(jax.tree.leaves(x)) for x in sps])[:-1]
    self.diff_pos = [int(s) + x.differentiated for s, x in zip(starts, sps)]

  def unroll(self, leaves, tok) -> int:
    """Layers a prefetching loop runs an iteration: `UNROLL` where every gathered block can
    wait for ``tok`` (`_after`), else 1. A block that varies over fewer axes than the
    activations (hpZ's copy within the host, or the blocks of a replica axis) cannot: the wait
    would make it vary over them, and XLA would join two layers' gathers into one, copied."""
    sps = jax.tree.unflatten(self.treedef, leaves)
    waits = tok is not None and all(
        varying_axes(tok) <= varying_axes(p.block) for p in sps
        if p.layout.dim is not None and is_float(p.block))
    return UNROLL if waits else 1

  def at(self, leaves, i) -> list:
    """Layer ``i``'s `ShardedParam`s."""
    return jax.tree.unflatten(self.treedef, [at(x, i) for x in leaves])

  def fetch(self, leaves, i, after=None):
    """What a loop carries for layer ``i``: its gathered values (``ahead``), or None;
    gathered only once ``after`` exists (see `_after`)."""
    return gather_many(_after(self.at(leaves, i), after)) if self.ahead else None

  def use(self, leaves, i, w) -> list:
    """Layer ``i``'s values for the layer: the carried ``w``, or gathered here."""
    return w if self.ahead else gather_many(self.at(leaves, i))


class Loop(NamedTuple):
  """What the forward and backward loops run, fixed once traced.

  Attributes:
    conv: the closure-converted layer, ``conv(carry, w, x, *consts) -> (carry, ys, new)``.
    stack: the stack's sharded leaves (`Stack`).
    length: the number of layers.
    out_s: ``conv``'s output shapes (carry, ys, new states).
  """
  conv: Callable
  stack: Stack
  length: int
  out_s: Any


def span(length: int, unroll: int) -> tuple[int, int]:
  """``(lo, hi)``: the layers a prefetching forward loop runs, ``lo <= i < hi``, whose
  residuals the stacked buffers hold; the others run outside the loops and keep theirs apart.

  The last layer always runs after the loop. Two layers an iteration (`UNROLL`), the first
  runs before it too, and the loop runs a multiple of two, so that no iteration is peeled
  (JAX runs a remainder after the loop). Code outside the loops that reads or writes a
  stacked buffer lets XLA:GPU give the whole buffer the layout that code's matmul prefers,
  and transpose it out of and back into the loops' (Llama-3-8B: four transposes of 3.9 GiB).
  The backward loop runs the same layers (`_Backward.delayed`).
  """
  lo = 1 if unroll > 1 and length > 2 else 0
  n = max(length - 1 - lo, 0)
  return lo, lo + n - n % unroll


def forward(loop: Loop, c, sp, xs, ks, lin: Linear | None = None):
  """Layer i+1 gathered while layer i computes; with ``lin``, each layer's residuals kept
  for the backward pass. Returns ``((carry, ys, new states), saved)``: ``saved`` is
  ``(stacks, apart)``, the stacked residuals of the layers the loop runs, and with
  ``prefetch=1`` ``{layer: residuals}`` of those run outside it (`span`)."""
  conv, stack, length, (c_s, y_s, new_s) = loop
  unroll = stack.unroll(sp, token(c)) if stack.ahead else 1
  lo, hi = span(length, unroll) if stack.ahead else (0, length)
  stacks = lambda: residuals.buffers(lin, hi - lo) if lin is not None else []
  bufs = ([zeros(s, (length,)) for s in y_s], [zeros(s, (length,)) for s in new_s], [])

  def layer(i, c, w):  # layer i: (carry, ys, new states), and its residuals with ``lin``
    args = [list(c), stack.use(sp, i, w), [at(x, i) for x in xs], list(ks)]
    if lin is None:
      return conv(*args[:3], *ks), []
    outs, res = lin.forward(args)
    return split(outs, [len(c_s), len(y_s), len(new_s)]), res

  def store(i, out, res, bufs, keep=True):  # ``keep``: the residuals into the stacks
    (c, y, new), (ys, news, saved) = out, bufs
    if lin is not None and keep:
      saved = [put(b, r, i - lo) for b, r in zip(saved, res)]
    return c, ([put(b, v, i) for b, v in zip(ys, y)],
               [put(b, v, i) for b, v in zip(news, new)], saved)

  def step(i, st, keep=True):
    c, w, tok, bufs = st
    # issued before layer i's compute, once the layer before has computed: in the second
    # layer of an iteration (`UNROLL`), after the first has read the weights this one replaces
    w_next = stack.fetch(sp, i + 1, after=tok)
    out, res = layer(i, c, w)
    # everything the layer computed meets the gathered weights at the barrier: only the
    # stores follow it, so the gather's done comes after the layer's last matmul
    w_next, out, res, tok = barrier((w_next, list(out), res, token(out)))
    # and the stores are done before the next layer computes: in the first layer of an
    # iteration XLA stored its residuals at the end of the second, one layer's more in memory
    c, bufs = barrier(store(i, out, res, bufs, keep))
    return (c, w_next, tok, bufs), res

  if not stack.ahead:  # each layer gathered in its own iteration
    def each(i, st):
      (c, y, new), res = layer(i, st[0], None)
      return store(i, (c, y, new), res, st[1])
    c, bufs = jax.lax.fori_loop(0, length, each, (c, (*bufs[:2], stacks())))
    return (c, *bufs[:2]), (bufs[2], {})
  w = stack.fetch(sp, 0)
  # layer 1's gather waits for layer 0's (else XLA joins the two, none overlapping layer 0)
  st, apart = (c, w, token(w) if lo else token(c), bufs), {}
  for i in range(lo):
    st, apart[i] = step(i, st, keep=False)
  # made here, not passed through the layers' barriers above: zeros of one shape are one
  # value to XLA, and past a barrier it copies each into a buffer of its own
  st = (*st[:3], (*st[3][:2], stacks()))
  if hi > lo:
    st = jax.lax.fori_loop(lo, hi, lambda i, st: step(i, st)[0], st, unroll=unroll)
  for i in range(hi, length - 1):
    st, apart[i] = step(i, st, keep=False)
  c, w, _, bufs = st
  (c, y, new), apart[length - 1] = layer(length - 1, c, w)
  c, (ys, news, saved) = store(length - 1, (c, y, new), [], bufs, keep=False)
  return (c, ys, news), (saved, apart)


def stored(apart: dict, length: int) -> tuple[int, int]:
  """``(lo, hi)`` of `span`, from the layers ``apart`` (`forward`'s) of ``length``."""
  lo = next(j for j in range(length + 1) if j not in apart)
  return lo, next((j for j in range(lo, length) if j in apart), length)


def _residuals_at(saved, i, lo: int) -> list:
  """Layer ``i``'s saved residuals (``saved`` as `forward` returns it; ``lo``: the stacks'
  first layer, `stored`)."""
  stacks, apart = saved
  if isinstance(i, (int, np.integer)) and i in apart:
    return list(apart[i])
  return [at(b, i - lo) for b in stacks]


def backward(loop: Loop, lin: Linear, saved, sp, xs, ks, cts) -> list:
  """The cotangents of ``run``'s inputs (init, sharded leaves, per-layer arrays,
  closed-over values) given its outputs' ``cts``; None where nothing flows."""
  stack = loop.stack
  layer_sps, pos = stack.at(sp, 0), stack.diff_pos
  kept = stored(saved[1], loop.length)  # the layers whose residuals the stacks hold
  diff = split(list(lin.diff), list(lin.sizes))
  red = [j for j, m in enumerate(diff[1]) if m]
  c_s = loop.out_s[0]
  no_carry = [zeros(s) for s in c_s]

  def back(i, dc, w):  # layer i's pullback from its residuals
    args = [no_carry, stack.use(sp, i, w), [at(x, i) for x in xs], list(ks)]
    ct = lambda bufs: [None if b is None else at(b, i) for b in bufs]
    return lin.backward(args, _residuals_at(saved, i, kept[0]),
                        list(dc) + ct(cts[1]) + ct(cts[2]))

  def reduce(i, g, hop=scatter_many, later=False):  # gather's transpose for layer i's gradient
    layer = stack.at(sp, i)  # (a later hop's ``g``: the one before's, the reduced leaves only)
    return hop([layer[j] for j in red], g if later else [g[j] for j in red])

  loops = _Backward(back, reduce, stack, sp, loop.length, xs, kept)
  if stack.prefetch:
    dc, dk, dxb, dbl = loops.delayed(list(cts[0]), cts[:2], hops([layer_sps[j] for j in red]))
  else:
    dc, dk, dxb, dbl = loops.now(list(cts[0]))
  d_sp: list = [None] * len(sp)
  for j, b in zip(red, dbl):  # each stack's gradient, widened to its block's dtype once
    d_sp[pos[j]] = match_vma(b.astype(sp[pos[j]].dtype), sp[pos[j]])
  return [[match_vma(d, s) for d, s in zip(dc, c_s)], d_sp,
          [match_vma(d, x) for d, x in zip(dxb, xs)], [match_vma(d, k) for d, k in zip(dk, ks)]]


def _split_first(layer: list, gs: list, back: bool = False) -> list:
  """A layer's gradients ``gs`` (of its `ShardedParam`s ``layer``) with each one's split
  dimension moved first, as the reduce-scatter lays them out, or (``back``) moved back.

  The backward loop carries a layer's gradients to the next iteration's reduce-scatter in
  this order, so that the transpose into it is made where the matmul that computes them
  can write it (XLA folds it into the matmul's output layout); carried in their own order
  they were transposed, a copy of each such gradient, before being packed. Exact (a
  transpose, undone before the reduction: XLA cancels the pair).
  """
  out = []
  for p, g in zip(layer, gs):
    d = None if p.layout.dim is None else p.layout.dim - 1  # one layer's dimensions
    if g is None or not d:
      out.append(g)
    else:
      out.append(jnp.moveaxis(g, 0, d) if back else jnp.moveaxis(g, d, 0))
  return out


def _add(a, b):
  return [None if x is None else x + y for x, y in zip(a, b)]


def _put_all(bufs, vals, i):
  return [None if b is None else put(b, v, i) for b, v in zip(bufs, vals)]


class _Backward(NamedTuple):
  """The backward loop's two schedules over ``back(i, dc, w)`` and ``reduce(i, g)``."""
  back: Callable
  reduce: Callable
  stack: Stack
  sp: list
  length: int
  xs: list
  stored: tuple  # (lo, hi): the layers whose residuals the stacks hold (`span`)

  def _first(self, top, dc, w):
    """Layer ``top``'s pullback, and the buffers the loop fills."""
    dc, g, dx, dk = self.back(top, dc, w)
    dxb = _put_all([None if d is None else zeros(d, (self.length,)) for d in dx], dx, top)
    dbl = [zeros(s, (self.length,)) for s in jax.eval_shape(lambda g: self.reduce(top, g), g)]
    return dc, g, dk, dxb, dbl

  def now(self, dc):
    """``prefetch=0``: layer i gathered, and its gradient reduced, in iteration i."""
    top = self.length - 1

    def step(k, st):
      i = top - k
      dc, dk, dxb, dbl = st
      dc, g, dx, dk_i = self.back(i, dc, None)
      return dc, _add(dk, dk_i), _put_all(dxb, dx, i), _put_all(dbl, self.reduce(i, g), i)

    dc_s, g, dx, dk = jax.eval_shape(self.back, top, dc, None)
    fill = lambda ss, lead=(): [None if s is None else zeros(s, lead) for s in ss]
    dbl = jax.eval_shape(lambda: self.reduce(top, fill(g)))
    dc = [None if d is None else zeros(d) if c is None else match_vma(c, d)
          for c, d in zip(dc, dc_s)]
    st = (dc, fill(dk), fill(dx, (self.length,)), fill(dbl, (self.length,)))
    return jax.lax.fori_loop(0, self.length, step, st)

  def delayed(self, dc, after, hops: list):
    """``prefetch=1``: layer i-1 re-gathered while layer i's pullback runs, and each hop of
    the gradients' reduction (`zero_jax.layers.stacked.hops`) one layer later than the one
    before it: layer i+1's within the host, layer i+2's across hosts (and with replica axes
    too, layer i+3's across the replicas), all spanning layer i's pullback."""
    stack, sp, top, k = self.stack, self.sp, self.length - 1, len(hops)
    layer = stack.at(sp, 0)

    def hop(i, p, t):  # ``p``, layer i's gradient through hops[:t], through hops[t]
      return self.reduce(i, _split_first(layer, p, back=True) if t == 0 else p, hops[t], t > 0)

    w = stack.fetch(sp, top, after=after)  # the backward pass's gathers wait for a cotangent
    w_prev = stack.fetch(sp, top - 1, after=after) if self.length > 1 else None
    dc, g, dk, dxb, dbl = self._first(top, dc, w)
    if self.length == 1:
      return dc, dk, dxb, _put_all(dbl, self.reduce(0, g), 0)
    g = _split_first(layer, g)
    w_prev, dc = barrier((w_prev, dc))

    def step(j, st):  # pending[s]: layer i+1+s's gradient, through hops[:s]
      i = top - 1 - j
      dc, w, tok, pending, dk, dxb, dbl = st
      w_prev = stack.fetch(sp, i - 1, after=tok)  # layer i-1, before layer i's pullback
      outs = [None if p is None else hop(i + 1 + s, p, s) for s, p in enumerate(pending)]
      dc, g, dx, dk_i = self.back(i, dc, w)
      g = _split_first(layer, g)  # carried to the next iteration's reduce-scatter
      # as in `forward`: the collectives' results and all the pullback computed, together
      w_prev, outs, dc, g, dx, dk_i, tok = barrier((w_prev, outs, dc, g, dx, dk_i, token(dc)))
      dbl = dbl if outs[-1] is None else _put_all(dbl, outs[-1], i + k)
      return dc, w_prev, tok, [g] + outs[:-1], _add(dk, dk_i), _put_all(dxb, dx, i), dbl

    st = (dc, w_prev, token(dc), [g] + [None] * (k - 1), dk, dxb, dbl)
    # before the loop: the iterations with a hop not yet begun, and the layers whose
    # residuals the forward pass kept apart (`span`), so that the loop runs those it stored
    lo, hi = self.stored
    first = min(max(k - 1, top - hi if hi > lo else top), self.length - 2)
    for j in range(first):
      st = step(j, st)
    if self.length - 2 > first:
      st = jax.lax.fori_loop(first, self.length - 2, step, st, unroll=stack.unroll(sp, st[2]))
    dc, w, _, pending, dk, dxb, dbl = st
    for s, p in enumerate(pending):  # layers 1.. k: their remaining hops
      if p is not None:
        for t in range(s, k):
          p = hop(1 + s, p, t)
        dbl = _put_all(dbl, p, 1 + s)
    dc, g, dx, dk_0 = self.back(0, dc, w)
    return dc, _add(dk, dk_0), _put_all(dxb, dx, 0), _put_all(dbl, self.reduce(0, g), 0)
