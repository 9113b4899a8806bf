"""`make_sharded_train_step`: ZeRO stages 1-3 as one compiled function.

It only assembles the parts, in the order the data flows through a step inside one
``jax.jit``: the options (`zero_jax.step.spec`), the state (`zero_jax.step.state`), the batch
(`zero_jax.step.batch`), each device's reduced gradient (`zero_jax.step.grads`) and the update
(`zero_jax.step.update`). The docs' "How it works" page tells the whole story."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from zero_jax.step import batch as batching
from zero_jax.step import compile_options
from zero_jax.step import context
from zero_jax.step import forward
from zero_jax.step import grads as grads_lib
from zero_jax.step import init as init_lib
from zero_jax.step import loss as loss_lib
from zero_jax.layers import stacking as layers
from zero_jax.numerics import loss_scale as ls_lib
from zero_jax.layers import nnx as nnx_lib
from zero_jax.step import state as st
from zero_jax.step import state_checks
from zero_jax.step import update as update_lib
from zero_jax.comm.collectives import DEFAULT_BUCKET_BYTES, Quantize
from zero_jax.step.monitor import StallWatch
from zero_jax.step.options import LeafOptions, check_stacked_selects
from zero_jax.step.spec import StepSpec, make_spec, parse_loss_scale
from zero_jax.step.signature import as_transformation
from zero_jax.step.state import StateMeta, TrainState

_METRICS = ("loss", "grad_norm", "grads_finite", "loss_scale", "skipped_steps",
            "skipped_in_a_row", "step", "health")


class ShardedTrainStep:
  """A compiled ZeRO training step. Made by `make_sharded_train_step`.

  Attributes:
    spec: the validated options (`zero_jax.step.spec.StepSpec`).
    mesh: the user's mesh.
    loss_fn: the user's loss function.
    optimizer: the optax transformation.
  """

  def __init__(self, loss_fn, optimizer, spec: StepSpec, *, loss_scale,
               leaf_options: LeafOptions):
    if isinstance(optimizer, nnx.Optimizer):
      raise TypeError(nnx_lib.OPTIMIZER_ERROR)
    optimizer = as_transformation(optimizer)
    nnx_lib.check_filter(leaf_options.wrt, "wrt")
    self.loss_fn = loss_fn
    self.wrt = leaf_options.wrt
    self.optimizer = optimizer
    self.spec = spec
    self.mesh = spec.mesh
    self.initial_loss_scale = loss_scale
    self.leaf_options = leaf_options
    self._jits: dict = {}  # (meta, in the user's context) -> the jitted step
    self._get_params = jax.jit(functools.partial(update_lib.full_params, spec))
    self._copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))
    self._metas: dict[int, StateMeta] = {}
    self._batches: set = set()
    self._warned_nested = [False]
    self._apply_fns: dict = {}  # code -> [first function, warned] (forward.warn_if_remade)
    q = spec.comm.quantize
    self._stall = StallWatch(q.block_size if q is not None and q.weights else None)

  @property
  def n(self) -> int:
    """Devices the state is split over (the product of the data axes)."""
    return self.spec.n_data

  # --------------------------------------------------------------------- init
  def _meta(self, params, module=None):
    layers.check_boxes(self.spec, params)
    treedef, meta = st.build_meta(self.spec, self.optimizer, params, self.leaf_options,
                                  module=module)
    check_stacked_selects(self.leaf_options.stacked, meta.stacked, params,
                          param_stage=self.spec.param_stage)
    self._metas[id(meta)] = meta
    return treedef, meta

  def _partition_specs(self, meta, treedef, model_state, rng, loss_scale=None) -> TrainState:
    return st.partition_specs(self.spec, meta, treedef, model_state, rng,
                          self.initial_loss_scale if loss_scale is None else loss_scale)

  def init(self, params, *, model_state=None, rng=None, donate: bool = False) -> TrainState:
    """Builds the state: parameters placed, optimizer state and master copy split.

    No device holds a whole parameter it does not keep: a function runs under
    ``jit`` with the state's shardings, and arrays already split on the mesh
    are used where they lie (see `zero_jax.step.init`).

    Args:
      params: a zero-argument function returning the params pytree or an
        ``nnx.Module`` (``lambda: Model(nnx.Rngs(0))``): each device computes
        only its own block, with the values an eager call would give; or a
        pytree of arrays (host numpy, on any device, or global arrays split
        on the mesh over the data axes and, per ``param_specs``, the model
        axes); or an ``nnx.Module``: its ``wrt`` variables train and the
        others are its model state; ``loss_fn`` then gets the module (see
        `zero_jax.layers.nnx`).
      model_state: optional untrained state (e.g. Flax ``batch_stats``); when
        given, ``loss_fn`` is called with ``model_state=`` and returns the
        new one (see `make_sharded_train_step`). None with a module.
      rng: optional PRNG key; when given, ``loss_fn`` is called with ``rng=``,
        a key distinct for every step, device and micro-batch.
      donate: hand the buffers of ``params`` arrays already on the mesh to the
        state where it keeps them as they are (stage 3, same dtype and split:
        no second copy of the model); those arrays cannot be used afterwards.

    Returns:
      The `TrainState`.
    """
    source = init_lib.resolve(params, model_state, self.wrt)
    if source.make is None:
      init_lib.check_values(source, rng)
    treedef, meta = self._meta(source.params, source.module)
    loss_lib.check_model_state(source.model_state)
    loss_lib.check_rng(rng)
    init_lib.warn_about(self.spec, source, meta)
    return init_lib.make_state(self.spec, self.optimizer, meta, treedef, source, rng,
                               self.initial_loss_scale, donate=donate)

  def abstract_state(self, params, *, model_state=None, rng=None) -> TrainState:
    """The `TrainState` that ``init`` would return, as shape/dtype/sharding only.

    Nothing is computed or allocated. Use it as a restore target for
    checkpoints or to ``lower`` the step for a memory estimate.

    Args:
      params: arrays or ``jax.ShapeDtypeStruct``s with the parameters' shapes,
        an ``nnx.Module`` (also an abstract one from ``nnx.eval_shape``), or
        an init function as for ``init`` (traced, not run).
      model_state: as for ``init`` (arrays or shape structs), or None.
      rng: as for ``init`` (a key or its shape struct), or None.
    """
    source = init_lib.resolve(params, model_state, self.wrt)
    treedef, meta = self._meta(source.params, source.module)
    return init_lib.abstract_state(self.spec, self.optimizer, meta, treedef, source, rng,
                                   self.initial_loss_scale)

  # ---------------------------------------------------------------- the step
  def _prepare(self, state, what: str = "the step", *, abstract: bool = False) -> TrainState:
    """The state, checked, on the mesh this call works on (moved without a copy if not)."""
    self._check_state(state, what, abstract=abstract)
    return context.on_working_mesh(self.spec, state)

  def _check_state(self, state, what: str = "the step", *, abstract: bool = False) -> None:
    state_checks.check_state(self.spec, self.optimizer, state, what, self.leaf_options,
                             known=self._metas, abstract=abstract)
    ls_lib.check_same_policy(self.initial_loss_scale, state.loss_scale)

  def _loss_fn(self, meta: StateMeta, evaluate: bool = False):
    """The loss the step calls: ``loss_fn`` itself, or wrapped to take and give a module
    (``evaluate``: in eval mode, as `evaluate` runs it)."""
    if meta.module is None:
      return self.loss_fn
    return loss_lib.module_loss(self.loss_fn, meta.module, self.wrt, self.spec.has_aux,
                                evaluate=evaluate)

  def _place(self, batch):
    leaves, treedef = jax.tree.flatten(batch)
    key = (treedef, tuple(np.shape(x) for x in leaves))
    if key not in self._batches:
      batching.check_batch(self.spec, batch)
      self._batches.add(key)
    return batching.place_batch(self.spec, batch)

  def _step_fn(self, state: TrainState, batch):
    spec = self.spec

    aux_specs = {}  # per-example aux leaves are split: their specs are known once traced

    def body(state, batch):
      local = grads_lib.sharded_grads(spec, self._loss_fn(state.meta), state, batch)
      new_state, metrics = update_lib.apply_update(spec, self.optimizer, state, local.grads,
                                                   local.loss, local.aux, local.weight)
      metrics["skipped_in_a_row"] = new_state.loss_scale.skipped_in_a_row
      if "metrics" in aux_specs and spec.has_aux:
        aux_specs["metrics"]["aux"] = local.aux_specs
      applied = new_state.loss_scale.skipped_in_a_row == 0
      model_state = update_lib.keep_if_skipped(applied, local.model_state, state.model_state)
      return new_state.replace(model_state=model_state), metrics

    def out_specs(state, batch):  # metrics are replicated scalars (aux: set by body)
      del batch
      metrics = dict.fromkeys(_METRICS + (("aux",) if spec.has_aux else ()), P())
      aux_specs["metrics"] = metrics  # auto_axes reads it after tracing body
      return (self._partition_specs(state.meta, jax.tree.structure(state.params), state.model_state,
                          state.rng, state.loss_scale), metrics)
    return context.in_auto(spec, body, out_specs)(state, batch)

  def _run(self, fn, state, batch):
    return context.run(self.spec, fn, state, self._place(batch))

  def _jitted(self, what, state: TrainState, make: Callable):
    """The jit of ``make()``'s ``(fn, jit keywords)`` for ``what`` (the step, `evaluate`, an
    `apply` function) and this state's layout, made once (each compiles once per shape)."""
    traced = isinstance(state.step, jax.core.Tracer)  # inside the user's jit: theirs compiles
    key = (what, state.meta, self.spec.in_user_context(), traced)
    fn = self._jits.get(key)
    if fn is None:
      body, kwargs = make()
      fn = jax.jit(body, compiler_options=None if traced else self.compiler_options, **kwargs)
      self._jits[key] = fn
    if traced:
      compile_options.warn_if_nested(self.mesh, self.compiler_options, self._warned_nested)
    return fn

  def _metric_shardings(self, names) -> dict:
    metrics = dict.fromkeys(names, st.sharding(self.spec, P()))
    if self.spec.has_aux:
      metrics["aux"] = None  # as the step made it (per-example leaves split over the batch)
    return metrics

  def _compiled(self, state: TrainState):
    """The jitted step for this state's layout, its outputs pinned to the state's shardings."""
    def make():
      specs = self._partition_specs(state.meta, jax.tree.structure(state.params),
                                    state.model_state, state.rng, state.loss_scale)
      return self._step_fn, dict(
          donate_argnums=(0,) if self.spec.donate else (),
          out_shardings=(st.state_shardings(self.spec, specs), self._metric_shardings(_METRICS)))
    return self._jitted("step", state, make)

  @property
  def compiler_options(self) -> dict:
    """What the step's own ``jax.jit`` asks of XLA, from the mesh's devices (on GPUs: what
    lets `zero_jax.scan`'s in-loop collectives overlap; `zero_jax.step.compile_options`)."""
    return compile_options.for_step(self.mesh, self.spec.comm)

  def jit(self, fn: Callable, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` compiling with `compiler_options`, for a function that
    calls the step. Inside any other jit on GPUs the step warns once that they are missing.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
      >>> step = zj.make_sharded_train_step(lambda p, b: jnp.mean((b @ p) ** 2),
      ...                                   optax.sgd(0.1), mesh=jax.make_mesh((8,), ("data",)))
      >>> two = step.jit(lambda s, b: step(step(s, b)[0], b))
      >>> state, metrics = two(step.init(jnp.ones((3, 2))), jnp.ones((8, 3)))
      >>> int(state.step)
      2
    """
    return compile_options.jit(self.compiler_options, fn, **jit_kwargs)

  def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One training step on a global batch. Returns ``(new_state, metrics)``."""
    state = self._prepare(state)
    new_state, metrics = self._run(self._compiled(state), state, batch)
    if not isinstance(new_state.step, jax.core.Tracer):  # not inside the user's jit or scan
      self._stall.observe(metrics, state, new_state)
    return new_state, metrics

  def evaluate(self, state: TrainState, batch) -> dict:
    """The step's metrics for ``batch`` without a gradient or an update; ``state`` is left
    as it was (not donated).

    The loss runs as in the step: ``batch`` split over the batch axes and into
    ``grad_accum_steps`` micro-batches (a ``lax.scan``), the parameters as the loss sees
    them (stage 3: gathered, stacked leaves one layer at a time by `zero_jax.scan` /
    `zero_jax.gather`; hpZ, ``quantize`` and the compute dtype as in the step's forward
    pass). Compiled once per shape. A module (``init(model)``) runs as ``model.eval()``
    sets it (Dropout off, BatchNorm reading its running statistics); a new model state
    from ``loss_fn`` (or the module's changes) is dropped, and every micro-batch starts
    from the state's. With ``init(rng=)``, ``loss_fn`` gets the key the training step would
    give it for this state's step (``metrics["step"]``), device and micro-batch.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> loss_fn = lambda p, b: jnp.mean((b @ p) ** 2)
      >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3)
      >>> state = step.init(jnp.ones((3, 2)))
      >>> metrics = step.evaluate(state, jnp.ones((8, 3)))
      >>> float(metrics["loss"]), int(metrics["step"])
      (9.0, 0)

    Args:
      state: a `TrainState` of this step.
      batch: a global batch, as for the step (its leading dimension divisible by the
        batch devices times ``grad_accum_steps``).

    Returns:
      ``{"loss": global mean (or WeightedLoss mean), "step": the state's step}``, and
      ``"aux"`` (combined by ``aux_reduce``) with ``has_aux``; replicated on every device
      and process.
    """
    state = self._prepare(state, "evaluate")
    fn = self._jitted("evaluate", state, lambda: (
        lambda s, b: forward.evaluate(self.spec, self._loss_fn(s.meta, evaluate=True), s, b),
        dict(out_shardings=self._metric_shardings(forward.METRICS))))
    return self._run(fn, state, batch)

  def apply(self, state: TrainState, fn: Callable, *args, split_args: bool = False):
    """``fn(params_or_model, *args)`` on the split state, as the loss sees the parameters.

    For logits, sampling or any other forward use of a model that need not fit one
    device: ``fn`` runs on every device inside the step's ``shard_map`` with the
    parameters the step's loss gets (stage 3: gathered; stacked leaves left split, for
    `zero_jax.scan` / `zero_jax.gather` to gather one layer at a time). A module
    (``init(model)``) comes as ``model.eval()`` sets it, and what ``fn`` changes in it is
    dropped; a params tree made with ``init(..., model_state=)`` comes with the keyword
    ``model_state=``; the state's ``rng`` is not used (pass a key among ``args`` to sample).
    ``state`` is left as it was. Compiled once per ``fn`` and shape: pass the same function
    object to reuse the program.

    Example:
      >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> step = zj.make_sharded_train_step(lambda p, b: jnp.mean((b @ p) ** 2),
      ...                                   optax.sgd(0.1), mesh=mesh, stage=3)
      >>> state = step.init(jnp.ones((3, 2)))
      >>> step.apply(state, lambda p, x: x @ p, jnp.ones((1, 3))).tolist()
      [[3.0, 3.0]]

    Args:
      state: a `TrainState` of this step.
      fn: ``fn(params_or_model, *args) -> pytree of arrays``.
      *args: pytrees of arrays (bind Python values into ``fn``). Replicated to every
        device, which computes the whole output (the weights reach each device layer by
        layer; the activations are whole).
      split_args: split the args' leading dimension over the batch axes like a batch
        (divisible by the batch devices): each device computes its rows, and every output
        leaf is the devices' outputs concatenated in order along its leading dimension.

    Returns:
      ``fn``'s output: replicated arrays (split over the batch axes with ``split_args``).
    """
    state = self._prepare(state, "apply")
    forward.check_fn(fn)
    forward.warn_if_remade(fn, self._apply_fns)
    args = forward.place_args(self.spec, args, split_args=split_args)
    jitted = self._jitted(("apply", fn, split_args), state, lambda: (
        lambda s, a: forward.apply(self.spec, fn, s, a, split_args=split_args), {}))
    return context.run(self.spec, jitted, state, args)

  def lower(self, state: TrainState, batch, *, lowering_platforms=None) -> jax.stages.Lowered:
    """The lowered step, for ``.compile().memory_analysis()`` or ``.as_text()``.

    ``lowering_platforms``, e.g. ``("cuda",)``, lowers for another backend than the mesh's
    (to read, not to compile, e.g. the host transfers of ``offload``)."""
    state = self._prepare(state, "lower", abstract=True)
    fn = self._compiled(state)
    return self._run(lambda s, b: fn.trace(s, b).lower(lowering_platforms=lowering_platforms),
                     state, batch)

  def get_params(self, state: TrainState):
    """The full parameters: original shapes, tree and (master) dtypes, on the user's mesh
    (replicated over the data and replica axes, split over model axes as ``param_specs``)."""
    state = self._prepare(state, "get_params")
    self._stall.flush()  # warnings about the steps that made this state, before it is used
    with context.mesh_context(self.spec):
      return self._get_params(state)

  def get_model(self, state: TrainState):
    """The trained ``nnx.Module`` of a state made by ``init(model)``: its ``wrt`` variables
    are `get_params`'s (the fp32 master copy where there is one), its others the model
    state (BatchNorm statistics, RNG state); fresh arrays on the user's mesh that later steps
    do not donate. Use it outside the step, e.g. ``model.eval()`` then ``model(x)``."""
    if state.meta.module is None:
      raise TypeError("get_model needs a state made by step.init(model) with an nnx.Module; "
                      "this state was made from a params pytree: use step.get_params(state).")
    state = self._prepare(state, "get_model")
    params = self.get_params(state)
    with context.mesh_context(self.spec):
      return nnx_lib.merge(state.meta.module, params, self._copy(state.model_state))


def make_sharded_train_step(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh,
    axis_name: str | tuple[str, ...] = "data",
    replica_axis: str | tuple[str, ...] | None = None,
    param_specs=None,
    stage: int = 2,
    has_aux: bool = False,
    aux_reduce=None,
    precision: str = "fp32",
    loss_scale=None,
    max_grad_norm: float | None = None,
    grad_accum_steps: int = 1,
    accumulate: str | None = None,
    trainable=None,
    stacked=None,
    lookup=None,
    whole_leaf_update=None,
    wrt=nnx.Param,
    comm_dtype=None,
    offload: str | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    gather_once: bool = False,
    hpz_axis: str | tuple[str, ...] | None = None,
    quantize: Quantize | None = None,
    donate: bool = True,
) -> ShardedTrainStep:
  """Builds a ZeRO-sharded training step for ``loss_fn`` and ``optimizer``.

  The step's loss and gradient equal ``loss_fn(params, global_batch)`` and its
  gradient on one device; its update equals ``optimizer``'s single-device
  update. Optimizer state (stage 1), gradients (stage 2) and parameters
  (stage 3) are split over the product of the ``axis_name`` axes.

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

    A Flax NNX module instead of a params pytree (see `zero_jax.layers.nnx`):

    >>> from flax import nnx
    >>> def nnx_loss(model, batch):   # model: an nnx.Module, mutated as NNX code does
    ...   return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    >>> step = zj.make_sharded_train_step(nnx_loss, optax.adam(1e-2), mesh=mesh)  # wrt=nnx.Param
    >>> state = step.init(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    >>> state, metrics = step(state, batch)
    >>> model = step.get_model(state)  # an nnx.Linear with the trained kernel and bias

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss over the
      examples of ``batch``, or a `WeightedLoss` (a sum and its weight; the
      step then takes the weighted mean over the whole global batch). With
      ``has_aux=True`` it returns ``(loss, aux)``. When ``init`` got
      ``model_state=``, it is called with the keyword ``model_state=`` and
      returns the new model state last: ``(loss, new_model_state)`` or
      ``(loss, aux, new_model_state)``; the step averages the new model state
      over the batch axes (for BatchNorm statistics). When ``init`` got
      ``rng=``, it is called with the keyword ``rng=``, this device's key:
      ``fold_in(fold_in(fold_in(rng, step), device), micro_batch)``.
      With ``init(model)`` (an ``nnx.Module``): ``loss_fn(model, batch) ->
      loss`` (or ``(loss, aux)``, or a `WeightedLoss`; ``rng=`` too when
      ``init`` got one) gets a module made from this device's values and
      may mutate it (BatchNorm statistics, ``nnx.Rngs`` counters); the step
      keeps what it holds afterwards as the new model state. No
      ``model_state=`` plumbing: the module's non-``wrt`` variables are the
      model state.
    optimizer: any ``optax.GradientTransformation``, or an ``optax.MultiSteps``
      (for an ``nnx.Optimizer`` pass its transformation, and the module to
      ``init``).
    mesh: the ``jax.sharding.Mesh`` (Explicit or Auto axis types).
    axis_name: the mesh axis, or tuple of axes, the batch and the state are
      split over (ZeRO).
    replica_axis: axes the batch is also split over but the state is
      replicated along (hybrid sharding: the reduce-scatter and all-gather
      stay within the ``axis_name`` group; only each 1/N gradient block is
      all-reduced across ``replica_axis``). None: no such axes.
    param_specs: a pytree of ``PartitionSpec`` (a prefix of the params) over
      the mesh's other axes (tensor parallelism). Default: taken from params
      that arrive as global arrays sharded on the mesh, or from the names of
      Linen ``nn.Partitioned`` boxes. Every other mesh axis
      of size > 1 must be used by some parameter.
    stage: 1, 2 or 3 (ZeRO stage).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``metrics["aux"]``
      then equals ``loss_fn``'s aux on the whole global batch (see
      ``aux_reduce``).
    aux_reduce: how each aux leaf is combined over devices and micro-batches:
      ``"mean"``, ``"sum"``, ``"max"``, ``"min"`` or ``"concat"`` (per-example
      leaves in global batch order), as one rule, a pytree prefix of the aux
      or a function ``(path, leaf) -> rule``. Default (None): per-example
      leaves (leading dimension: the rows ``loss_fn`` is given) ``"concat"``,
      other floating leaves ``"mean"``, integer leaves ``"sum"``; bool leaves
      need a rule. See `zero_jax.step.aux`.
    precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp16_memory_efficient"``;
      see `zero_jax.numerics.precision`.
    loss_scale: ``None`` (dynamic for fp16, none otherwise), ``"dynamic"``,
      ``"none"``, a number (static scale) or a `LossScaleState`.
    max_grad_norm: clip the averaged, unscaled gradient to this global norm.
    grad_accum_steps: split each device's batch into this many micro-batches,
      run in order by a ``lax.scan`` inside the step (the global batch size
      must be divisible by the batch devices times ``grad_accum_steps``). The
      update equals one step on the whole batch.
    accumulate: where the micro-batch gradients are summed: ``"local"``
      (default for stages 1-2, like ``no_sync``: full-size float32
      accumulator, one reduction per step; at stage 3 with ``gather_once``) or
      ``"sharded"`` (stages 2-3, the default for stage 3: each micro-batch's
      gradient is reduce-scattered at once and only the 1/N block accumulated).
    trainable: which parameter leaves train: ``None`` (every floating or
      complex leaf), a pytree of bools matching the params or a prefix of
      them, or a function ``(path, leaf) -> bool``; with a module, an NNX
      filter over its ``wrt`` variables (``nnx.PathContains("head")``,
      ``nnx.Not(...)``, a function ``(path, variable) -> bool``, ...). Frozen
      leaves have no optimizer state, no gradient and no communication, and
      never change.
    stacked: which leaves are stacks of per-layer weights along their first
      dimension that ``loss_fn`` loops over; same forms as ``trainable``. At
      stage 3 they reach ``loss_fn`` as `ShardedParam`s and ``loss_fn`` calls
      `zero_jax.gather` on each layer's slice (see `zero_jax.layers.stacked`; for an
      ``nnx.scan`` over a stacked NNX block, `zero_jax.layers.nnx`).
    lookup: which leaves are tables ``loss_fn`` reads rows of with
      `zero_jax.take` (embeddings); same forms as ``trainable``. At stage 3
      they stay split (along a dimension after the first) and reach
      ``loss_fn`` as `zero_jax.layers.lookup.LookupTable`s: ``zj.take(table,
      ids)`` moves only the looked-up rows, ``zj.gather(table)`` the whole
      table (tied output logits). At stages 1-2 ``take`` is plain indexing.
    whole_leaf_update: leaves (as ``trainable``) updated whole on a home device (Muon guide).
    wrt: with ``init(model)``, an NNX filter (as ``nnx.Optimizer``'s) for
      the variables that are parameters; every other variable is model
      state. An ``nnx.State`` given as params must hold only ``wrt``
      variables (``nnx.state(model)`` with BatchNorm statistics is refused:
      pass the module). Unused for other params.
    comm_dtype: floating dtype on the wire for the gradient reduction
      (stages 1-2), e.g. ``jnp.bfloat16``; default the gradient's dtype (with
      ``accumulate="local"`` and ``grad_accum_steps > 1``, the float32
      accumulator's).
    offload: ``None`` or ``"optimizer"``: the optimizer state and master copy
      in pinned host memory between steps, streamed through the devices for
      the update (`zero_jax.step.offload`; needs ``pinned_host`` memory).
    bucket_bytes: leaves smaller than this move together, packed into buffers
      of at most this many bytes per dtype (one collective per bucket); 0:
      one collective per leaf. See the speed guide.
    gather_once: stage 3: all-gather the parameters once per step and keep
      them whole through every micro-batch (FSDP's
      ``reshard_after_forward=False``): stage 2's peak memory during the
      step, one parameter gather per step instead of 2k.
    hpz_axis: stage 3, ZeRO++ hpZ: the data axes within a host (a proper
      subset of ``axis_name``). The optimizer state and master copy stay split
      over every data axis; the parameters the loss gathers are a secondary
      copy split over these axes only, so the per-layer all-gathers never
      cross hosts (cost: that copy, 1/N_host of the parameters per device).
    quantize: a `zero_jax.Quantize` record (ZeRO++ qwZ/qgZ): parameter
      all-gathers and gradient reduce-scatters carry block-quantized integers;
      the master copy, optimizer and update stay exact. See the ZeRO++ guide.
    donate: donate the input state's buffers to the output (do not reuse a
      state after passing it to the step).

  Returns:
    A `ShardedTrainStep` with ``init``, ``__call__``, ``evaluate``, ``apply``, ``lower``,
    ``abstract_state``, ``get_params`` and ``get_model``.
  """
  spec = make_spec(mesh=mesh, axis_name=axis_name, replica_axis=replica_axis, stage=stage,
                   has_aux=has_aux, precision=precision, max_grad_norm=max_grad_norm,
                   grad_accum_steps=grad_accum_steps, accumulate=accumulate,
                   comm_dtype=comm_dtype, donate=donate, offload=offload,
                   bucket_bytes=bucket_bytes, gather_once=gather_once, hpz_axis=hpz_axis,
                   quantize=quantize, aux_reduce=aux_reduce)
  return ShardedTrainStep(loss_fn, optimizer, spec,
                          loss_scale=parse_loss_scale(loss_scale, spec.policy),
                          leaf_options=LeafOptions(trainable, stacked, param_specs, wrt,
                                                   whole_leaf_update, lookup))
