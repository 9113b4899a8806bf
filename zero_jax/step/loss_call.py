"""The parameter tree ``loss_fn`` sees on one device, and the loss called on it.

Inside the loss's ``shard_map`` (manual over the batch axes). Stage 3 gathers each plain leaf
(bucketed, named for the remat policy), leaves ``stacked=`` leaves split as `ShardedParam`s that
`zero_jax.gather` / `zero_jax.scan` gather a layer at a time and ``lookup=`` tables as
`zero_jax.layers.lookup.LookupTable`s; where the state keeps the float32 master as its
parameters each block is cast to the compute dtype as it is gathered
(`StateMeta.gather_dtype`), never whole beforehand. `loss_call` runs ``loss_fn`` on that tree.
The training step (`zero_jax.step.grads`) differentiates through these; `forward_params` is
what ``step.evaluate`` and ``step.apply`` (`zero_jax.step.forward`) use without a gradient.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

from zero_jax.comm import collectives
from zero_jax.layers import lookup
from zero_jax.layers.stacked import ShardedParam
from zero_jax.step.loss import call_loss
from zero_jax.step.spec import StepSpec


_GATHERED = "zero_jax_gathered_param"


def gather_groups(spec: StepSpec, meta, idx) -> tuple:
  """Buckets for the stage-3 gathers of leaves ``idx`` (stacked leaves are not gathered here)."""
  layouts = [meta.param_layouts[i] for i in idx]
  dtypes = [meta.param_dtypes[i] for i in idx]
  return collectives.plan_buckets(layouts, dtypes, bucket_bytes=spec.comm.bucket_bytes,
                                  alone=[meta.stacked[i] for i in idx])


def _gather(spec: StepSpec, meta, leaves: dict, to: str) -> dict:
  """Stage 3: ``{i: block}`` -> ``{i: gathered leaf}``, bucketed, named for the remat policy;
  each block cast to its `StateMeta.gather_dtype` as it is gathered."""
  idx = sorted(leaves)
  groups = gather_groups(spec, meta, idx)
  blocks, layouts = [leaves[i] for i in idx], [meta.param_layouts[i] for i in idx]
  dtypes = [meta.gather_dtype(i) for i in idx]
  if to == "varying":
    full = collectives.gather_in_loss(blocks, layouts, groups, spec.comm, dtypes=dtypes)
  else:
    full = collectives.all_gather_many(blocks, layouts, groups, spec.comm, to=to,
                                       dtypes=dtypes)
  return {i: checkpoint_name(x, _GATHERED) for i, x in zip(idx, full)}


def reduced_in_loop(spec: StepSpec, meta) -> list[bool]:
  """Per parameter leaf: a stacked leaf whose gradient `zero_jax.gather` (or
  `zero_jax.scan`) reduces whole inside the loss's loop, into a differentiated stand-in
  (`_stand_in`, see `zero_jax.layers.stacked`): at stage 2, and at stage 3 where the
  gradient goes on across hosts or replicas after the gather's transpose (`outer_reduced`)."""
  sinks = spec.param_stage == 3 and outer_reduced(spec)
  return [t and s and l.dim is not None and (sinks or spec.param_stage == 2 and not l.has_model)
          for t, s, l in zip(meta.trainable, meta.stacked, meta.param_layouts)]


def gather_all(spec: StepSpec, meta, blocks) -> list:
  """Stage 3 with ``gather_once``: every block gathered (bucketed), identical on all devices."""
  full = collectives.all_gather_many(
      blocks, meta.param_layouts, gather_groups(spec, meta, range(len(blocks))),
      spec.comm, to="invarying", dtypes=[meta.gather_dtype(i) for i in range(len(blocks))])
  return [checkpoint_name(x, _GATHERED) for x in full]


def loss_params(spec: StepSpec, meta, treedef, paths, frozen, train, leaves):
  """The parameter tree ``loss_fn`` sees: stage 3 gathers (or wraps stacked leaves, and
  ``lookup=`` tables as `zero_jax.layers.lookup.LookupTable`s, each carrying the dtype its
  gather casts to: `StateMeta.gather_dtype`); stage 2 wraps the stacked leaves whose
  gradient is reduced in the loop."""
  in_loop = reduced_in_loop(spec, meta)
  if spec.param_stage != 3:
    full = {**frozen, **train}
    for i, yes in enumerate(in_loop):
      if yes:
        full[i] = ShardedParam(train[i], meta.param_layouts[i], spec.comm, paths[i],
                               full=leaves[i], batch_axes=spec.batch_axes)
    return jax.tree.unflatten(treedef, [full[i] for i in range(len(paths))])
  full = {}
  for part, to in ((frozen, "invarying"), (train, "varying")):
    plain = {i: x for i, x in part.items() if not meta.stacked[i] and not meta.is_lookup(i)}
    full.update(_gather(spec, meta, plain, to))
    # A table's gradient is reduced over the gather axes by `take`'s transpose (and over
    # the other axes by `reduce_some`, as a gathered leaf's): no sink, as for a plain leaf.
    full.update({i: lookup.LookupTable(x, meta.param_layouts[i], spec.comm, paths[i],
                                       gather_dtype=meta.gather_dtype(i))
                 for i, x in part.items() if meta.is_lookup(i)})
    # the block differentiated, or with a sink (`reduced_in_loop`) the block as it is
    full.update({i: ShardedParam(leaves[i], meta.param_layouts[i], spec.comm, paths[i],
                                 sink=x, gather_dtype=meta.gather_dtype(i)) if in_loop[i] else
                 ShardedParam(x, meta.param_layouts[i], spec.comm, paths[i],
                              gather_dtype=meta.gather_dtype(i))
                 for i, x in part.items() if meta.stacked[i]})
  return jax.tree.unflatten(treedef, [full[i] for i in range(len(paths))])


def outer_reduced(spec: StepSpec) -> bool:
  """Stage 3 reduces gradients over the outer (hpZ) and replica axes itself, after the
  gather's transpose has reduce-scattered them over the gather axes. (Left to the
  transpose of a replicated input, the replica sum would be taken of the whole
  gradient, before the reduce-scatter: N times the bytes across hosts.)"""
  comm = spec.comm
  return spec.param_stage == 3 and bool(comm.outer_axes or comm.replica_axes)


def _is_sharded(x) -> bool:
  return isinstance(x, ShardedParam)


def loss_call(spec: StepSpec, meta, loss_fn, params, mb, ms, key):
  """``loss_fn`` on one device's micro-batch (`zero_jax.step.loss.call_loss`, checked) ->
  ``(LossOutput, w)``: ``w`` the micro-batch's global `WeightedLoss` weight (summed over the
  batch axes), None for a mean loss. The step's objective and `zero_jax.step.forward` share it."""
  axes = spec.batch_axes
  whole = {} if spec.param_stage != 3 else {  # `zero_jax.take` on one of them raises
      id(x): jax.tree_util.keystr(path) for path, x in
      jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_sharded)[0] if not _is_sharded(x)}
  with lookup.in_stage3_loss(whole):
    out = call_loss(loss_fn, params, mb, model_state=ms, rng=key, has_aux=spec.has_aux,
                    batch_axes=axes, mesh_axes=tuple(spec.mesh.axis_names),
                    gathered_whole=spec.param_stage == 3 and not any(meta.stacked))
  return out, None if out.weight is None else jax.lax.psum(out.weight, axes)


def forward_params(spec: StepSpec, meta, params):
  """Inside the loss's ``shard_map``: the parameter tree a forward pass without a gradient
  sees, as the step's loss sees it. Stage 3: plain leaves gathered (bucketed, quantized as
  the step's forward gathers them; over the hpZ axes only with ``hpz_axis``), stacked leaves
  `ShardedParam`s that `zero_jax.gather` / `zero_jax.scan` gather a layer at a time; with
  ``gather_once`` or at stages 1-2 the whole leaves; a float32 master block cast to the compute
  dtype as it is gathered (a stacked leaf's a layer at a time). Every gathered value is
  device-invariant, as a replicated parameter is (`Comm.forward_only`)."""
  treedef, leaves = jax.tree.structure(params), jax.tree.leaves(params)
  if spec.gather_once:
    leaves = gather_all(spec, meta, leaves)
  if spec.param_stage != 3:
    return jax.tree.unflatten(treedef, leaves)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  spec = dataclasses.replace(spec, comm=dataclasses.replace(spec.comm, forward_only=True))
  return loss_params(spec, meta, treedef, paths, dict(enumerate(leaves)), {}, leaves)
