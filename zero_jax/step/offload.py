"""Where the optimizer state and master copy live between steps, and how they move.

With ``offload="optimizer"`` they stay in ``pinned_host`` memory, sharded as on the devices,
and the update streams them to the devices and back in buckets of leaves found by tracing the
update once (`BUCKET_BYTES`, `IN_FLIGHT`). Details: the docs' offload guide and "How it works".

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  >>> step = zj.make_sharded_train_step(loss_fn, optax.adamw(3e-4),
  ...                                   mesh=jax.make_mesh((8,), ("data",)),
  ...                                   precision="bf16", offload="optimizer")
  >>> state = step.init({"w": jnp.zeros((16, 4))})
  >>> state.opt_state[0].mu["w"].sharding.memory_kind
  'pinned_host'
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Literal
from jax.sharding import NamedSharding

from zero_jax import _compat
from zero_jax.comm import layout as lay
from zero_jax.step.placement import device_bytes, load, store
from zero_jax.step.spec import StepSpec
from zero_jax.step.state import StateMeta

BUCKET_BYTES = 32 * 2**20  # per device; read when a step is first traced
IN_FLIGHT = 2  # buckets on a device at once (one computing, one loading)


# ---------------------------------------------------------- the update, streamed
def streamed_update(spec: StepSpec, meta: StateMeta, apply: Callable, src: list, masters,
                    o_leaves: list, finite):
  """The optimizer update with its state and master copy streamed from the host.

  Args:
    spec, meta: the step's and the state's description.
    apply: ``apply(src, o_views) -> (new_src, new_o)``, the optimizer on
      logical views (``src``: one per trainable leaf; ``o_views``: one per
      optimizer-state leaf); new values in the dtypes of the old ones.
    src: per trainable leaf, its logical view on the devices, or None where
      the value is its master copy (in ``masters``).
    masters: the state's ``master`` list (host storage leaves), or None.
    o_leaves: the optimizer-state leaves (host storage).
    finite: whether the gradients are finite; when not, every value is kept.

  Returns:
    ``(new_src, new_o, new_masters)``: ``new_src`` on the devices, the other
    two as host storage leaves (``new_masters`` like ``masters``).
  """
  idx = meta.train_idx
  m_pos = [j for j, i in enumerate(idx) if meta.master[i]]
  m_layouts = [meta.param_layouts[idx[j]] for j in m_pos]
  layouts = list(meta.opt_layouts) + m_layouts
  host = list(o_leaves) + [masters[j] for j in m_pos]
  n_o = len(o_leaves)

  def update(dev, raw):
    src, ok = dev
    views = [load(spec, x, l) for x, l in zip(raw, layouts)]
    old_src = list(src)
    for j, v in zip(m_pos, views[n_o:]):
      old_src[j] = v
    new_src, new_o = apply(old_src, views[:n_o])
    keep = lambda new, old: [jnp.where(ok, a, b) for a, b in zip(new, old)]
    new_src, new_o = keep(new_src, old_src), keep(new_o, views[:n_o])
    written = [store(spec, x, l) for x, l in zip(new_o + [new_src[j] for j in m_pos], layouts)]
    return new_src, written

  weights = [device_bytes(l, spec.n_data, x.dtype) for x, l in zip(host, layouts)]
  new_src, written = stream(update, (src, finite), host, weights)
  new_masters = None
  if masters is not None:
    new_masters = [None] * len(masters)
    for j, x in zip(m_pos, written[n_o:]):
      new_masters[j] = x
  return new_src, written[:n_o], new_masters


def stream(fn: Callable, dev, host: list, weights: list, *, bucket_bytes: int | None = None,
           in_flight: int = IN_FLIGHT):
  """``fn(dev, host) -> (dev_out, host_out)`` evaluated a bucket of host leaves at a time.

  ``fn`` moves the host leaves it reads to the devices and its ``host_out``
  back to the host itself; this orders those moves. Its jaxpr is evaluated
  equation by equation, each once: the equations a bucket's outputs need,
  bucket after bucket, then the rest.

  Args:
    fn: a function of ``(dev, host)``; ``host`` is a list of arrays.
    dev: a pytree of arrays (on the devices, or scalars).
    host: the host-resident leaves.
    weights: per host leaf, its bytes on one device (bucket sizes).
    bucket_bytes: merge groups into buckets of at least this many bytes
      (default `BUCKET_BYTES`; 0: one group per bucket).
    in_flight: load a bucket only after the bucket this many places before
      it is written back.

  Returns:
    ``fn(dev, host)``.
  """
  flat_dev, dev_def = jax.tree.flatten(dev)
  out_defs = []

  def flat_fn(*xs):
    out = fn(jax.tree.unflatten(dev_def, xs[:len(flat_dev)]), list(xs[len(flat_dev):]))
    leaves, treedef = jax.tree.flatten(out)
    out_defs.append((treedef, len(jax.tree.leaves(out[0]))))
    return leaves

  closed = jax.make_jaxpr(flat_fn)(*flat_dev, *host)
  out_def, n_dev_out = out_defs[0]
  streamed = [k for k, x in enumerate(host) if jnp.ndim(x) > 0]
  buckets = plan(closed.jaxpr, [len(flat_dev) + k for k in streamed],
                 [weights[k] for k in streamed],
                 BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
  outs = _evaluate(closed, [*flat_dev, *host], buckets, n_dev_out, in_flight)
  return jax.tree.unflatten(out_def, outs)


def _dependencies(jaxpr, inputs: list[int]) -> list[int]:
  """Per output of ``jaxpr``, a bit mask of the ``inputs`` (invar positions) it reads.

  An equation's outputs are taken to read all its inputs (an inner jaxpr, as in
  ``pjit`` or ``cond``, is not looked into: that can only merge groups).
  """
  mask = {jaxpr.invars[p]: 1 << k for k, p in enumerate(inputs)}
  get = lambda v: 0 if isinstance(v, Literal) else mask.get(v, 0)
  for eqn in jaxpr.eqns:
    m = 0
    for v in eqn.invars:
      m |= get(v)
    for v in eqn.outvars:
      mask[v] = m
  return [get(v) for v in jaxpr.outvars]


def plan(jaxpr, inputs: list[int], weights: list[int], bucket_bytes: int):
  """Buckets of inputs that can be updated apart: ``[(input positions, output positions)]``.

  Inputs read by a common output are in one group; groups in input order,
  merged until a bucket weighs ``bucket_bytes``. Outputs that read none of
  ``inputs`` belong to no bucket; inputs that no output reads are left out.
  """
  parent = list(range(len(inputs)))

  def root(k):
    while parent[k] != k:
      parent[k] = parent[parent[k]]
      k = parent[k]
    return k

  masks = _dependencies(jaxpr, inputs)
  for m in masks:
    bits = [k for k in range(len(inputs)) if m >> k & 1]
    for k in bits[1:]:
      parent[root(k)] = root(bits[0])
  outs_of: dict[int, list[int]] = {}
  for p, m in enumerate(masks):
    if m:
      outs_of.setdefault(root((m & -m).bit_length() - 1), []).append(p)
  groups: dict[int, list[int]] = {}
  for k in range(len(inputs)):
    if root(k) in outs_of:
      groups.setdefault(root(k), []).append(k)
  buckets, ins, outs, weight = [], [], [], 0
  for r, members in groups.items():  # in order of each group's first input
    ins += [inputs[k] for k in members]
    outs += outs_of[r]
    weight += sum(weights[k] for k in members)
    if weight >= bucket_bytes:
      buckets.append((ins, sorted(outs)))
      ins, outs, weight = [], [], 0
  if ins:
    buckets.append((ins, sorted(outs)))
  return buckets


def _evaluate(closed, args: list, buckets, n_dev_out: int, in_flight: int) -> list:
  """Evaluates ``closed`` on ``args``, bucket by bucket (see `stream`)."""
  jaxpr = closed.jaxpr
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
  done: set[int] = set()

  def run(outvars):
    """Evaluates, in order, the equations not yet evaluated that ``outvars`` need."""
    todo, stack = set(), [v for v in outvars if not isinstance(v, Literal)]
    while stack:
      i = producer.get(stack.pop())
      if i is None or i in done or i in todo:
        continue
      todo.add(i)
      stack += [v for v in jaxpr.eqns[i].invars if not isinstance(v, Literal)]
    for i in sorted(todo):
      eqn = jaxpr.eqns[i]
      ans = _compat.eval_equation(eqn, list(map(read, eqn.invars)))
      env.update(zip(eqn.outvars, ans if eqn.primitive.multiple_results else [ans]))
      done.add(i)

  results: dict[int, object] = {}
  written = []  # per bucket, the positions of its host outputs
  for b, (ins, outs) in enumerate(buckets):
    vals = [env[jaxpr.invars[p]] for p in ins]
    if b >= in_flight and written[b - in_flight]:
      prev = written[b - in_flight]
      vals, after = jax.lax.optimization_barrier((vals, [results[p] for p in prev]))
      results.update(zip(prev, after))
    env.update(zip((jaxpr.invars[p] for p in ins), vals))
    run([jaxpr.outvars[p] for p in outs])
    results.update((p, read(jaxpr.outvars[p])) for p in outs)
    written.append([p for p in outs if p >= n_dev_out])
  run(jaxpr.outvars)
  return [results[p] if p in results else read(v) for p, v in enumerate(jaxpr.outvars)]
