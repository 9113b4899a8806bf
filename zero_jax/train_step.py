"""`make_sharded_train_step`: ZeRO stages 1-3 as one compiled function.

How a step runs (all inside one ``jax.jit``):

1. **Gradients, in ``shard_map``.** Each device evaluates ``loss_fn`` on its
   slice of the global batch and differentiates it with respect to a
   device-varying copy of the parameters (``lax.pcast(..., to="varying")``),
   so the gradient is the device's own, not already summed. Stage 1
   all-reduces it; stage 2 reduce-scatters it (``psum_scatter``) so a device
   only ever receives its block of the averaged gradient. Stage 3 keeps the
   parameters sharded at rest and all-gathers each leaf inside the loss; the
   transpose of that gather is the reduce-scatter. Leaves marked ``stacked=``
   are gathered by ``loss_fn`` itself, one layer's slice at a time inside its
   loop over layers (`zero_jax.stacked`), and gathered again by the backward
   loop; the others are gathered before ``loss_fn`` runs, under a
   ``jax.checkpoint`` that asks XLA to gather them again for the backward
   pass rather than keep them (XLA:CPU does not: see BENCHMARKS.md).
2. **The update, on logical arrays.** The optimizer is not run on slices.
   Gradient blocks, optimizer state and master weights are viewed in their
   original (logical) shapes, still sharded over the data axis, and the user's
   ``optax`` transformation runs on those global views under XLA's SPMD
   partitioner. Elementwise math stays on each device's block; anything that
   needs the whole leaf or the whole tree (LAMB/LARS trust ratios, Adafactor's
   factored moments, ``clip_by_global_norm`` in a ``chain``, masks, labels,
   schedules) gets the exact cross-device reduction it needs from the
   compiler. So every ``GradientTransformation`` gives its single-device
   result by construction, with no list of special cases, while its state is
   stored 1/N per device.
3. **Parameters rebuilt, in ``shard_map``.** Each device's updated block is
   cast to the parameter dtype and all-gathered (stages 1-2); stage 3 keeps
   the blocks.

What is split and how: every leaf of the optimizer state, of the gradient
(stage 2+), of the fp32 master copy (mixed precision) and of the parameters
(stage 3) is split along one dimension, padded at its end to a multiple of
the data-axis size; see `zero_jax.layout`. Zero-dimensional leaves (step
counters, scalar parameters) are replicated. Padding is zero and is sliced
off before the optimizer sees the leaf, so it never changes a result.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zero_jax import collectives, layout as lay
from zero_jax import loss_scale as ls
from zero_jax.clipping import clip_by_global_norm
from zero_jax.stacked import ShardedParam
from zero_jax.precision import Policy, get_policy

_GATHERED = "zero_jax_gathered_param"


def _regather_policy(layouts):
  """Stage-3 remat policy: save activations, never a gathered parameter.

  A gathered leaf must be gathered again in the backward pass, so no value
  computed from it alone may be saved: not the all-gather's output, not the
  un-padding slice or the named leaf, and not what ``loss_fn`` derives from
  it before combining it with activations (``w.T``, ``w.astype(bf16)``,
  ``2 * w`` from the derivative of ``w ** 2``): saving any of these would
  keep a full-size copy alive from the forward to the backward pass. The
  policy only sees each operation's inputs, so such values are recognised as
  the results of operations with a single non-scalar input shaped like a
  gathered leaf (logical, padded or reversed shape). An activation that
  happens to have such a shape is recomputed (an elementwise op, cheap);
  nothing else changes. (``save_anything_except_these_names`` is a no-op that
  saves everything in jax 0.10, and excluding only a name would save the op
  feeding it instead.)
  """
  shapes = set()
  for l in layouts:
    if l.dim is not None:
      shapes |= {l.shape, l.storage_shape, l.shape[::-1]}

  def policy(prim, *avals, **params):
    del params
    if prim.name in ("all_gather", "all_gather_invariant"):
      return False
    arrays = [tuple(a.shape) for a in avals if getattr(a, "ndim", 0)]
    return not (len(arrays) == 1 and arrays[0] in shapes)
  return policy


class StateMeta(NamedTuple):
  """Static description of a `TrainState` (hashable pytree metadata).

  Attributes:
    param_layouts: one `Layout` per parameter leaf, in flattening order.
    trainable: one bool per parameter leaf.
    opt_layouts: one `Layout` per optimizer-state leaf.
    stacked: one bool per parameter leaf (``stacked=``).
  """
  param_layouts: tuple
  trainable: tuple
  opt_layouts: tuple
  stacked: tuple


@struct.dataclass
class TrainState:
  """Everything a step reads and writes. A registered pytree.

  Attributes:
    step: i32[] number of steps taken (skipped ones included).
    params: the parameters in the policy's parameter dtype. Stages 1-2: the
      original shapes, replicated. Stage 3: the padded storage view, sharded.
    master: list, one f32 padded storage leaf per trainable parameter,
      sharded; ``None`` when the parameters are their own master copy.
    opt_state: the optax state, every leaf in its padded storage view, sharded.
    loss_scale: `LossScaleState` (replicated scalars).
    model_state: untrained model state such as BatchNorm statistics,
      replicated; ``None`` when unused.
    rng: a PRNG key (replicated) or ``None``.
    meta: `StateMeta` (static).
  """
  step: jax.Array
  params: Any
  master: Any
  opt_state: Any
  loss_scale: ls.LossScaleState
  model_state: Any
  rng: Any
  meta: StateMeta = struct.field(pytree_node=False)


def _auto_mesh(mesh: Mesh) -> Mesh:
  """The same devices and axes with Auto axis types (accepts Explicit meshes)."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a concrete jax.sharding.Mesh (e.g. jax.make_mesh(("
                    f"jax.device_count(),), ('data',))); got {type(mesh).__name__}.")
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _leaf_flags(spec, params, name: str) -> list:
  """(flag, explicit) per params leaf from a per-leaf option.

  ``spec`` is None (all False), a function ``(path, leaf) -> bool``, or a
  pytree of bools matching ``params`` or a prefix of it. ``explicit`` is
  True only for a bool given for the leaf itself (not for a subtree, and not
  by a function, which sees every leaf).
  """
  paths_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if spec is None:
    return [(False, False)] * len(paths_leaves)
  if callable(spec):
    return [(bool(spec(path, x)), False) for path, x in paths_leaves]
  for path, m in jax.tree_util.tree_flatten_with_path(spec)[0]:
    if not (isinstance(m, (bool, np.bool_)) or
            (getattr(m, "shape", None) == () and getattr(m, "dtype", None) == jnp.bool_)):
      raise TypeError(f"{name}{jax.tree_util.keystr(path)} is {m!r}; every leaf of a "
                      f"{name}= tree must be True or False (or pass a function "
                      f"(path, leaf) -> bool).")
  expand = lambda m, sub: jax.tree.map(
      lambda _: (bool(m), jax.tree_util.treedef_is_leaf(jax.tree.structure(sub))), sub)
  try:
    full = jax.tree.map(expand, spec, params)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{name}= must be a pytree of bools with the structure of the "
                     f"params (or a prefix of it), or a function (path, leaf) -> bool; it "
                     f"does not match the params: {e}") from None
  return jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and
                         isinstance(x[0], bool))


def trainable_flags(spec, params) -> tuple:
  """One bool per params leaf: does it train (``trainable=``, see `make_sharded_train_step`)."""
  if spec is None:
    return tuple(_is_float(x) for x in jax.tree.leaves(params))
  flags = []
  for (f, explicit), (path, x) in zip(_leaf_flags(spec, params, "trainable"),
                                      jax.tree_util.tree_flatten_with_path(params)[0]):
    if f and explicit and not _is_float(x):
      raise ValueError(f"trainable marks the leaf params{jax.tree_util.keystr(path)} of "
                       f"dtype {jnp.result_type(x)} as trainable, but only floating leaves "
                       f"can train; mark it False (non-float leaves are frozen by default).")
    flags.append(f and _is_float(x))
  return tuple(flags)


def stacked_flags(spec, params) -> tuple:
  """One bool per params leaf: is it a stack of layers (``stacked=``)."""
  flags = []
  for (f, _), (path, x) in zip(_leaf_flags(spec, params, "stacked"),
                               jax.tree_util.tree_flatten_with_path(params)[0]):
    if f and not np.shape(x):
      raise ValueError(f"stacked marks params{jax.tree_util.keystr(path)} as a stack of "
                       f"per-layer weights, but it is a scalar; a stacked leaf has the "
                       f"layers along its first dimension. Mark it False.")
    flags.append(bool(f))
  return tuple(flags)


def _device_put(tree, sharding):
  """``jax.device_put`` that also places typed PRNG keys on a multi-process mesh."""
  def put(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.device_put(jax.random.key_data(x), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)
  return jax.tree.map(put, tree)


def _keystrs(tree):
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class ShardedTrainStep:
  """A compiled ZeRO training step. Made by `make_sharded_train_step`."""

  def __init__(self, loss_fn, optimizer, *, mesh, axis_name, stage, has_aux, precision,
               loss_scale, max_grad_norm, grad_accum_steps, accumulate, trainable,
               stacked, comm_dtype, donate):
    if axis_name not in mesh.axis_names:
      raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh, whose axes are "
                       f"{tuple(mesh.axis_names)}; pass axis_name= one of them or build the "
                       f"mesh with that axis, e.g. jax.make_mesh((n,), ({axis_name!r},)).")
    if stage not in (1, 2, 3):
      raise ValueError(f"stage={stage!r}: choose 1 (optimizer state sharded), 2 (and "
                       f"gradients) or 3 (and parameters).")
    if not isinstance(optimizer, optax.GradientTransformation):
      raise TypeError(f"optimizer must be an optax.GradientTransformation (e.g. "
                      f"optax.adamw(3e-4)); got {type(optimizer).__name__}.")
    if not (isinstance(grad_accum_steps, int) and grad_accum_steps >= 1):
      raise ValueError(f"grad_accum_steps must be a positive int, got {grad_accum_steps!r}.")
    if accumulate is None:
      accumulate = "sharded" if stage == 3 else "local"
    if accumulate not in ("local", "sharded"):
      raise ValueError(f"accumulate={accumulate!r}: choose 'local' (accumulate full "
                       f"gradients locally, reduce once) or 'sharded' (reduce-scatter each "
                       f"micro-batch, keep a 1/N accumulator).")
    if stage == 1 and accumulate == "sharded":
      raise ValueError("accumulate='sharded' reduce-scatters gradients, which is stage 2; "
                       "use stage=2, or accumulate='local' with stage=1.")
    if stage == 3 and accumulate == "local":
      raise ValueError("stage=3 differentiates through the parameter all-gather, whose "
                       "transpose reduce-scatters every micro-batch; use accumulate='sharded' "
                       "(the default for stage 3) or stage=2.")
    if stage == 3 and comm_dtype is not None:
      raise ValueError("comm_dtype applies to stages 1-2; at stage 3 the gradient is "
                       "reduce-scattered by the transpose of the parameter all-gather, in the "
                       "parameter dtype (choose precision='bf16' to halve it), so drop "
                       "comm_dtype or use stage=2.")
    if max_grad_norm is not None and not max_grad_norm > 0:
      raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}.")
    self.loss_fn = loss_fn
    self.optimizer = optimizer
    self.user_mesh = mesh
    self.mesh = _auto_mesh(mesh)
    self.axis_name = axis_name
    self.n = int(mesh.shape[axis_name])
    self.stage = stage
    self.has_aux = has_aux
    self.policy: Policy = get_policy(precision)
    if loss_scale is None:
      loss_scale = "dynamic" if self.policy.dynamic_loss_scale else "none"
    if isinstance(loss_scale, str):
      makers = {"dynamic": ls.dynamic_loss_scale, "none": ls.no_loss_scale}
      if loss_scale not in makers:
        raise ValueError(f"loss_scale={loss_scale!r}: pass 'dynamic', 'none', a number "
                         f"(static scale) or a zero_jax.LossScaleState.")
      loss_scale = makers[loss_scale]()
    elif isinstance(loss_scale, (int, float)):
      loss_scale = ls.static_loss_scale(float(loss_scale))
    elif not isinstance(loss_scale, ls.LossScaleState):
      raise TypeError(f"loss_scale must be None, 'dynamic', 'none', a number or a "
                      f"LossScaleState; got {type(loss_scale).__name__}.")
    self.initial_loss_scale = loss_scale
    self.max_grad_norm = max_grad_norm
    self.grad_accum_steps = grad_accum_steps
    self.accumulate = accumulate
    self.trainable = trainable
    self.stacked = stacked
    self.comm_dtype = None if comm_dtype is None else jnp.dtype(comm_dtype)
    self.donate = donate
    self._step = jax.jit(self._step_fn, donate_argnums=(0,) if donate else ())
    self._get_params = jax.jit(self._get_params_fn)

  # ------------------------------------------------------------------ helpers
  def _sharding(self, spec) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  def _replicated(self) -> NamedSharding:
    return self._sharding(P())

  def _optimizer(self, treedef, trainable) -> optax.GradientTransformation:
    if all(trainable):
      return self.optimizer
    return optax.masked(self.optimizer, jax.tree.unflatten(treedef, list(trainable)))

  def _check_params(self, params):
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"params{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
                        f"array; every parameter leaf must be a jax or numpy array "
                        f"(wrap Python numbers with jnp.asarray).")

  # --------------------------------------------------------------------- init
  def init(self, params, *, model_state=None, rng=None) -> TrainState:
    """Places ``params`` on the mesh and builds the sharded optimizer state.

    Args:
      params: a pytree of arrays (host numpy or on any device).
      model_state: optional untrained state (e.g. Flax ``batch_stats``); when
        given, ``loss_fn`` is called with ``model_state=`` and returns the
        new one (see `make_sharded_train_step`).
      rng: optional PRNG key; when given, ``loss_fn`` is called with ``rng=``,
        a key distinct for every step, device and micro-batch.

    Returns:
      The `TrainState`.
    """
    self._check_params(params)
    treedef, meta = self._meta(params)
    placed = jax.device_put(jax.tree.leaves(params), self._replicated())
    extras = _device_put((model_state, rng, self.initial_loss_scale), self._replicated())
    init = jax.jit(functools.partial(self._init_fn, meta, treedef),
                   out_shardings=self._state_shardings(meta, treedef, model_state, rng))
    return init(placed, *extras)

  def abstract_state(self, params, *, model_state=None, rng=None) -> TrainState:
    """The `TrainState` that ``init`` would return, as shape/dtype/sharding only.

    Nothing is computed or allocated. Use it as a restore target for
    checkpoints or to ``lower`` the step for a memory estimate.

    Args:
      params: arrays or ``jax.ShapeDtypeStruct``s with the parameters' shapes.
      model_state: as for ``init`` (arrays or shape structs), or None.
      rng: as for ``init`` (a key or its shape struct), or None.
    """
    self._check_params(params)
    treedef, meta = self._meta(params)
    leaves = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(params)]
    shape = jax.eval_shape(functools.partial(self._init_fn, meta, treedef), leaves, model_state,
                           rng, self.initial_loss_scale)
    shardings = self._state_shardings(meta, treedef, model_state, rng)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shape, shardings)

  def _meta(self, params):
    """(treedef, StateMeta) for a params tree (arrays or shape structs)."""
    treedef = jax.tree.structure(params)
    leaves = jax.tree.leaves(params)
    trainable = trainable_flags(self.trainable, params)
    stacked = stacked_flags(self.stacked, params)
    param_layouts = tuple(lay.leaf_layout(np.shape(x), self.n, stacked=s)
                          for x, s in zip(leaves, stacked))
    src_abstract = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(np.shape(x), self._src_dtype(x) if t else jnp.result_type(x))
        for x, t in zip(leaves, trainable)])
    opt_abstract = jax.eval_shape(self._optimizer(treedef, trainable).init, src_abstract)
    opt_layouts = tuple(lay.leaf_layout(x.shape, self.n) for x in jax.tree.leaves(opt_abstract))
    return treedef, StateMeta(param_layouts, trainable, opt_layouts, stacked)

  def _state_shardings(self, meta, treedef, model_state, rng) -> TrainState:
    """A TrainState of NamedShardings: where each part of the state lives."""
    ax, rep = self.axis_name, self._replicated()
    storage = lambda l: self._sharding(l.spec(ax))
    params = [storage(l) if self.stage == 3 else rep for l in meta.param_layouts]
    master = None
    if self.policy.master_dtype is not None:
      master = [storage(l) for l, t in zip(meta.param_layouts, meta.trainable) if t]
    src_abstract = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(l.shape, jnp.float32) for l in meta.param_layouts])
    o_def = jax.tree.structure(jax.eval_shape(self._optimizer(treedef, meta.trainable).init,
                                              src_abstract))
    return TrainState(
        step=rep, params=jax.tree.unflatten(treedef, params), master=master,
        opt_state=jax.tree.unflatten(o_def, [storage(l) for l in meta.opt_layouts]),
        loss_scale=jax.tree.map(lambda _: rep, self.initial_loss_scale),
        model_state=jax.tree.map(lambda _: rep, model_state),
        rng=jax.tree.map(lambda _: rep, rng), meta=meta)

  def _src_dtype(self, x):
    """dtype the optimizer sees for a trainable leaf.

    The leaf's own dtype under "fp32" (nothing is cast, as in plain optax);
    float32 under the mixed-precision policies.
    """
    return jnp.result_type(x) if self.policy.param_dtype is None else jnp.dtype(jnp.float32)

  def _param_dtype(self, x):
    """dtype a trainable leaf is stored and used in by the loss."""
    return self.policy.param_dtype or jnp.result_type(x)

  def _init_fn(self, meta, treedef, leaves, model_state, rng, loss_scale):
    pl, tr = meta.param_layouts, meta.trainable
    src = [x.astype(self._src_dtype(x)) if t else x for x, t in zip(leaves, tr)]
    opt = self._optimizer(treedef, tr)
    opt_state = opt.init(jax.tree.unflatten(treedef, src))
    o_leaves, o_def = jax.tree.flatten(opt_state)
    o_leaves = [self._to_storage(x, l) for x, l in zip(o_leaves, meta.opt_layouts)]
    params = [x.astype(self._param_dtype(x)) if t else x for x, t in zip(leaves, tr)]
    if self.stage == 3:
      params = [self._to_storage(x, l) for x, l in zip(params, pl)]
    else:
      params = [self._constrain(x, P()) for x in params]
    master = None
    if self.policy.master_dtype is not None:
      master = [self._to_storage(x.astype(self.policy.master_dtype), l)
                for x, l, t in zip(leaves, pl, tr) if t]
    return TrainState(step=jnp.zeros((), jnp.int32), params=jax.tree.unflatten(treedef, params),
                      master=master, opt_state=jax.tree.unflatten(o_def, o_leaves),
                      loss_scale=loss_scale, model_state=model_state, rng=rng, meta=meta)

  def _constrain(self, x, spec):
    return jax.lax.with_sharding_constraint(x, self._sharding(spec))

  def _to_storage(self, x, layout):
    return self._constrain(lay.pad(x, layout), layout.spec(self.axis_name))

  def _to_logical(self, x, layout):
    return self._constrain(lay.unpad(x, layout), layout.spec(self.axis_name))

  # ---------------------------------------------------------------- the batch
  def _place_batch(self, batch):
    div = self.n * self.grad_accum_steps
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
      shape = np.shape(x)
      if len(shape) == 0 or shape[0] % div:
        what = "a scalar" if not shape else f"leading dimension {shape[0]}"
        need = (f"{self.n} devices on axis {self.axis_name!r}" +
                (f" x grad_accum_steps={self.grad_accum_steps}"
                 if self.grad_accum_steps > 1 else ""))
        raise ValueError(f"batch{jax.tree_util.keystr(path)} has {what} (shape {shape}), but "
                         f"every batch leaf's leading dimension is the global batch size and "
                         f"must be divisible by {div} ({need}); use a global batch size that "
                         f"is a multiple of {div}, or drop the last incomplete batch.")
    sharding = self._sharding(P(self.axis_name))
    def place(x):
      if isinstance(x, jax.ShapeDtypeStruct):  # abstract batch, for lower()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      return jax.device_put(x, sharding)
    return jax.tree.map(place, batch)

  def _check_state(self, state):
    if not isinstance(state, TrainState):
      raise TypeError(f"state must be the TrainState returned by step.init(params), got "
                      f"{type(state).__name__}.")

  # ----------------------------------------------------------------- the step
  def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One training step on a global batch. Returns ``(new_state, metrics)``."""
    self._check_state(state)
    return self._step(state, self._place_batch(batch))

  def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
    """The lowered step, for ``.compile().memory_analysis()`` or ``.as_text()``."""
    self._check_state(state)
    return self._step.lower(state, self._place_batch(batch))

  def _call_loss(self, params, batch, model_state, rng):
    kwargs = {}
    if model_state is not None:
      kwargs["model_state"] = model_state
    if rng is not None:
      kwargs["rng"] = rng
    out = self.loss_fn(params, batch, **kwargs)
    expect = ("loss" if not (self.has_aux or model_state is not None) else
              "(loss, " + ", ".join((["aux"] if self.has_aux else []) +
                                    (["new_model_state"] if model_state is not None else [])) + ")")
    n_out = 1 + self.has_aux + (model_state is not None)
    if n_out > 1:
      if not (isinstance(out, (tuple, list)) and len(out) == n_out):
        raise TypeError(f"loss_fn must return {expect} (has_aux={self.has_aux}, model state "
                        f"{'given' if model_state is not None else 'not given'} to init); "
                        f"it returned {type(out).__name__}"
                        f"{f' of length {len(out)}' if isinstance(out, (tuple, list)) else ''}.")
      loss, rest = out[0], list(out[1:])
    else:
      if isinstance(out, (tuple, list)):
        raise TypeError(f"loss_fn returned a {type(out).__name__} of length {len(out)}; it "
                        f"must return a scalar loss, or pass has_aux=True if it returns "
                        f"(loss, aux).")
      loss, rest = out, []
    aux = rest.pop(0) if self.has_aux else None
    new_ms = rest.pop(0) if model_state is not None else None
    if not hasattr(loss, "shape") or loss.shape != () or not _is_float(loss):
      raise TypeError(f"loss_fn must return a scalar floating loss (the mean over the "
                      f"examples it is given); it returned "
                      f"{getattr(loss, 'shape', type(loss).__name__)} "
                      f"{getattr(loss, 'dtype', '')}. Reduce it with .mean(), or pass "
                      f"has_aux=True if it returns (loss, aux).")
    if model_state is not None:
      if jax.tree.structure(new_ms) != jax.tree.structure(model_state):
        raise TypeError(f"loss_fn must return the new model state with the structure of "
                        f"the one given to init: {jax.tree.structure(model_state)}; got "
                        f"{jax.tree.structure(new_ms)}.")
    return loss, aux, new_ms

  def _local_grads(self, meta, treedef, params, batch, model_state, rng, scale, step):
    """Runs on each device inside shard_map. Returns gradient blocks and stats."""
    ax, n, k = self.axis_name, self.n, self.grad_accum_steps
    pl, tr = meta.param_layouts, meta.trainable
    leaves = jax.tree.leaves(params)
    train_idx = [i for i, t in enumerate(tr) if t]
    frozen = {i: leaves[i] for i, t in enumerate(tr) if not t}
    dev = jax.lax.axis_index(ax)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    stacked = self.stage == 3 and any(meta.stacked)

    def gathered(i, x, to):
      """Stage 3: the leaf as loss_fn receives it, gathered or (stacked) not yet."""
      if meta.stacked[i]:
        return ShardedParam(x, pl[i], ax, paths[i])
      return checkpoint_name(collectives.all_gather(x, pl[i], ax, to=to), _GATHERED)

    def micro_loss(train_leaves, mb, ms, key):
      full = dict(frozen)
      if self.stage == 3:
        full = {i: gathered(i, x, "invarying") for i, x in frozen.items()}
      for i, x in zip(train_idx, train_leaves):
        full[i] = gathered(i, x, "varying") if self.stage == 3 else x
      p = jax.tree.unflatten(treedef, [full[i] for i in range(len(leaves))])
      loss, aux, new_ms = self._call_loss(p, mb, ms, key)
      # Divided by n * k here, not after the reduction: each example's cotangent is
      # then the single-device one (scale / global batch), so an fp16 sum over
      # devices overflows exactly when the single-device gradient would.
      return ls.scale_loss(scale, loss) / (n * k), (loss, aux, new_ms)

    if self.stage == 3 and not stacked:
      # Ask XLA not to keep gathered leaves for the backward pass. With stacked
      # leaves, loss_fn's own per-layer jax.checkpoint does that for the layers
      # (an outer checkpoint around its scan would copy the stacked blocks).
      micro_loss = jax.checkpoint(micro_loss, policy=_regather_policy(pl))
    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
    diff_leaves = [leaves[i] for i in train_idx]
    if self.stage != 3:  # a local gradient, not one already summed over devices
      diff_leaves = [jax.lax.pcast(x, ax, to="varying") for x in diff_leaves]
    train_layouts = [pl[i] for i in train_idx]

    def reduce(grads):  # local grads -> this device's reduced block (sum over devices)
      if self.stage == 1:
        return [jax.lax.psum(g.astype(self.comm_dtype or g.dtype), ax).astype(jnp.float32)
                for g in grads]
      if self.stage == 2:
        return [collectives.reduce_scatter(g, l, ax, comm_dtype=self.comm_dtype)
                for g, l in zip(grads, train_layouts)]
      return [g.astype(jnp.float32) for g in grads]  # stage 3: already scattered

    def key_for(micro):
      if rng is None:
        return None
      return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(rng, step), dev), micro)

    shard_acc = self.accumulate == "sharded"

    def micro_grads(mb, ms, i):
      (_, (loss, aux, ms)), g = grad_fn(diff_leaves, mb, ms, key_for(i))
      g = reduce(g) if shard_acc or k == 1 else [x.astype(jnp.float32) for x in g]
      aux = None if aux is None else jax.tree.map(lambda a: a.astype(jnp.float32), aux)
      return g, loss.astype(jnp.float32), aux, ms

    if k == 1:
      grads, loss, aux, ms = micro_grads(batch, model_state, 0)
    else:
      # The first micro-batch runs outside the scan so the carry has the types
      # (and device variance) of a real iteration.
      micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
      first = micro_grads(jax.tree.map(lambda x: x[0], micro), model_state, 0)

      def body(carry, xs):
        acc, loss_sum, aux_sum, ms = carry
        g, loss, aux, ms = micro_grads(xs[0], ms, xs[1])
        add = lambda a, b: jax.tree.map(jnp.add, a, b)
        return (add(acc, g), loss_sum + loss, add(aux_sum, aux), ms), None

      rest = jax.tree.map(lambda x: x[1:], micro)
      (grads, loss, aux, ms), _ = jax.lax.scan(body, first, (rest, jnp.arange(1, k)))
      loss = loss / k
      aux = None if aux is None else jax.tree.map(lambda a: a / k, aux)
      if not shard_acc:
        grads = reduce(grads)
    loss = jax.lax.pmean(loss.astype(jnp.float32), ax)
    aux = None if aux is None else jax.tree.map(lambda a: jax.lax.pmean(a, ax), aux)
    if ms is not None:
      ms = jax.tree.map(lambda a: jax.lax.pmean(a, ax) if _is_float(a) else
                        jax.lax.pmax(a, ax), ms)
    return grads, loss, aux, ms

  def _gather_params(self, blocks, layouts):
    """Storage blocks (sharded) -> full logical leaves (replicated)."""
    ax = self.axis_name
    fn = jax.shard_map(
        lambda bs: [collectives.all_gather(b, l, ax) for b, l in zip(bs, layouts)],
        mesh=self.mesh, in_specs=([l.spec(ax) for l in layouts],),
        out_specs=[P() for _ in layouts])
    return fn(blocks)

  def _step_fn(self, state: TrainState, batch):
    meta, ax = state.meta, self.axis_name
    pl, tr = meta.param_layouts, meta.trainable
    treedef = jax.tree.structure(state.params)
    leaves = jax.tree.leaves(state.params)
    train_idx = [i for i, t in enumerate(tr) if t]
    t_layouts = [pl[i] for i in train_idx]
    param_specs = jax.tree.unflatten(treedef, [
        l.spec(ax) if self.stage == 3 else P() for l in pl])
    batch_specs = jax.tree.map(lambda _: P(ax), batch)
    grad_specs = [P() if self.stage == 1 else l.spec(ax) for l in t_layouts]
    local = jax.shard_map(
        functools.partial(self._local_grads, meta, treedef),
        mesh=self.mesh,
        in_specs=(param_specs, batch_specs, P(), P(), P(), P()),
        out_specs=(grad_specs, P(), P(), P()))
    grads, loss, aux, model_state = local(state.params, batch, state.model_state, state.rng,
                                          state.loss_scale, state.step)

    # Logical, still-sharded views of everything the optimizer touches.
    if self.stage == 1:
      grads = [self._constrain(g, l.spec(ax)) for g, l in zip(grads, t_layouts)]
    else:
      grads = [self._to_logical(g, l) for g, l in zip(grads, t_layouts)]
    grads = ls.unscale_grads(state.loss_scale, grads)
    finite = ls.all_finite(grads)
    grad_norm = optax.tree.norm(grads)
    if self.max_grad_norm is not None:
      grads, _ = clip_by_global_norm(grads, self.max_grad_norm)

    if state.master is not None:
      src = [self._to_logical(m, l) for m, l in zip(state.master, t_layouts)]
    elif self.stage == 3:
      src = [self._to_logical(leaves[i], pl[i]).astype(self._src_dtype(leaves[i])) for i in train_idx]
    else:
      src = [self._constrain(leaves[i], pl[i].spec(ax)).astype(self._src_dtype(leaves[i]))
             for i in train_idx]
    full_src, full_grads = list(leaves), list(leaves)
    for j, i in enumerate(train_idx):
      full_src[i], full_grads[i] = src[j], grads[j]
    for i, t in enumerate(tr):
      if not t:
        full_grads[i] = jnp.zeros(pl[i].shape, jnp.result_type(leaves[i]))
        if self.stage == 3:
          full_src[i] = lay.unpad(leaves[i], pl[i])
    opt = self._optimizer(treedef, tr)
    o_leaves, o_def = jax.tree.flatten(state.opt_state)
    opt_state = jax.tree.unflatten(
        o_def, [self._to_logical(x, l) for x, l in zip(o_leaves, meta.opt_layouts)])
    for j in range(len(src)):  # the optimizer sees gradients in its parameters' dtype
      full_grads[train_idx[j]] = grads[j].astype(src[j].dtype)

    def apply(_):
      updates, new_opt = opt.update(jax.tree.unflatten(treedef, full_grads), opt_state,
                                    jax.tree.unflatten(treedef, full_src))
      updates = jax.tree.leaves(updates)
      new_src = [self._constrain((s + updates[i]).astype(s.dtype), l.spec(ax))
                 for s, i, l in zip(src, train_idx, t_layouts)]
      return new_src, [x.astype(y.dtype) for x, y in zip(jax.tree.leaves(new_opt), o_leaves)]

    # A step with non-finite gradients changes nothing but the loss scale. A
    # cond, not a select of new and old: selecting makes XLA copy every donated
    # optimizer-state buffer (8Ψ/N bytes of temp for Adam).
    new_src, new_o = jax.lax.cond(finite, apply,
                                  lambda _: (list(src), jax.tree.leaves(opt_state)), None)
    new_o = [self._to_storage(x, l) for x, l in zip(new_o, meta.opt_layouts)]
    new_opt = jax.tree.unflatten(o_def, new_o)

    new_blocks = [self._to_storage(s.astype(leaves[i].dtype), l)
                  for s, i, l in zip(new_src, train_idx, t_layouts)]
    new_leaves = list(leaves)
    if self.stage == 3:
      for j, i in enumerate(train_idx):
        new_leaves[i] = new_blocks[j]
    else:
      for j, full in zip(train_idx, self._gather_params(new_blocks, t_layouts)):
        new_leaves[j] = full
    master = None
    if state.master is not None:
      master = [self._to_storage(s, l) for s, l in zip(new_src, t_layouts)]

    new_state = state.replace(
        step=state.step + 1, params=jax.tree.unflatten(treedef, new_leaves), master=master,
        opt_state=new_opt, loss_scale=ls.adjust_loss_scale(state.loss_scale, finite),
        model_state=model_state)
    metrics = {"loss": loss, "grad_norm": grad_norm, "grads_finite": finite,
               "loss_scale": state.loss_scale.scale}
    if self.has_aux:
      metrics["aux"] = aux
    return new_state, metrics

  # --------------------------------------------------------------- get_params
  def get_params(self, state: TrainState):
    """The full parameters: original shapes, tree and (master) dtypes, replicated."""
    self._check_state(state)
    return self._get_params(state)

  def _get_params_fn(self, state: TrainState):
    pl, tr = state.meta.param_layouts, state.meta.trainable
    treedef = jax.tree.structure(state.params)
    leaves = list(jax.tree.leaves(state.params))
    if state.master is not None:
      for m, i in zip(state.master, [i for i, t in enumerate(tr) if t]):
        leaves[i] = m
    out = []
    for i, x in enumerate(leaves):
      stored = self.stage == 3 or (state.master is not None and tr[i])
      out.append(self._constrain(lay.unpad(x, pl[i]) if stored else x, P()))
    return jax.tree.unflatten(treedef, out)


def make_sharded_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    axis_name: str = "data",
    stage: int = 2,
    has_aux: bool = False,
    precision: str = "fp32",
    loss_scale=None,
    max_grad_norm: float | None = None,
    grad_accum_steps: int = 1,
    accumulate: str | None = None,
    trainable=None,
    stacked=None,
    comm_dtype=None,
    donate: bool = True,
) -> ShardedTrainStep:
  """Builds a ZeRO-sharded training step for ``loss_fn`` and ``optimizer``.

  The step's loss and gradient equal ``loss_fn(params, global_batch)`` and its
  gradient on one device; its update equals ``optimizer``'s single-device
  update. Optimizer state (stage 1), gradients (stage 2) and parameters
  (stage 3) are split over ``axis_name``; see the module docstring.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh)
    >>> state = step.init({"w": jnp.zeros((3, 1))})
    >>> batch = {"x": jnp.ones((jax.device_count(), 3)), "y": jnp.ones((jax.device_count(), 1))}
    >>> state, metrics = step(state, batch)
    >>> step.get_params(state)["w"].shape
    (3, 1)

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss over the
      examples of ``batch``. With ``has_aux=True`` it returns ``(loss, aux)``.
      When ``init`` got ``model_state=``, it is called with the keyword
      ``model_state=`` and returns the new model state last:
      ``(loss, new_model_state)`` or ``(loss, aux, new_model_state)``; the step
      averages the new model state over the data axis (for BatchNorm
      statistics). When ``init`` got ``rng=``, it is called with the keyword
      ``rng=``, a key folded from the state's key, the step, the device index
      and the micro-batch index.
    optimizer: any ``optax.GradientTransformation``.
    mesh: the ``jax.sharding.Mesh`` (Explicit or Auto axis types).
    axis_name: the mesh axis the batch and the state are split over.
    stage: 1, 2 or 3 (ZeRO stage).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; floating ``aux``
      leaves are averaged over devices (and micro-batches).
    precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp16_memory_efficient"``;
      see `zero_jax.precision`.
    loss_scale: ``None`` (dynamic for fp16, none otherwise), ``"dynamic"``,
      ``"none"``, a number (static scale) or a `LossScaleState`.
    max_grad_norm: clip the averaged, unscaled gradient to this global norm.
    grad_accum_steps: split each device's batch into this many micro-batches,
      run in order by a ``lax.scan`` inside the step (the global batch size
      must be divisible by N * grad_accum_steps). The update equals one step
      on the whole batch. Model state, when given, is threaded through the
      micro-batches of a device in order.
    accumulate: where the micro-batch gradients are summed. For Ψ trainable
      parameters, N devices and k = ``grad_accum_steps``:
      ``"local"`` (default for stages 1-2, like ``no_sync``): each device sums
      its full-size gradients without communication and reduces once per step
      (stage 1 all-reduce, stage 2 reduce-scatter), as with k = 1 but in
      the accumulator's float32 unless ``comm_dtype`` is given; costs one
      full-size float32 accumulator (4Ψ bytes per device) during the step.
      ``"sharded"`` (stage 2 or 3; the default and only choice for stage 3,
      whose gather's transpose reduce-scatters every micro-batch): each
      micro-batch's gradient is reduce-scattered at once and only the
      device's block is accumulated (4Ψ/N bytes), at k times the gradient
      communication.
    trainable: which parameter leaves train: ``None`` (every floating leaf),
      a pytree of bools matching the params or a prefix of them (a bool for
      a subtree covers its floating leaves), or a function
      ``(path, leaf) -> bool``. Frozen leaves have no optimizer state (the
      optimizer is wrapped in ``optax.masked``, so they also stay out of
      global norms and weight decay), no gradient and no communication
      (stage 3 still gathers them where used), and never change. Non-float
      leaves are always frozen; ``True`` given for a non-float leaf itself is
      an error.
    stacked: which leaves are stacks of per-layer weights along their first
      dimension that ``loss_fn`` loops over (``lax.scan``); same forms as
      ``trainable``. They are never split along that dimension. At stage 3
      they reach ``loss_fn`` as `ShardedParam`s, not gathered, and
      ``loss_fn`` calls `zero_jax.gather` on each layer's slice where the
      layer uses it, under a per-layer ``jax.checkpoint``, so that only a
      layer or two are whole at a time (see `zero_jax.stacked`). The other
      leaves are then gathered once before ``loss_fn`` and kept until their
      backward use. At stages 1-2 stacked leaves are plain arrays and
      ``gather`` is the identity, so the same ``loss_fn`` runs at every stage.
    comm_dtype: dtype on the wire for the gradient reduction (stages 1-2),
      e.g. ``jnp.bfloat16``; default the gradient's dtype.
    donate: donate the input state's buffers to the output (do not reuse a
      state after passing it to the step).

  Returns:
    A `ShardedTrainStep` with ``init``, ``__call__``, ``lower`` and ``get_params``.
  """
  return ShardedTrainStep(
      loss_fn, optimizer, mesh=mesh, axis_name=axis_name, stage=stage, has_aux=has_aux,
      precision=precision, loss_scale=loss_scale, max_grad_norm=max_grad_norm,
      grad_accum_steps=grad_accum_steps, accumulate=accumulate, trainable=trainable,
      stacked=stacked, comm_dtype=comm_dtype, donate=donate)
