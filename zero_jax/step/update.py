"""The update: the user's optimizer on logical, still-sharded views.

Gradient blocks, optimizer state and master weights are viewed in their original shapes, still
sharded, and the optax transformation runs on those views under XLA's SPMD partitioner, so any
``GradientTransformation`` gives its single-device result (one that takes extra arguments gets
``value=``, the global loss). A step with non-finite gradients changes only the loss scale and
skip counters (a ``lax.cond``; on GPUs a select, written in place); `full_params` gives the
whole parameters. Details: the docs' "How it works"."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zero_jax.comm import collectives
from zero_jax.step import compile_options
from zero_jax.step import context
from zero_jax.step import home_update
from zero_jax.comm import layout as lay
from zero_jax.numerics import loss_scale as ls
from zero_jax.step import monitor
from zero_jax.step import offload
from zero_jax.step import placement
from zero_jax.numerics import precision as prec
from zero_jax.numerics.clipping import clip_with_norm
from zero_jax.step.opt_call import optimizer_update
from zero_jax.step.spec import StepSpec
from zero_jax.step.state import TrainState, masked_optimizer


def norm_and_finite(grads):
  """(global L2 norm, every element finite) from one sum of squares."""
  if not grads:
    return jnp.float32(0), jnp.bool_(True)
  sq = sum(jnp.sum(jnp.square(jnp.abs(g)).astype(jnp.float32)) for g in grads)
  return jnp.sqrt(sq), jnp.isfinite(sq)


def keep_if_skipped(finite, new, old):
  """The new model state after a finite step, the old one (bit for bit) after a skipped one.

  A skipped step changes nothing but the loss scale: not the parameters, not the
  optimizer state, and not the model state (an overflowing fp16 step would
  otherwise write NaN BatchNorm statistics). Key leaves are kept as they are.
  """
  def one(n, o):
    if jnp.issubdtype(jnp.result_type(o), jax.dtypes.prng_key):
      return n
    return jnp.where(finite, n, o)
  return jax.tree.map(one, new, old)


def gather_params(spec: StepSpec, layouts, blocks, stacked, old):
  """Storage blocks (split over data and model axes) -> logical leaves split over model only.

  Bucketed (see `zero_jax.comm.collectives`; stacked leaves alone); on one device the
  blocks are the leaves. Stacked leaves are gathered one layer at a time into their
  ``old`` values' buffers (donated with the state), in one loop over the layers for all
  the stacks of one depth, each layer's leaves bucketed together: gathering a whole
  stack along a dimension behind the layers would leave a transposed copy of it in
  temporary memory, as large as the parameters.
  """
  if spec.n_data == 1:
    return [spec.constrain(lay.unpad(b, l), l.model_spec()) for b, l in zip(blocks, layouts)]
  layer_wise = [s and l.dim is not None and l.dim > 0 for s, l in zip(stacked, layouts)]
  groups = collectives.plan_buckets(layouts, [b.dtype for b in blocks],
                                    bucket_bytes=spec.comm.bucket_bytes, alone=stacked)
  groups = [g for g in groups if not layer_wise[g[0]]]
  depths: dict = {}  # number of layers -> the layer-wise leaves with that many
  for i, yes in enumerate(layer_wise):
    if yes:
      depths.setdefault(layouts[i].shape[0], []).append(i)

  def gather(bs, olds):
    out = collectives.all_gather_many(bs, layouts, groups, spec.comm, axes=spec.data_axes)
    for idx in depths.values():
      got = _gather_layer_by_layer(spec, [bs[i] for i in idx], [layouts[i] for i in idx],
                                   [olds[i] for i in idx])
      for i, full in zip(idx, got):
        out[i] = full
    return out

  specs = [l.spec(spec.data_axes) for l in layouts]
  model = [l.model_spec() for l in layouts]
  fn = jax.shard_map(gather, mesh=spec.auto_mesh, in_specs=(specs, model), out_specs=model)
  return fn(blocks, [o if w else None for o, w in zip(old, layer_wise)])


def refresh_secondary(spec: StepSpec, layouts, blocks):
  """hpZ: blocks split over every data axis -> the secondary copy split over the gather
  axes only, all-gathered over the outer axes (across hosts; int8 with quantized weights)."""
  groups = collectives.plan_buckets(layouts, [b.dtype for b in blocks],
                                    bucket_bytes=spec.comm.bucket_bytes)

  def gather(bs):
    return collectives.all_gather_many(bs, layouts, groups, spec.comm,
                                       axes=spec.comm.outer_axes, whole=False)
  fn = jax.shard_map(gather, mesh=spec.auto_mesh,
                     in_specs=([l.spec(spec.data_axes) for l in layouts],),
                     out_specs=[l.spec(spec.gather_axes) for l in layouts])
  return fn(blocks)


def _gather_layer_by_layer(spec: StepSpec, blocks, layouts, olds) -> list:
  """Stacked leaves of one depth gathered into ``olds``' buffers: one loop over the layers,
  each layer's slices bucketed as the other gathers are."""
  layer = [lay.Layout(l.shape[1:], l.dim - 1, l.padded, l.model[1:] if l.model else (),
                      l.model_size[1:] if l.model else ()) for l in layouts]
  groups = collectives.plan_buckets(layer, [b.dtype for b in blocks],
                                    bucket_bytes=spec.comm.bucket_bytes)

  def body(i, fulls):
    got = collectives.all_gather_many([b[i] for b in blocks], layer, groups, spec.comm,
                                      axes=spec.data_axes)
    return [jax.lax.dynamic_update_index_in_dim(f, g.astype(f.dtype), i, 0)
            for f, g in zip(fulls, got)]
  return jax.lax.fori_loop(0, layouts[0].shape[0], body, list(olds))


def _sources(spec: StepSpec, state: TrainState):
  """Per trainable leaf, the value the optimizer updates (logical view, optimizer dtype);
  None for a master copy kept on the host (``offload``: it is streamed in)."""
  meta, leaves = state.meta, jax.tree.leaves(state.params)
  masters = iter(state.master or [])
  out = []
  for i in meta.train_idx:
    l, x = meta.param_layouts[i], leaves[i]
    m = next(masters) if state.master is not None else None
    if meta.master[i] and meta.master_in_params:  # the parameter is the master copy
      out.append(spec.to_logical(x, l))
      continue
    if meta.master[i]:
      out.append(None if spec.offload else spec.to_logical(m, l))
      continue
    view = spec.to_logical(x, l) if spec.stage == 3 else spec.constrain(x, l.spec(spec.data_axes))
    out.append(view.astype(prec.optimizer_dtype(spec.policy, x.dtype)))
  return out


def _whole_sources(spec: StepSpec, state: TrainState) -> list:
  """Per parameter leaf, the value the optimizer updates where every device holds it whole
  (stages 1-2, no master copy), else None (`zero_jax.step.home_update`)."""
  meta = state.meta
  out = []
  for x, t, m in zip(jax.tree.leaves(state.params), meta.trainable, meta.master):
    whole = t and not m and spec.stage != 3
    out.append(x.astype(prec.optimizer_dtype(spec.policy, x.dtype)) if whole else None)
  return out


def apply_update(spec: StepSpec, optimizer, state: TrainState, grads: list, loss, aux,
                 weight=None):
  """The new state and the metrics, from the reduced gradient blocks.

  ``weight``: a `WeightedLoss`'s ``(global weight, any weight negative)`` (see
  `zero_jax.step.grads.Local`); a step whose global weight is not positive (a fully
  padded batch) is skipped like a non-finite one.
  """
  meta = state.meta
  treedef = jax.tree.structure(state.params)
  leaves = jax.tree.leaves(state.params)
  idx, t_layouts = meta.train_idx, [meta.param_layouts[i] for i in meta.train_idx]
  if spec.stage == 1:
    grads = [spec.constrain(g, l.spec(spec.data_axes)) for g, l in zip(grads, t_layouts)]
  else:
    grads = [spec.to_logical(g, l) for g, l in zip(grads, t_layouts)]
  grads = ls.unscale_grads(state.loss_scale, grads)
  grad_norm, finite = norm_and_finite(grads)
  ok = finite if weight is None else finite & (weight[0] > 0)  # whether the update applies
  if spec.max_grad_norm is not None:
    grads = clip_with_norm(grads, grad_norm, spec.max_grad_norm)

  o_leaves, o_def = jax.tree.flatten(state.opt_state)
  opt = masked_optimizer(optimizer, treedef, meta.trainable)

  def apply(src, o_views):
    full_src, full_grads = list(leaves), list(leaves)
    for j, i in enumerate(idx):
      full_src[i], full_grads[i] = src[j], grads[j].astype(src[j].dtype)
    for i, t in enumerate(meta.trainable):
      if not t:
        full_grads[i] = jnp.zeros(meta.param_layouts[i].shape, leaves[i].dtype)
        if spec.stage == 3:
          full_src[i] = lay.unpad(leaves[i], meta.param_layouts[i])
    if meta.whole is None:
      updates, new_opt = optimizer_update(opt, jax.tree.unflatten(treedef, full_grads),
                                          jax.tree.unflatten(o_def, o_views),
                                          jax.tree.unflatten(treedef, full_src), loss)
      updates = jax.tree.leaves(updates)
    else:
      updates, new_opt = home_update.update(
          spec, meta, optimizer, treedef, optimizer_update, full_grads,
          jax.tree.unflatten(o_def, o_views), full_src, loss=loss,
          whole_src=_whole_sources(spec, state))
    new_src = [(s + updates[i]).astype(s.dtype) for s, i in zip(src, idx)]
    return new_src, [x.astype(y.dtype) for x, y in zip(jax.tree.leaves(new_opt), o_leaves)]

  if spec.offload is not None:
    new_src, new_o, master = offload.streamed_update(
        spec, meta, apply, _sources(spec, state), state.master, o_leaves, ok)
  else:
    src = _sources(spec, state)
    o_views = [spec.to_logical(x, l) for x, l in zip(o_leaves, meta.opt_layouts)]
    new_src, new_o = _skip_or_apply(spec, ok, apply, src, o_views)
    new_o = [spec.to_storage(x, l) for x, l in zip(new_o, meta.opt_layouts)]
    master = None
    if meta.master_list:
      master = [spec.to_storage(s, l) if meta.master[i] else None
                for s, i, l in zip(new_src, idx, t_layouts)]
  new_params = _new_params(spec, meta, leaves, new_src, t_layouts, ok)
  new_scale = ls.adjust_loss_scale(state.loss_scale, finite, applied=ok)
  new_state = state.replace(
      step=state.step + 1, params=jax.tree.unflatten(treedef, new_params), master=master,
      opt_state=jax.tree.unflatten(o_def, new_o), loss_scale=new_scale)
  metrics = {"loss": loss, "grad_norm": grad_norm, "grads_finite": finite,
             "loss_scale": state.loss_scale.scale, "skipped_steps": new_scale.skipped_steps,
             "step": state.step, "health": monitor.health(ok, loss, finite, weight)}
  if spec.has_aux:
    metrics["aux"] = aux
  return new_state, metrics


def selects(spec: StepSpec) -> bool:
  """Whether `_skip_or_apply` keeps a skipped step's values by a select (GPUs), not a cond."""
  return compile_options.on_gpus(spec.mesh)


def _skip_or_apply(spec: StepSpec, ok, apply, src, o_views):
  """``apply(src, o_views)`` when ``ok``, else ``(src, o_views)`` as they are, bit for bit.

  On GPUs a select of each new value against its old one (XLA:GPU writes each over the old
  buffer; a ``lax.cond`` gets its results buffers of their own, so the whole new state
  would be held beside the old at once: the stage-3 step's peak, 12 bytes a parameter with
  Adam: Llama-3-8B on 8 H100s 26.2 -> 21.8 GiB). Elsewhere a ``lax.cond``, which XLA:CPU
  updates in place and the select does not (an fp32 stage-2 Adam step's temporaries
  measured 4 MiB against 23 MiB)."""
  if selects(spec):
    new_src, new_o = apply(src, o_views)
    return keep_if_skipped(ok, new_src, list(src)), keep_if_skipped(ok, new_o, o_views)
  return jax.lax.cond(ok, lambda _: apply(src, o_views), lambda _: (list(src), o_views), None)


def _new_params(spec: StepSpec, meta, leaves, new_src, t_layouts, ok) -> list:
  """The parameters after the update: stage 3 keeps blocks, stages 1-2 all-gather.

  A gather with int8 weights (qwZ) rounds what it rebuilds, so after a skipped step
  (``ok`` false) the old parameters are kept as they were, bit for bit."""
  blocks = [spec.to_storage(s.astype(leaves[i].dtype), l)
            for s, i, l in zip(new_src, meta.train_idx, t_layouts)]
  out = list(leaves)
  gathered = spec.stage != 3 or bool(spec.comm.outer_axes)
  if spec.stage == 3:
    full = refresh_secondary(spec, t_layouts, blocks) if gathered else blocks
  else:
    full = gather_params(spec, t_layouts, blocks, [meta.stacked[i] for i in meta.train_idx],
                         [leaves[i] for i in meta.train_idx])
  rounded = gathered and spec.comm.quantize is not None and spec.comm.quantize.weights
  for i, x in zip(meta.train_idx, full):
    out[i] = jnp.where(ok, x, leaves[i]) if rounded else x
  return out


def full_params(spec: StepSpec, state: TrainState):
  """The parameters of ``state`` whole: original shapes and tree, the fp32 master where
  there is one, replicated over the batch axes and split over the model axes."""
  meta = state.meta
  leaves = list(jax.tree.leaves(state.params))
  masters = state.master or [None] * len(meta.train_idx)
  for m, i in zip(masters, meta.train_idx):
    if m is not None:
      leaves[i] = placement.to_memory(spec, m, meta.param_layouts[i], placement.DEVICE)
  specs = [l.model_spec() for l in meta.param_layouts]

  def body(leaves):
    return [spec.constrain(lay.unpad(x, l) if x.shape != l.shape else x, s)
            for x, l, s in zip(leaves, meta.param_layouts, specs)]
  out = context.in_auto(spec, body, lambda *_: specs)(leaves)
  return jax.tree.unflatten(jax.tree.structure(state.params), out)
