"""Each device's gradient, inside ``shard_map``, reduced to its block.

Manual over the batch axes only: micro-batches in a ``lax.scan``, ``loss_fn`` differentiated
with respect to a device-varying copy of the parameters (so the gradient is the device's own),
then an all-reduce (stage 1), a reduce-scatter (stage 2) or the transpose of the parameter
gather (stage 3), and the per-device ``fold_in`` keys. Details: the docs' "How it works".
The parameter tree the loss sees and the call of the loss are `zero_jax.step.loss_call`'s; the
pieces around them (`loss_inputs`, `micro_batches`, `agreed`) are also
`zero_jax.step.forward`'s, which runs the loss without a gradient (``step.evaluate``/``apply``)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_jax.step import aux as aux_lib
from zero_jax.comm import collectives
from zero_jax.comm.axes import make_varying
from zero_jax.comm import layout as lay
from zero_jax.numerics import loss_scale as ls
from zero_jax.step import loss_call as lc
from zero_jax.step.home_update import device_index
from zero_jax.step.spec import StepSpec


def _bucket_shapes(spec: StepSpec, meta) -> set:
  """Shapes of the intermediate values of stage 3's bucketed gathers (see collectives)."""
  shapes, n = set(), math.prod(spec.mesh.shape[a] for a in spec.gather_axes)
  for frozen in (False, True):
    idx = [i for i, t in enumerate(meta.trainable)
           if t != frozen and not meta.stacked[i] and not meta.is_lookup(i)]
    for g in lc.gather_groups(spec, meta, idx):
      if len(g) < 2:
        continue
      sizes = [math.prod(lay.local_storage_shape(meta.param_layouts[i], n)) for i in g]
      shapes.add((n, sum(sizes)))
      for i, s in zip(g, sizes):
        l = meta.param_layouts[i]
        shapes |= {(n, s), (l.padded,) + tuple(d for j, d in enumerate(l.shape) if j != l.dim)}
  return shapes


def _cast_shapes(spec: StepSpec, meta) -> set:
  """Shapes of the device blocks that stage 3's gathers cast (`StateMeta.gather_dtype`) inside
  the loss: recomputed from the float32 block in the backward pass, never saved (a saved cast
  would be the half-precision copy the layout does without)."""
  n = math.prod(spec.mesh.shape[a] for a in spec.gather_axes)
  return {lay.local_storage_shape(l, n) for i, l in enumerate(meta.param_layouts)
          if meta.gather_dtype(i) is not None and l.dim is not None}


def regather_policy(layouts, extra_shapes=frozenset()):
  """Stage-3 remat policy: save activations, never a gathered parameter.

  A gathered leaf must be gathered again in the backward pass, so no value
  computed from it alone may be saved: not the all-gather's output, not the
  un-padding slice, and not what ``loss_fn`` derives from it before combining
  it with activations (``w.T``, ``w.astype(bf16)``). Such values are
  recognised as the results of operations with a single non-scalar input
  shaped like a gathered leaf (logical, padded or reversed shape); an
  activation that happens to have such a shape is recomputed (cheap).
  """
  shapes = set(extra_shapes)
  for l in layouts:
    if l.dim is not None:
      shapes |= {l.shape, l.storage_shape, l.shape[::-1]}

  def policy(prim, *avals, **params):
    if prim.name in ("all_gather", "all_gather_invariant") or _complex(prim, avals, params):
      return False
    arrays = [tuple(a.shape) for a in avals if getattr(a, "ndim", 0)]
    return not (len(arrays) == 1 and arrays[0] in shapes)
  return policy


def _complex(prim, avals, params) -> bool:
  """Whether an operation reads or makes a complex value: `regather_policy` never saves one,
  as JAX's remat rounds every saved value with ``reduce_precision``, which refuses complex
  dtypes; such a value is recomputed in the backward pass instead (the same operations)."""
  is_complex = lambda a: jnp.issubdtype(getattr(a, "dtype", jnp.float32), jnp.complexfloating)
  if any(map(is_complex, avals)):
    return True
  try:
    out = prim.abstract_eval(*avals, **params)
  except Exception:  # pylint: disable=broad-except
    return False  # a primitive JAX cannot evaluate abstractly here: judged by its shapes alone
  if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], (set, frozenset)):
    out = out[0]  # (avals, effects)
  return any(map(is_complex, out if isinstance(out, (list, tuple)) else [out]))


def _is_key(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key)


def fold_key(key, step, micro, batch_axes):
  """This device's key for one micro-batch (see the module docstring); each key of a
  key array (e.g. the per-layer keys of an ``nnx.vmap``-stacked block) alike."""
  dev = jax.lax.axis_index(batch_axes)
  fold = lambda k: jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(k, step), dev), micro)
  for _ in range(key.ndim if _is_key(key) else 0):  # a raw uint32 key is one key
    fold = jax.vmap(fold)
  return fold(key)


def _with_device_keys(ms, original, step, micro, batch_axes):
  """Model state whose key leaves are this device's streams for this micro-batch."""
  return jax.tree.map(lambda x, o: fold_key(o, step, micro, batch_axes) if _is_key(o) else x,
                      ms, original)


def average_model_state(ms, original, batch_axes):
  """New model state agreed by every device: floats averaged, keys kept, ints the max.

  Floats average their change, so that a leaf no device changed stays exactly
  as it was (a mean of N equal values may round).
  """
  def one(x, o):
    if _is_key(o):
      return o
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      return (o + jax.lax.pmean(x - o, batch_axes)).astype(x.dtype)
    return jax.lax.pmax(x, batch_axes)
  return jax.tree.map(one, ms, original)


class Local(NamedTuple):
  """One device's results. grads: one per trainable leaf (reduced, or local).

  aux: a `zero_jax.step.aux.Parts` inside the shard_map, the combined aux tree after it.
  weight: for a `WeightedLoss`, ``(global weight, any device's weight < 0)``
  of the whole step; None for a mean loss.
  aux_specs: the PartitionSpecs of the combined aux (set by `sharded_grads`).
  """
  grads: list
  loss: jax.Array
  aux: Any
  model_state: Any
  weight: Any = None
  aux_specs: Any = None


def _differentiated(spec: StepSpec, meta, leaves) -> tuple[list, list]:
  """What the gradient is taken with respect to, per trainable leaf, and which leaves'
  gradients `zero_jax.gather` reduces inside the loss's loop (`reduced_in_loop`).

  Stage 3: the blocks (the gather's transpose reduces), made device-varying over the
  axes `outer_reduced` reduces explicitly. Stages 1-2: a device-varying copy of each leaf,
  so the gradient is the device's own and not already summed over devices. A leaf reduced
  in the loop: its stand-in (`_stand_in`), which receives its reduced block.
  """
  in_loop = lc.reduced_in_loop(spec, meta)
  local = spec.batch_axes if spec.param_stage != 3 else \
      spec.comm.outer_axes + spec.replica_axes if lc.outer_reduced(spec) else ()
  diff = [_stand_in(spec, meta.param_layouts[i], leaves[i]) if in_loop[i] else
          jax.lax.pcast(leaves[i], local, to="varying") if local else leaves[i]
          for i in meta.train_idx]
  return diff, in_loop


def _stand_in(spec: StepSpec, layout, leaf):
  """The differentiated stand-in of a leaf reduced in the loop: its gradient is the reduced
  block (split over every data axis; model-split dimensions whole, as the step's
  ``shard_map`` sees them). It holds the device's block of the weights (stage 2: of the
  whole ``leaf``; stage 3: of ``leaf``'s block over the gather axes, split again over the
  outer axes as `reduce_outer_many` splits its gradient), so that a function the loss maps
  over a stacked leaf (``jax.tree.map`` reaches the stand-in too) is differentiated at the
  weights. Its value is read by nothing else."""
  if spec.param_stage == 3:
    axes, within = spec.comm.outer_axes, lay.Layout(leaf.shape, layout.dim, leaf.shape[layout.dim])
  else:
    axes, within = spec.data_axes, lay.Layout(layout.shape, layout.dim, layout.padded)
  size = within.padded // math.prod(jax.lax.axis_size(a) for a in axes)
  block = jax.lax.dynamic_slice_in_dim(lay.pad(leaf, within), device_index(axes) * size, size,
                                       axis=within.dim)
  return make_varying(block.astype(jnp.promote_types(leaf.dtype, jnp.float32)), spec.data_axes)


def _upcast(g):
  return g.astype(jnp.promote_types(g.dtype, jnp.float32))


def reduce_some(spec: StepSpec, layouts, grads, which, stacked, wire=None) -> list:
  """Local gradients -> reduced blocks for the leaves marked in ``which`` (bucketed);
  the others are only upcast. Stage 3's arrive reduced over the gather axes (the
  gather's transpose); `outer_reduced` ones are reduced over the other axes here, in
  ``wire`` (per leaf: the dtype it was gathered in, whose gradient the gather's transpose
  widened to the float32 master's; None: as it is)."""
  idx = [j for j, w in enumerate(which) if w]
  out = [_upcast(g) for g in grads]
  if not idx or (spec.param_stage == 3 and not lc.outer_reduced(spec)):
    return out
  grads = collectives.in_gather_dtype(grads, wire)
  if spec.stage == 1:
    for j in idx:  # XLA combines these all-reduces itself; one device needs none
      if spec.n_batch > 1 or layouts[j].dim is None:
        out[j] = collectives.all_reduce(grads[j], spec.batch_axes, spec.comm)
    return out
  sub = [layouts[j] for j in idx]
  groups = collectives.plan_buckets(sub, [grads[j].dtype for j in idx],
                                    bucket_bytes=spec.comm.bucket_bytes,
                                    alone=[stacked[j] for j in idx])
  many = collectives.reduce_outer_many if spec.param_stage == 3 else \
      collectives.reduce_scatter_many
  for j, g in zip(idx, many([grads[j] for j in idx], sub, groups, spec.comm)):
    out[j] = _upcast(g)
  return out


def _objective(spec: StepSpec, meta, loss_fn, params, frozen, leaves, scale):
  """The function of the trainable leaves that is differentiated on each device (see
  the module docstring): the loss, normalised so that the summed gradient is global."""
  treedef = jax.tree.structure(params)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  k, axes = spec.grad_accum_steps, spec.batch_axes

  def objective(train_leaves, mb, ms, key):
    p = lc.loss_params(spec, meta, treedef, paths, frozen, dict(zip(meta.train_idx, train_leaves)),
                     leaves)
    out, w = lc.loss_call(spec, meta, loss_fn, p, mb, ms, key)
    denom = spec.n_batch * k if w is None else k * _nonzero(w)
    return ls.scale_loss(scale, out.value) / denom, (out, w)

  if spec.param_stage == 3 and not any(meta.stacked):  # re-gather for the backward pass
    objective = jax.checkpoint(objective, policy=regather_policy(
        meta.param_layouts, _bucket_shapes(spec, meta) | _cast_shapes(spec, meta)))
  return objective


def micro_inputs(state, ms, j, axes):
  """This device's key and model state for micro-batch ``j`` (``ms``: the model state it
  starts from; key leaves folded as `fold_key` says, from the state's own keys)."""
  key = None if state.rng is None else fold_key(state.rng, state.step, j, axes)
  ms_in = None if ms is None else _with_device_keys(ms, state.model_state, state.step, j, axes)
  return key, ms_in


def micro_results(spec: StepSpec, out, w, mb) -> tuple:
  """What `micro_batches` sums and combines of one micro-batch's loss call besides the
  gradient: ``(loss value in float32, (global weight, this device's negative weight) or
  None, aux parts or None)``."""
  ws = None if w is None else (w, jnp.minimum(out.weight, 0))
  aux = None if not spec.has_aux else aux_lib.start(spec.aux_reduce, out.aux,
                                                    jax.tree.leaves(mb)[0].shape[0])
  return out.value.astype(jnp.float32), ws, aux


def local_grads(spec: StepSpec, loss_fn, reduce_here, state, batch) -> Local:
  """Runs on each device inside the ``shard_map`` (see the module docstring).

  ``state`` holds the device's parameters, model state, key, loss scale and
  step (no optimizer state or master copy). ``reduce_here[j]`` says
  whether trainable leaf ``j`` is reduced here; the others are returned local
  (scaled, summed over micro-batches) for `reduce_model_split`.
  """
  meta, k, axes = state.meta, spec.grad_accum_steps, spec.batch_axes
  leaves = jax.tree.leaves(state.params)  # stage 3: cast as gathered (`_gather`, `gather`)
  if spec.gather_once:  # gather once; the rest is stage 2's path (`StepSpec.param_stage`)
    leaves = lc.gather_all(spec, meta, leaves)
  idx = meta.train_idx
  layouts = [meta.param_layouts[i] for i in idx]
  stacks = [meta.stacked[i] for i in idx]
  wire = [meta.gather_dtype(i) for i in idx] if spec.param_stage == 3 else None
  frozen = {i: leaves[i] for i, t in enumerate(meta.trainable) if not t}
  sharded_acc = spec.accumulate == "sharded" or spec.param_stage == 3  # gather_once: either
  grad_fn = jax.value_and_grad(_objective(spec, meta, loss_fn, state.params, frozen, leaves,
                                          state.loss_scale), has_aux=True)
  diff, in_loop = _differentiated(spec, meta, leaves)
  reduce_here = [r and not in_loop[i] for i, r in zip(idx, reduce_here)]
  model_state = state.model_state

  def micro(mb, ms, j):
    key, ms_in = micro_inputs(state, ms, j, axes)
    (_, (out, w)), g = grad_fn(diff, mb, ms_in, key)
    reduce_now = sharded_acc or k == 1
    g = reduce_some(spec, layouts, g, [reduce_now and r for r in reduce_here], stacks, wire)
    # Undo this micro-batch's normaliser (1/W comes at the end), after the reduction and in
    # float32: an fp16 gradient of the sum overflows where that of the mean does not.
    if w is not None and k > 1:
      g = [x * (k * w).astype(x.dtype) for x in g]
    return (g,) + micro_results(spec, out, w, mb) + (out.model_state,)

  grads, total, ws, aux, ms = micro_batches(micro, batch, model_state, k)
  weight = None if ws is None else ws[0]
  if k > 1:
    if weight is not None:  # the global weight W of the whole step
      grads = [x / _nonzero(weight).astype(x.dtype) for x in grads]
    if not sharded_acc:
      grads = reduce_some(spec, layouts, grads, reduce_here, stacks, wire)
  if ws is not None:
    ws = (weight, jax.lax.psum(ws[1], axes) < 0)
  return agreed(grads, total, ws, aux_lib.finish(aux, k, axes), ms, model_state, k, axes)


def _nonzero(w):
  return jnp.where(w > 0, w, 1.0)


def micro_batches(micro, batch, model_state, k: int):
  """``micro`` over the ``k`` micro-batches of ``batch`` in order (a ``lax.scan``), summing
  its first three results, combining the aux (`zero_jax.step.aux.Parts`: per-example rows
  kept in order) and threading the model state; the first one runs before the scan so
  that the carry has the types (and device variance) of a real iteration."""
  if k == 1:
    return micro(batch, model_state, 0)
  mbs = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
  first = micro(jax.tree.map(lambda x: x[0], mbs), model_state, 0)

  def body(carry, xs):
    out = micro(xs[0], carry[4], xs[1])
    add = lambda a, b: jax.tree.map(jnp.add, a, b)
    return tuple(add(c, o) for c, o in zip(carry[:3], out[:3])) + (
        aux_lib.merge(carry[3], out[3]), out[4]), aux_lib.rows(out[3])

  rest = jax.tree.map(lambda x: x[1:], mbs)
  init = first[:3] + (aux_lib.carried(first[3]), first[4])
  last, stacked = jax.lax.scan(body, init, (rest, jnp.arange(1, k)))
  return last[:3] + (aux_lib.joined(last[3], first[3], stacked), last[4])


def agreed(grads, total, weight, aux, ms, model_state, k: int, axes) -> Local:
  """The values every device agrees on: the global loss (weighted or mean: NaN for a
  global weight of zero, as on one device) and model state averaged over the batch axes;
  the gradients and aux as they are."""
  if weight is not None:
    loss = jax.lax.psum(total, axes) / weight[0]
  else:
    loss = jax.lax.pmean(total / k, axes)
  if ms is not None:
    ms = average_model_state(ms, model_state, axes)
  return Local(grads, loss, aux, ms, weight)


def _stack_spec(spec: StepSpec, layout) -> P:
  """Spec of a local gradient stacked over the batch devices, with its model split."""
  model = layout.model_spec()
  return P(spec.batch_axes, *(list(model) + [None] * (len(layout.shape) - len(model))))


def reduce_model_split(spec: StepSpec, layouts, stacked_grads):
  """Reduces local gradients of model-split leaves on their model blocks (fully manual).

  Args:
    spec: the step's spec.
    layouts: the leaves' layouts.
    stacked_grads: per leaf, the local gradients stacked along a leading
      dimension over the batch devices (``P(batch_axes, *model split)``).

  Returns:
    Per leaf, the reduced gradient: the storage view split over data and
    model axes (stage 2), or the logical leaf split over model axes (stage 1).
  """
  def body(gs):
    return reduce_some(spec, layouts, [g[0] for g in gs], [True] * len(gs), [True] * len(gs))
  out_specs = [l.spec(spec.data_axes) if spec.stage == 2 else l.model_spec() for l in layouts]
  return jax.shard_map(body, mesh=spec.auto_mesh,
                       in_specs=([_stack_spec(spec, l) for l in layouts],),
                       out_specs=out_specs)(stacked_grads)


def loss_inputs(spec: StepSpec, state):
  """What the loss's ``shard_map`` (manual over the batch axes) takes of ``state``, and its
  in_specs: the parameters as stored (stage 3: split over the gather axes), the model state,
  key, loss scale and step replicated; no optimizer state or master copy."""
  stored = spec.gather_axes if spec.stage == 3 else None
  param_specs = jax.tree.unflatten(jax.tree.structure(state.params), [
      l.data_spec(stored) if stored else P() for l in state.meta.param_layouts])
  inputs = state.replace(master=None, opt_state=None)
  return inputs, inputs.replace(step=P(), params=param_specs, loss_scale=P(), model_state=P(),
                                rng=P())


def with_aux_reduced(spec: StepSpec, out: Local) -> Local:
  """The loss ``shard_map``'s `Local` with its aux parts combined over the devices
  (`zero_jax.step.aux.reduce_devices`) and their specs set."""
  if out.aux is None:
    return out
  axes = spec.batch_axes
  return out._replace(aux=aux_lib.reduce_devices(out.aux, spec.constrain, axes),
                      aux_specs=aux_lib.specs(out.aux, axes))


def sharded_grads(spec: StepSpec, loss_fn, state, batch) -> Local:
  """The step's gradient: one reduced block (stage 2-3) or leaf (stage 1) per trainable leaf.

  Args:
    spec: the step's spec.
    loss_fn: the loss the step calls.
    state: the `TrainState` (its optimizer state and master copy are not read).
    batch: the global batch, split over the batch axes.

  Returns:
    A `Local` of global arrays: grads in their storage spec (stages 2-3) or
    replicated over the data axes (stage 1); loss and model state
    replicated; aux as `zero_jax.step.aux` combines it (per-example leaves split over
    the batch axes).
  """
  axes, meta = spec.batch_axes, state.meta
  layouts = [meta.param_layouts[i] for i in meta.train_idx]
  split_later = [l.has_model and spec.stage != 3 and spec.accumulate == "local"
                 for l in layouts]
  invariant = spec.stage == 1 and spec.n_batch > 1  # stage 1 all-reduces (unless one device)
  grad_specs = [P(axes) if later else (P() if invariant else l.data_spec(spec.data_axes))
                for l, later in zip(layouts, split_later)]
  reduce_here = [not later for later in split_later]

  def body(state, batch):
    out = local_grads(spec, loss_fn, reduce_here, state, batch)
    return out._replace(grads=[g[None] if later else g
                               for g, later in zip(out.grads, split_later)])

  inputs, in_specs = loss_inputs(spec, state)
  local = jax.shard_map(body, mesh=spec.auto_mesh, axis_names=set(axes),
                        in_specs=(in_specs, P(axes)),
                        out_specs=Local(grad_specs, P(), P(axes), P(), P()))
  out = with_aux_reduced(spec, local(inputs, batch))
  if any(split_later):
    later = [j for j, s in enumerate(split_later) if s]
    reduced = reduce_model_split(spec, [layouts[j] for j in later],
                                 [out.grads[j] for j in later])
    grads = list(out.grads)
    for j, g in zip(later, reduced):
      grads[j] = g
    out = out._replace(grads=grads)
  return out

