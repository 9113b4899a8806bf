"""`scan`: a loop over stacked layers that gathers the next layer while this one computes.

A drop-in for ``jax.lax.scan(f, init, stacked)`` over stacked layers (``stacked=`` leaves,
``nnx.vmap``-built modules, per-layer arrays) where ``f(carry, layer)`` receives the layer
gathered. Inside a stage-2 or stage-3 step it is one ``custom_vjp`` over the whole stack: the
forward loop linearizes each layer and keeps its residuals (all that ``jax.lax.scan`` keeps, or
what a ``jax.checkpoint`` policy saves: `zero_jax.layers.residuals`), never the gathered
weights; the backward loop applies each layer's pullback while it re-gathers the next one and
reduces the last one's gradient (`zero_jax.layers.loops`). `zero_jax.layers.scan_layers`
turns ``stacked`` (arrays, `ShardedParam`s, NNX modules) into flat leaves. See the docs'
stage 3 guide and "How it works".
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.comm.axes import make_varying
from zero_jax.layers import loops, residuals
from zero_jax.layers.residuals import is_float, vma, zeros
from zero_jax.layers.scan_layers import Layers, layer_fn
from zero_jax.layers.stacked import gather, gather_many

PREFETCH_CHOICES = (0, 1)


# ------------------------------------------------------------------- the scan
def scan(f: Callable, init: Any, stacked: Any, *, prefetch: int = 1,
         policy: Callable | None = None) -> tuple[Any, Any]:
  """``jax.lax.scan(f, init, stacked)`` over stacked layers, gathering the next layer
  while this one computes.

  ``f(carry, layer)`` gets one layer of ``stacked`` with its `ShardedParam`s
  gathered (and an ``nnx.vmap``-built module as one layer's module); it
  returns ``(carry, y)``. The backward pass keeps what ``jax.lax.scan`` keeps
  (``policy=None``) or what ``jax.checkpoint(f, policy=policy)`` saves, and
  recomputes the rest; the gathered weights are never kept (at stage 3 the
  backward pass gathers each layer again, and recomputes from it what depends
  on the weights alone, such as a cast to the compute dtype). At stage 3 with
  ``prefetch=1`` the forward loop gathers layer i+1 while layer i computes
  and the backward loop gathers layer i-1 while layer i's pullback runs,
  reducing layer i's gradient one iteration late; at stage 2 only the
  delayed reduction applies. Outside the step and at stage 1 it is
  ``jax.lax.scan`` (over ``jax.checkpoint(f, policy=policy)`` when a policy is
  given). Module variables that ``f`` updates (BatchNorm statistics, RNG
  counters) are written back, as ``nnx.scan`` does. It runs over every layer
  in order: ``lax.scan``'s ``reverse=``, ``length=`` and ``unroll=`` are not
  taken (reverse the stack with ``jax.tree.map`` and ``jnp.flip`` outside the
  step, or use ``lax.scan`` with `gather`).

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
    prefetch: 1 (gather one layer ahead, reduce one layer behind) or 0
      (gather each layer, and reduce its gradient, in its own iteration).
    policy: a ``jax.checkpoint`` policy for each layer (any of
      ``jax.checkpoint_policies``: ``nothing_saveable`` recomputes each layer
      from its input, ``dots_saveable`` keeps the matmuls' outputs, ...), or
      None to keep what ``jax.lax.scan`` keeps (no recomputation).

  Returns:
    ``(carry, ys)`` as ``jax.lax.scan`` returns them.
  """
  check_prefetch(prefetch, "zero_jax.scan")
  residuals.check_policy(policy, "zero_jax.scan")
  layers = Layers(stacked)
  if not layers.sharded or layers.length == 0:
    if any(id(x) in getattr(_step, "whole", ()) for x in layers.leaves):
      warnings.warn(
          "zero_jax.scan inside a ZeRO-3 step got no stacked parameter: the step marks no "
          "leaf stacked= (it was made without stacked=, or with one that selects no leaf), "
          "so it gathered every parameter whole before the loss and this "
          "loop runs as jax.lax.scan over the whole gathered stack (every layer's weights in "
          "memory at once, nothing overlapped). Mark the stacked leaves in "
          "make_sharded_train_step(..., stacked=...) (e.g. stacked={'layers': True, ...}) so "
          "that zero_jax.scan gathers one layer at a time.", UserWarning, stacklevel=2)
    return _scan_plain(f, init, layers, policy)
  return _scan_sharded(f, init, layers, prefetch, policy)


_step = threading.local()  # ``whole``: ids of the parameters a ZeRO-3 step gathered whole


@contextlib.contextmanager
def in_step_loss(whole_params):
  """Marks the loss being traced by a step: ``whole_params``, the parameters of a stage-3
  step without stacked leaves (gathered whole), or None. A `scan` over one of them warns."""
  before = getattr(_step, "whole", frozenset())
  _step.whole = frozenset(map(id, jax.tree.leaves(whole_params)))
  try:
    yield
  finally:
    _step.whole = before


def check_prefetch(prefetch, where: str) -> None:
  """``prefetch=`` is the int 0 or 1 (`scan`, `zero_jax.memory_report`)."""
  if (isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral)
      or prefetch not in PREFETCH_CHOICES):
    raise ValueError(f"{where}: prefetch={prefetch!r}; choose 1 (gather the next layer while "
                     f"this one computes) or 0 (gather each layer in its own iteration).")


def _scan_plain(f, init, layers: Layers, policy):
  """No sharded layers (outside the step, stage 1) or none at all: ``lax.scan`` of the
  layer, under ``jax.checkpoint(policy=policy)`` when a policy is given."""
  changed: list = []
  body = layer_fn(f, layers, changed)

  def step(carry, leaves):
    carry, y, new = body(carry, gather(list(leaves)))  # (an empty stack's ShardedParams)
    return carry, (y, new)

  if policy is not residuals.KEEP:
    step = jax.checkpoint(step, policy=policy)

  carry, (ys, new) = jax.lax.scan(step, init, layers.leaves)
  layers.write_back(changed, new)
  return carry, ys


def _scan_sharded(f, init, layers: Layers, prefetch: int, policy):
  """The schedule of `zero_jax.layers.loops` over one ``custom_vjp``; see `scan`."""
  n, length = len(layers.leaves), layers.length
  plain_idx = [i for i in range(n) if i not in set(layers.sharded)]
  stack = loops.Stack([layers.leaves[i] for i in layers.sharded], prefetch)
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

  ex_w = [zeros(s) for s in jax.eval_shape(lambda ls: gather_many(stack.at(ls, 0)),
                                            stack.leaves)]
  ex_x = [zeros(s) for s in jax.eval_shape(lambda xs: [x[0] for x in xs], plain)]
  init_leaves = _carry_like(init_leaves, init_def, defs,
                            jax.eval_shape(flat, init_leaves, ex_w, ex_x)[0])
  conv, consts = jax.closure_convert(flat, init_leaves, ex_w, ex_x)
  out_s = jax.eval_shape(conv, init_leaves, ex_w, ex_x, *consts)
  loop = loops.Loop(conv, stack, length, out_s)
  traced: dict = {}

  @jax.custom_vjp
  def run(c, sp, xs, ks):
    return loops.forward(loop, c, sp, xs, ks)[0]

  def run_fwd(c, sp, xs, ks):
    value = lambda t: [a.value for a in t]
    p_sp, p_xs, p_ks = ([a.perturbed for a in t] for t in (sp, xs, ks))
    c, sp, xs, ks = value(c), value(sp), value(xs), value(ks)
    pos = stack.diff_pos
    diff = [[is_float(s) for s in out_s[0]],
            [is_float(sp[p]) and p_sp[p] for p in pos],
            [is_float(x) and p for x, p in zip(xs, p_xs)],
            [is_float(k) and p for k, p in zip(ks, p_ks)]]
    traced["lin"] = lin = residuals.plan(lambda c, w, x, k: conv(c, w, x, *k),
                                         [c, ex_w, ex_x, ks], diff, policy)
    out, saved = loops.forward(loop, c, sp, xs, ks, lin)
    return out, (saved, sp, xs, ks)

  def run_bwd(res, cts):
    saved, sp, xs, ks = res
    return tuple(loops.backward(loop, traced["lin"], saved, sp, xs, ks,
                                [[_ct(x) for x in part] for part in cts]))

  run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
  c, ys, new = run(init_leaves, stack.leaves, plain, list(consts))
  layers.write_back(changed, new)
  return jax.tree.unflatten(init_def, c), jax.tree.unflatten(defs["y"], ys)


def _ct(x):
  """A cotangent from a ``symbolic_zeros`` rule: None for a symbolic zero."""
  return None if isinstance(x, jax.custom_derivatives.SymbolicZero) else x


def _carry_like(init_leaves, init_def, defs, out_s) -> list:
  """``init``'s leaves, checked against ``f``'s carry (each leaf that differs named by its
  path) and as device-varying as it."""
  same = "f(carry, layer) must return a carry of the same structure, shapes and dtypes as init"
  if defs["carry"] != init_def:
    raise TypeError(f"zero_jax.scan: {same}, as for jax.lax.scan; init is {init_def}, f "
                    f"returned {defs['carry']}.")
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(init_def, init_leaves))[0]]
  kind = lambda shape, dtype: f"{jnp.dtype(dtype)}{tuple(shape)}"
  bad = [f"carry{p}: init {kind(np.shape(a), jnp.result_type(a))}, f returned "
         f"{kind(s.shape, s.dtype)}" for p, a, s in zip(paths, init_leaves, out_s)
         if np.shape(a) != s.shape or jnp.result_type(a) != s.dtype]
  if bad:
    raise TypeError(f"zero_jax.scan: {same}, as for jax.lax.scan: {'; '.join(bad)}. Cast or "
                    f"reshape what f returns (or init) to match.")
  return [make_varying(a, vma(s)) for a, s in zip(init_leaves, out_s)]
