"""`TrainState`, its static description, and how a state is made.

The state is a registered pytree of arrays; everything static about it (layouts, trainable
leaves, the step's signature) is `StateMeta`, carried as pytree metadata, and a step runs only
states whose meta it would have made itself (`zero_jax.step.state_checks`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax.comm import layout as lay
from zero_jax.numerics import loss_scale as ls
from zero_jax.step import placement
from zero_jax.numerics import precision as prec
from zero_jax.step import whole_leaf
from zero_jax.step.options import (LeafOptions, lookup_flags, model_axes_per_leaf,
                                   stacked_flags, trainable_flags, whole_leaf_flags)
from zero_jax.step.signature import optimizer_signature
from zero_jax.step.spec import StepSpec


class StepSignature(NamedTuple):
  """What a state depends on besides its parameters (static, comparable).

  Attributes:
    stage: the ZeRO stage.
    precision: the precision policy's name.
    data: ``((axis, size), ...)`` of the data axes.
    replica: the same for the replica axes.
    model: the same for the model axes.
    optimizer: `zero_jax.step.signature.optimizer_signature` of the optimizer.
    offload: the ``offload=`` option.
  """
  stage: int
  precision: str
  data: tuple
  replica: tuple
  model: tuple
  optimizer: str
  offload: str | None


def step_signature(spec: StepSpec, optimizer) -> StepSignature:
  sizes = spec.axis_sizes()
  pairs = lambda axes: tuple((a, sizes[a]) for a in axes)
  return StepSignature(spec.stage, spec.policy.name, pairs(spec.data_axes),
                       pairs(spec.replica_axes), pairs(spec.model_axes),
                       optimizer_signature(optimizer), spec.offload)


@dataclasses.dataclass(frozen=True, eq=False)
class StateMeta:
  """Static description of a `TrainState` (hashable pytree metadata).

  Attributes:
    param_layouts: one `Layout` per parameter leaf, in flattening order.
    trainable: one bool per parameter leaf.
    opt_layouts: one `Layout` per optimizer-state leaf.
    stacked: one bool per parameter leaf (``stacked=``).
    master: one bool per parameter leaf: it has a float32 master copy.
    param_dtypes: one dtype per parameter leaf, as it is stored and seen by the loss.
    signature: the `StepSignature` of the step that made the state.
    module: for a state made from an ``nnx.Module``, how to rebuild it
      (see `zero_jax.layers.nnx`); None otherwise.
    opt_treedef: the tree structure of the optimizer state (derived from the
      optimizer and the trainable leaves once, when the meta is built).
    whole: the `zero_jax.step.whole_leaf.Plan` of ``whole_leaf_update=`` (which
      units move to which home device), or None.
    lookup: one bool per parameter leaf (``lookup=``): a table split along a dimension
      after the first, looked up with `zero_jax.take` (``()``: none).
    master_in_params: the float32 master copy is the only copy (`master_in_params`):
      ``params`` holds it, split, for every leaf with ``master``, ``TrainState.master``
      is None, and the loss sees it cast to ``param_dtypes`` before the gather.
  """
  param_layouts: tuple
  trainable: tuple
  opt_layouts: tuple
  stacked: tuple
  master: tuple
  param_dtypes: tuple
  signature: StepSignature
  module: Any = None
  opt_treedef: Any = None
  whole: Any = None
  lookup: tuple = ()
  master_in_params: bool = False

  def _key(self):
    return (self.param_layouts, self.trainable, self.opt_layouts, self.stacked, self.master,
            self.param_dtypes, self.signature, self.module, self.opt_treedef, self.whole,
            self.lookup, self.master_in_params)

  def stored_dtype(self, i: int):
    """The dtype ``params`` holds leaf ``i`` in (float32 where it is the master copy)."""
    return jnp.dtype(jnp.float32) if self.master_in_params and self.master[i] else \
        self.param_dtypes[i]

  def gather_dtype(self, i: int):
    """The dtype the loss's gather casts leaf ``i``'s stored block to just before moving it
    (`zero_jax.comm.collectives.in_gather_dtype`): the compute dtype where ``params`` holds
    the float32 master (``master_in_params``); None where the stored dtype is the one the
    loss sees."""
    return self.param_dtypes[i] if self.master_in_params and self.master[i] else None

  @property
  def master_list(self) -> bool:
    """Whether ``TrainState.master`` is a list (some leaf keeps a separate master copy)."""
    return any(self.master) and not self.master_in_params

  def is_lookup(self, i: int) -> bool:
    """Whether parameter leaf ``i`` is marked ``lookup=``."""
    return bool(self.lookup) and self.lookup[i]

  def __post_init__(self):  # jit hashes the meta on every call: compute it once
    object.__setattr__(self, "_hash", hash(self._key()))

  def __hash__(self):
    return self._hash

  def __eq__(self, other):
    return self is other or (isinstance(other, StateMeta) and self._hash == other._hash
                             and self._key() == other._key())

  @property
  def train_idx(self) -> list[int]:
    return [i for i, t in enumerate(self.trainable) if t]


@struct.dataclass
class TrainState:
  """Everything a step reads and writes. A registered pytree.

  Attributes:
    step: i32[] number of steps taken (skipped ones included).
    params: the parameters in the policy's parameter dtype. Stages 1-2: the
      original shapes, replicated over the data axes. Stage 3: the padded
      storage view, sharded; with ``precision="bf16"``/``"fp16"`` (without
      ``hpz_axis`` or ``offload``) each leaf that keeps a float32 master copy
      holds that copy itself, in float32, and the step casts each device's
      block to bf16/fp16 before gathering it (no half-precision copy is kept).
    master: list, one f32 padded storage leaf per trainable parameter that
      keeps a master copy (``None`` for the others), sharded; ``None`` when
      no parameter has one, or when ``params`` holds the master copies (stage 3
      as said above).
    opt_state: the optax state, every leaf in its padded storage view, sharded.
    loss_scale: `LossScaleState` (replicated scalars; counts skipped steps).
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

  if TYPE_CHECKING:  # struct.dataclass adds it at run time; this tells type checkers
    def replace(self, **changes: Any) -> TrainState: ...

  def __post_init__(self):  # also when jax rebuilds a state: every concrete one is seen
    if isinstance(self.meta, StateMeta) and self.meta.signature.stage == 3 and \
        isinstance(self.step, jax.Array) and not isinstance(self.step, jax.core.Tracer):
      _note_padded_storage(self.params, self.meta)


# Stage-3 parameter leaves whose storage is padded, by id, while they live: what
# `is_padded_storage` tells apart from a parameter of that shape (export_params refuses them).
_PADDED: dict[int, Any] = {}


def _note_padded_storage(params, meta: StateMeta) -> None:
  for x, l in zip(jax.tree.leaves(params), meta.param_layouts):
    if l.pad_amount and isinstance(x, jax.Array) and id(x) not in _PADDED:
      _PADDED[id(x)] = (weakref.ref(x, lambda _, k=id(x): _PADDED.pop(k, None)), l)


def is_padded_storage(x) -> lay.Layout | None:
  """The `Layout` of ``x`` if it is a live stage-3 state's padded parameter storage."""
  entry = _PADDED.get(id(x))
  return entry[1] if entry is not None and entry[0]() is x else None


def padded_host_copies() -> dict[int, lay.Layout]:
  """``{id(host copy): Layout}`` of the live padded storage's host copies: the numpy array
  ``jax.device_get`` (or ``np.asarray``) returned for it, which jax keeps with the array
  (its private ``_npy_value``; where a jax version has none, nothing is recognised)."""
  out = {}
  for ref, layout in list(_PADDED.values()):
    host = getattr(ref(), "_npy_value", None)
    if isinstance(host, np.ndarray):
      out[id(host)] = layout
  return out


# ------------------------------------------------------------------- the meta
def masked_optimizer(optimizer, treedef, trainable) -> optax.GradientTransformation:
  """``optimizer``, wrapped in ``optax.masked`` when some leaves are frozen (made once per
  optimizer, tree and flags: the step, its init and its checks share it)."""
  try:
    return _masked(optimizer, treedef, tuple(trainable))
  except TypeError:  # an unhashable optimizer object: made afresh each time
    return _masked.__wrapped__(optimizer, treedef, tuple(trainable))


@functools.lru_cache(maxsize=64)
def _masked(optimizer, treedef, trainable) -> optax.GradientTransformation:
  if all(trainable):
    return optimizer
  return optax.masked(optimizer, jax.tree.unflatten(treedef, list(trainable)))


def _opt_layouts(opt_abstract, params_paths, param_layouts, n) -> tuple:
  """Optimizer-state leaves that mirror a parameter (same path suffix and shape)
  take its layout, so that the update needs no resharding; others get their own."""
  by_path = {p: l for p, l in zip(params_paths, param_layouts)}
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(opt_abstract)[0]:
    key = jax.tree_util.keystr(path)
    match = next((l for p, l in by_path.items() if p and key.endswith(p)
                  and tuple(l.shape) == tuple(x.shape)), None)
    out.append(match if match is not None else lay.leaf_layout(x.shape, n))
  return tuple(out)


def build_meta(spec: StepSpec, optimizer, params, options: LeafOptions,
               module=None) -> tuple[Any, StateMeta]:
  """(treedef, StateMeta) for a params tree (arrays or shape structs)."""
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  for path, x in paths_leaves:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"params{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
                      f"array; every parameter leaf must be a jax or numpy array "
                      f"(wrap Python numbers with jnp.asarray).")
  paths = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
  leaves = [x for _, x in paths_leaves]
  dtypes = [jnp.result_type(x) for x in leaves]
  flags = trainable_flags(options.trainable, params)
  stacks = stacked_flags(options.stacked, params)
  models = model_axes_per_leaf(spec, params, options.param_specs)
  looks = lookup_flags(options.lookup, params, stacks, models)
  sizes = spec.axis_sizes()
  layouts = []
  for x, s, m, k in zip(leaves, stacks, models, looks):
    msize = tuple(int(np.prod([sizes[a] for a in dim])) for dim in m) if m else None
    # a lookup table keeps its rows whole, as a stack its layers (`zero_jax.layers.lookup`)
    layouts.append(lay.leaf_layout(np.shape(x), spec.n_data, stacked=s or k, model=m,
                                   model_size=msize))
  src = [jax.ShapeDtypeStruct(np.shape(x), prec.optimizer_dtype(spec.policy, d) if t else d)
         for x, d, t in zip(leaves, dtypes, flags)]
  plan = _whole_plan(spec, optimizer, treedef, paths, src, layouts, options, params,
                     flags=flags, stacks=stacks, models=models)
  opt_abstract, opt_layouts = opt_structure(spec, optimizer, treedef, src, flags, plan, paths,
                                            layouts)
  if plan is not None:  # how checkpoints store its state: as the step without the option
    plan = plan._replace(plain=whole_leaf.plain_view(
        plan, *opt_structure(spec, optimizer, treedef, src, flags, None, paths, layouts),
        opt_abstract.split, layouts, paths))
  master = tuple(bool(t and prec.has_master(spec.policy, d)) for t, d in zip(flags, dtypes))
  stored = tuple(prec.param_dtype(spec.policy, d) if t else jnp.dtype(d)
                 for t, d in zip(flags, dtypes))
  meta = StateMeta(tuple(layouts), flags, opt_layouts, stacks, master, stored,
                   step_signature(spec, optimizer), module, jax.tree.structure(opt_abstract),
                   plan, looks if any(looks) else (),
                   master_in_params(spec) and any(master))
  return treedef, meta


def master_in_params(spec: StepSpec) -> bool:
  """Whether a state keeps its float32 master copies as its parameters, with no
  half-precision copy: stage 3 with a master-keeping policy (``"bf16"``, ``"fp16"``), whose
  gathers cast each device's float32 block first, as FSDP2 does. Not with ``hpz_axis`` (the
  secondary copy is a half-precision copy by design, split over fewer devices than the
  master) nor with ``offload=`` (the master lives on the host; the devices keep the half
  copy they gather from)."""
  return (spec.stage == 3 and spec.policy.master_dtype is not None and spec.offload is None
          and not spec.comm.outer_axes)


def opt_structure(spec: StepSpec, optimizer, treedef, src, flags, plan, paths, layouts):
  """(shape structs, layouts) of the optimizer state a state keeps: the transformation's
  own state, or with ``whole_leaf_update=`` a `zero_jax.step.whole_leaf.WholeLeafState`."""
  tree = jax.tree.unflatten(treedef, src)
  if plan is None:
    abstract = jax.eval_shape(masked_optimizer(optimizer, treedef, flags).init, tree)
    return abstract, _opt_layouts(abstract, paths, layouts, spec.n_data)
  abstract = whole_leaf.stored_abstract(optimizer, treedef, tree, flags, plan)
  # Small shared leaves (counts, coefficients) stay whole: every home update reads them.
  own = whole_leaf.owners(abstract.split, paths, [l.shape for l in layouts])
  split = [l if o is not None or math.prod(l.shape) > whole_leaf.SMALL_SHARED else
           lay.Layout(l.shape, None, 0)
           for l, o in zip(_opt_layouts(abstract.split, paths, layouts, spec.n_data), own)]
  return abstract, tuple(split) + whole_leaf.home_layouts(plan)


def _whole_plan(spec: StepSpec, optimizer, treedef, paths, src, layouts, options, params, *,
                flags, stacks, models):
  """The `zero_jax.step.whole_leaf.Plan` of ``whole_leaf_update=`` (None: no leaf)."""
  if options.whole_leaf_update is None:
    return None
  moved = whole_leaf_flags(options.whole_leaf_update, params, flags)
  for p, m, model in zip(paths, moved, models):
    if m and model:
      raise ValueError(f"whole_leaf_update marks params{p}, which param_specs= splits over "
                       f"model axes; a leaf updated whole on one device cannot be split "
                       f"there. Leave it out of whole_leaf_update, or unsplit it.")
  if any(moved) and spec.offload is not None:
    raise ValueError("whole_leaf_update= keeps the moved leaves' optimizer state on their "
                     "home devices, and offload='optimizer' streams the split state from "
                     "the host: use one or the other.")
  return whole_leaf.make_plan(optimizer, treedef, paths, src, layouts, moved, stacks, flags,
                              n=spec.n_data)


# ------------------------------------------------------------- where it lives
def sharding(spec: StepSpec, pspec, memory_kind=None) -> NamedSharding:
  """A NamedSharding on the mesh states and outputs live on now (`StepSpec.working_mesh`)."""
  return NamedSharding(spec.working_mesh(), pspec, memory_kind=memory_kind)


def param_spec(spec: StepSpec, layout: lay.Layout) -> P:
  """Where a parameter leaf lives: its storage spec at stage 3 (split over the gather
  axes: with hpZ the secondary copy), else its model spec."""
  return layout.spec(spec.gather_axes) if spec.stage == 3 else layout.model_spec()


def partition_specs(spec: StepSpec, meta: StateMeta, treedef, model_state, rng,
                    loss_scale) -> TrainState:
  """A TrainState of PartitionSpecs (the user's mesh): where each part lives."""
  o_def = meta.opt_treedef
  store = lambda l: l.spec(spec.data_axes)
  master = None
  if meta.master_list:
    master = [store(l) if m else None for l, m, t in
              zip(meta.param_layouts, meta.master, meta.trainable) if t]
  return TrainState(
      step=P(), params=jax.tree.unflatten(treedef, [param_spec(spec, l)
                                                    for l in meta.param_layouts]),
      master=master, opt_state=jax.tree.unflatten(o_def, [store(l) for l in meta.opt_layouts]),
      loss_scale=jax.tree.map(lambda _: P(), loss_scale),
      model_state=jax.tree.map(lambda _: P(), model_state), rng=jax.tree.map(lambda _: P(), rng),
      meta=meta)


def state_shardings(spec: StepSpec, specs: TrainState) -> TrainState:
  """NamedShardings for a TrainState of PartitionSpecs (memory kinds: `zero_jax.step.offload`)."""
  host = placement.host_resident(specs)
  return jax.tree.map(lambda p, h: sharding(spec, p, placement.memory_kind(spec, h)), specs, host,
                      is_leaf=lambda x: isinstance(x, P))


# ------------------------------------------------------------------- making it
def init_state(spec: StepSpec, optimizer, meta: StateMeta, treedef, leaves, model_state, rng,
               loss_scale) -> TrainState:
  """The state for parameter ``leaves`` (traced inside the step's ``init``, in Auto mode)."""
  pol, tr = spec.policy, meta.trainable
  src = [x.astype(prec.optimizer_dtype(pol, x.dtype)) if t else x for x, t in zip(leaves, tr)]
  opt_state = _init_opt(optimizer, meta, treedef, src)
  o_leaves, o_def = jax.tree.flatten(opt_state)
  o_leaves = [spec.to_storage(x, l) for x, l in zip(o_leaves, meta.opt_layouts)]
  params = [x.astype(meta.stored_dtype(i)) if t else x
            for i, (x, t) in enumerate(zip(leaves, tr))]
  params = [spec.constrain(lay.pad(x, l) if spec.stage == 3 else x, param_spec(spec, l))
            for x, l in zip(params, meta.param_layouts)]
  master = None
  if meta.master_list:
    master = [spec.to_storage(x.astype(jnp.float32), l) if m else None
              for x, l, m, t in zip(leaves, meta.param_layouts, meta.master, tr) if t]
  return TrainState(step=jnp.zeros((), jnp.int32), params=jax.tree.unflatten(treedef, params),
                    master=master, opt_state=jax.tree.unflatten(o_def, o_leaves),
                    loss_scale=loss_scale, model_state=model_state, rng=rng, meta=meta)


def optimizer_view(spec: StepSpec, meta: StateMeta, params):
  """``params`` (a state's, stored dtypes) as ``jax.ShapeDtypeStruct``s in the dtypes the
  step's optimizer is initialized on (`init_state`): a trainable floating leaf under a bf16
  or fp16 policy in float32 (`zero_jax.numerics.precision.optimizer_dtype`)."""
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [
      jax.ShapeDtypeStruct(np.shape(x), prec.optimizer_dtype(spec.policy, x.dtype) if t
                           else x.dtype) for x, t in zip(leaves, meta.trainable)])


def _init_opt(optimizer, meta: StateMeta, treedef, src):
  """The optimizer state at ``init`` (logical views), as `opt_structure` describes it."""
  tree = jax.tree.unflatten(treedef, src)
  if meta.whole is None:
    return masked_optimizer(optimizer, treedef, meta.trainable).init(tree)
  plan = meta.whole
  full = optax.masked(optimizer, whole_leaf.mask_tree(treedef, meta.trainable)).init(tree)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  homes = whole_leaf.init_homes(plan, full, paths, [np.shape(x) for x in src])
  split = whole_leaf.split_optimizer(optimizer, treedef, meta.trainable, plan.moved).init(tree)
  return whole_leaf.WholeLeafState(split, homes)


def logical_params(meta: StateMeta, params) -> Any:
  """Shape structs of the logical parameters of a state (for re-deriving its meta)."""
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(l.shape, x.dtype)
                                      for l, x in zip(meta.param_layouts, leaves)])
