"""Per-device memory of a ZeRO step, from shapes alone, before training.

`memory_report` counts parameters, gradients, optimizer state and master copy per stage with
the layouts the step uses (padding included), from ``jax.ShapeDtypeStruct``s, in milliseconds;
`compiled_memory` asks XLA about the compiled step (activations and temporaries included). See
the docs' memory planning guide.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> params = {"emb": jax.ShapeDtypeStruct((50257, 768), jnp.float32)}
  >>> report = zj.memory_report(params, optax.adam(1e-3), n_devices=8, precision="bf16")
  >>> report[2].optimizer_state      # Adam's moments split 8 ways along 768, and its count
  38597380
  >>> print(report)                  # a Markdown table, one row per stage
  Per-device memory: 38,597,376 parameters (38,597,376 trainable), 8 devices, precision bf16.
  <BLANKLINE>
  | stage | params | gradients | optimizer state | master copy | total | vs DP |
  |---|---:|---:|---:|---:|---:|---:|
  | DP (replicated) | 73.6 MiB | 73.6 MiB | 294 MiB | 147 MiB | 589 MiB | 1.00x |
  | ZeRO-1 | 73.6 MiB | 73.6 MiB | 36.8 MiB | 18.4 MiB | 202 MiB | 0.34x |
  | ZeRO-2 | 73.6 MiB | 9.2 MiB | 36.8 MiB | 18.4 MiB | 138 MiB | 0.23x |
  | ZeRO-3 | 0 B | 9.2 MiB | 36.8 MiB | 18.4 MiB | 64.4 MiB | 0.11x |
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zero_jax.step import init as init_lib
from zero_jax.numerics import precision as prec
from zero_jax.layers import prefetch as prefetch_lib
from zero_jax.comm.layout import local_storage_shape, model_block_shape
from zero_jax.step.spec import OFFLOAD_CHOICES, planning_spec
from zero_jax.step.signature import as_transformation
from zero_jax.step.options import LeafOptions
from zero_jax.step.state import build_meta, opt_structure

STAGE_NAMES = {0: "DP (replicated)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


class StageMemory(NamedTuple):
  """Bytes one device holds at one ZeRO stage.

  Attributes:
    stage: 0 (plain data parallelism), 1, 2 or 3.
    params: the parameters as kept apart from the master copy (in the dtype the loss
      sees them in). At stage 3 with ``"bf16"``/``"fp16"`` (without ``hpz_axis`` or
      ``offload``) the float32 master copy is the parameter, counted once under
      ``master``: a leaf with a master copy adds nothing here. Its cast to the
      compute dtype is made where it is gathered, of what is gathered (a stacked
      leaf's one layer in the loop, inside `prefetch`'s gathered layer), so no
      half-precision copy of the device's block is counted or held.
    gradients: the reduced gradient the update reads.
    optimizer_state: the optax state.
    master: the float32 master copy (0 when the policy keeps none).
    host: the part of the above kept in pinned host memory between steps
      (``offload="optimizer"``: optimizer state and master copy).
    prefetch: the buffers `zero_jax.scan` adds with ``prefetch=1``: stage 3
      one more gathered layer and one layer's gradient (reduced one iteration
      late), with hpZ or replica axes also a layer's gradient reduced within
      the host (its hop across hosts runs one iteration later); stage 2 that
      gradient.
  """
  stage: int
  params: int
  gradients: int
  optimizer_state: int
  master: int
  host: int = 0
  prefetch: int = 0

  @property
  def total(self) -> int:
    """Every byte above, on the device or on the host."""
    return self.params + self.gradients + self.optimizer_state + self.master + self.prefetch

  @property
  def device(self) -> int:
    """The bytes on the device: ``total`` less ``host``."""
    return self.total - self.host


def format_bytes(n: float) -> str:
  """``1536 -> '1.5 KiB'``: binary units, three significant digits."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
    if abs(n) < 1024 or unit == "TiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
    n /= 1024
  raise AssertionError  # unreachable


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Per-device memory for each requested stage. Made by `memory_report`.

  Attributes:
    n_devices: devices on the data axis.
    precision: the precision policy's name.
    n_params: number of parameter elements (all leaves).
    n_trainable: number of trainable parameter elements.
    rows: one `StageMemory` per stage, in the order requested.
    offload: the ``offload=`` it was made for.
  """
  n_devices: int
  precision: str
  n_params: int
  n_trainable: int
  rows: tuple[StageMemory, ...]
  offload: str | None = None

  def __getitem__(self, stage: int) -> StageMemory:
    for row in self.rows:
      if row.stage == stage:
        return row
    raise KeyError(f"stage {stage} is not in this report, which has stages "
                   f"{[r.stage for r in self.rows]}; pass stages=(..., {stage}) to "
                   f"memory_report.")

  def to_markdown(self) -> str:
    """The report as a Markdown table with a one-line caption."""
    base = self[0].device if any(r.stage == 0 for r in self.rows) else None
    off, pre = self.offload is not None, any(r.prefetch for r in self.rows)
    caption = (f"Per-device memory: {self.n_params:,} parameters ({self.n_trainable:,} "
               f"trainable), {self.n_devices} devices, precision {self.precision}")
    lines = [caption + (f", offload={self.offload!r}: optimizer state and master copy in "
                        f"pinned host memory at stages 1-3." if off else "."), "",
             "| stage | params | gradients | optimizer state | master copy |"
             + (" prefetch |" if pre else "") + " total |"
             + (" on host | on device |" if off else "")
             + ((" device vs DP |" if off else " vs DP |") if base else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if pre else "")
             + ("---:|---:|" if off else "") + ("---:|" if base else "")]
    for r in self.rows:
      cells = [STAGE_NAMES[r.stage], *(format_bytes(b) for b in
               (r.params, r.gradients, r.optimizer_state, r.master)
               + ((r.prefetch,) if pre else ()) + (r.total,))]
      if off:
        cells += [format_bytes(r.host), format_bytes(r.device)]
      if base:
        cells.append(f"{r.device / base:.2f}x")
      lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.to_markdown()

  def _repr_markdown_(self) -> str:  # rendered as a table in Jupyter
    return self.to_markdown()

  def as_dict(self) -> dict:
    """``{stage: {"params": ..., ..., "host": ..., "total": ..., "device": ...}}`` in bytes."""
    return {r.stage: {**r._asdict(), "total": r.total, "device": r.device} for r in self.rows}


def _shape_dtype(path, x):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"params{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
                    f"array or jax.ShapeDtypeStruct; pass arrays, or shapes from "
                    f"jax.eval_shape(model.init, ...).")
  return tuple(int(d) for d in np.shape(x)), jnp.dtype(x.dtype)


def _bytes(shape, dtype) -> int:
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def memory_report(params: Any, optimizer: optax.GradientTransformation, *,
                  n_devices: int | None = None, mesh=None, axis_name="data", replica_axis=None,
                  param_specs=None, precision: str = "fp32", stages=(0, 1, 2, 3),
                  trainable=None, stacked=None, wrt=nnx.Param, comm_dtype=None,
                  offload: str | None = None, hpz_axis=None, prefetch: int = 0,
                  whole_leaf_update=None, lookup=None) -> MemoryReport:
  """Per-device bytes of params, gradients, optimizer state and master copy.

  Computed from shapes only, with the exact layouts (and padding) the step
  uses; see the module docstring for what is counted. Give either
  ``n_devices`` (one data axis) or the ``mesh`` (a ``jax.sharding.Mesh`` or
  ``AbstractMesh``, so any size can be planned for) with the step's
  ``axis_name``, ``replica_axis`` and ``param_specs``: the state is then split
  over the data axes and, for model-parallel leaves, their model axes.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> from flax import nnx
    >>> shapes = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}  # or jax.eval_shape(init)
    >>> report = zj.memory_report(shapes, optax.adamw(3e-4), n_devices=8, precision="bf16")
    >>> report[2].gradients, report[2].params     # ZeRO-2 splits gradients
    (262144, 2097152)
    >>> report[3].params, report[3].master        # ZeRO-3: the split fp32 master is the parameter
    (0, 524288)
    >>> mesh = jax.sharding.AbstractMesh((16, 8), ("replica", "data"))   # 16 hosts x 8 GPUs
    >>> report = zj.memory_report(shapes, optax.adamw(3e-4), mesh=mesh, replica_axis="replica")
    >>> model = nnx.eval_shape(lambda: nnx.Linear(1024, 1024, rngs=nnx.Rngs(0)))  # nothing allocated
    >>> zj.memory_report(model, optax.adamw(3e-4), n_devices=8)[2].optimizer_state
    1049604
    >>> zj.memory_report(shapes, optax.adamw(3e-4), n_devices=8, offload="optimizer")[2].device
    4718592

  Args:
    params: the parameter tree: arrays or ``jax.ShapeDtypeStruct``s; or an
      ``nnx.Module`` (concrete, or abstract from ``nnx.eval_shape``), whose
      ``wrt`` variables are counted as parameters (the model state is not
      counted); or an init function as ``step.init`` takes (traced, not run).
    optimizer: the ``optax.GradientTransformation`` the step will use.
    n_devices: devices on the data axis (without ``mesh``).
    mesh: the step's mesh (without ``n_devices``).
    axis_name: as for `make_sharded_train_step` (with ``mesh``).
    replica_axis: as for `make_sharded_train_step` (with ``mesh``).
    param_specs: as for `make_sharded_train_step` (with ``mesh``).
    precision: the step's precision policy (``"fp32"``, ``"bf16"``, ``"fp16"``,
      ``"fp16_memory_efficient"``).
    stages: which rows to report; 0 is plain (replicated) data parallelism.
    trainable: as for `make_sharded_train_step`: ``None``, a pytree of bools
      (or a prefix) or a function ``(path, leaf) -> bool``; an NNX filter for
      a module.
    stacked: as for `make_sharded_train_step` (changes only the padding).
    lookup: as for `make_sharded_train_step` (changes only the padding).
    wrt: as for `make_sharded_train_step`: which variables of a module train.
    comm_dtype: as for `make_sharded_train_step`; the dtype gradients are
      reduced in (default: the parameter dtype).
    offload: as for `make_sharded_train_step`: with ``"optimizer"`` the
      optimizer state and master copy of stages 1-3 count as ``host`` bytes.
    hpz_axis: as for `make_sharded_train_step` (with ``mesh``): stage 3's
      parameters are the secondary copy, split over these axes only.
    prefetch: as for `zero_jax.scan` over the ``stacked`` leaves: with 1 the
      rows of stages 2-3 count its buffers (`StageMemory.prefetch`). The
      activations each layer keeps (``zj.scan``'s ``policy=``) depend on the
      model's code, not its shapes, and are not counted: `compiled_memory`
      and `zero_jax.plan` read them from XLA.
    whole_leaf_update: as for `make_sharded_train_step`: the moved leaves'
      optimizer state counts where it lives, whole on its home device (the
      busiest device's slots of each group of equal shapes).

  Returns:
    A `MemoryReport`; ``print`` it for a table, index it by stage for numbers.
  """
  bad = [s for s in stages if s not in STAGE_NAMES]
  if bad:
    raise ValueError(f"stages={tuple(stages)!r}: each stage must be 0 (plain data "
                     f"parallelism), 1, 2 or 3; got {bad}.")
  optimizer = as_transformation(optimizer)
  prefetch_lib.check_prefetch(prefetch, "memory_report")
  if offload not in OFFLOAD_CHOICES:
    raise ValueError(f"offload={offload!r}: choose None or 'optimizer', as for "
                     f"make_sharded_train_step.")
  spec = planning_spec(n_devices=n_devices, mesh=mesh, axis_name=axis_name,
                       replica_axis=replica_axis, precision=precision, comm_dtype=comm_dtype,
                       hpz_axis=hpz_axis)
  params = init_lib.resolve(params, None, wrt).params  # a function is traced, not run
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  shapes = [_shape_dtype(p, x) for p, x in paths_leaves]
  structs = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes])
  _, meta = build_meta(spec, optimizer, structs, LeafOptions(trainable, stacked, param_specs,
                                                             wrt, whole_leaf_update, lookup))
  n, pol = spec.n_data, spec.policy
  src = [jax.ShapeDtypeStruct(s, prec.optimizer_dtype(pol, dt) if t else dt)
         for (s, dt), t in zip(shapes, meta.trainable)]
  opt_dtypes = [x.dtype for x in jax.tree.leaves(opt_structure(
      spec, optimizer, treedef, src, meta.trainable, meta.whole,
      [jax.tree_util.keystr(p) for p, _ in paths_leaves], meta.param_layouts)[0])]

  def size(layout, dtype, split: bool, over: int = n) -> int:  # one device's bytes of a leaf
    shape = local_storage_shape(layout, over) if split else model_block_shape(layout)
    return _bytes(shape, dtype)

  pdt = [prec.param_dtype(pol, dt) if t else dt for (_, dt), t in zip(shapes, meta.trainable)]
  gdt = [spec.comm_dtype or d for d in pdt]
  trained = [i for i, t in enumerate(meta.trainable) if t]
  pl = meta.param_layouts
  layer = lambda i: _bytes(model_block_shape(pl[i])[1:], pdt[i]) if meta.stacked[i] else 0
  ahead = {2: 0, 3: sum(map(layer, range(len(pl))))}  # one more gathered layer
  late = sum(map(layer, trained))                      # one layer's gradient
  # stage 3 with a hop across hosts: another layer's gradient, reduced within the host; with
  # hpZ and replica axes a third, reduced over every data axis (`zero_jax.layers.stacked.hops`)
  hpz, replicas = spec.n_gather < n, bool(spec.replica_axes)
  hop = {2: 0, 3: (-(-late // spec.n_gather) if hpz or replicas else 0)
                  + (-(-late // n) if hpz and replicas else 0)}
  rows = []
  for stage in stages:
    opt_bytes = sum(size(l, d, stage >= 1) for l, d in zip(meta.opt_layouts, opt_dtypes))
    master = sum(size(pl[i], jnp.float32, stage >= 1) for i in trained if meta.master[i])
    # stage 3 keeps no half-precision copy beside the master (`state.master_in_params`)
    single = stage == 3 and not hpz and offload is None and pol.master_dtype is not None
    rows.append(StageMemory(
        stage=stage,
        params=sum(size(pl[i], pdt[i], stage >= 3, spec.n_gather) for i in range(len(pl))
                   if not (single and meta.master[i])),
        gradients=sum(size(pl[i], gdt[i], stage >= 2) for i in trained),
        optimizer_state=opt_bytes, master=master,
        host=opt_bytes + master if offload is not None and stage >= 1 else 0,
        prefetch=(ahead[stage] + late + hop[stage]) if prefetch and stage >= 2 else 0))
  return MemoryReport(
      n_devices=n, precision=pol.name, n_params=sum(math.prod(s) for s, _ in shapes),
      n_trainable=sum(math.prod(shapes[i][0]) for i in trained), rows=tuple(rows),
      offload=offload)


class CompiledMemory(NamedTuple):
  """XLA's per-device figures for one compiled step, in bytes.

  Attributes:
    argument: the inputs (state and batch).
    output: the outputs (new state and metrics).
    alias: output bytes that reuse donated input buffers.
    temp: temporaries (activations, gradients, communication buffers).
    generated_code: the compiled program itself.
  """
  argument: int
  output: int
  alias: int
  temp: int
  generated_code: int

  @property
  def peak(self) -> int:
    """Live bytes at the worst moment, as XLA bounds it: args + outputs - aliased + temps."""
    return self.argument + self.output - self.alias + self.temp

  def __str__(self) -> str:
    return ", ".join(f"{k} {format_bytes(v)}" for k, v in
                     [*self._asdict().items(), ("peak", self.peak)])


def compiled_memory(step, params, batch, *, model_state=None, rng=None) -> CompiledMemory:
  """XLA's memory analysis of ``step`` compiled for these shapes; nothing runs.

  Example:
    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3),
    ...                                   mesh=jax.make_mesh((8,), ("data",)))
    >>> shapes = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    >>> batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
    >>> zj.compiled_memory(step, shapes, batch).peak > 0
    True

  Args:
    step: a `ShardedTrainStep` from `make_sharded_train_step`.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``s).
    batch: a global batch (arrays or ``jax.ShapeDtypeStruct``s).
    model_state: as for ``step.init``.
    rng: as for ``step.init``.

  Returns:
    A `CompiledMemory` (per device).
  """
  state = step.abstract_state(params, model_state=model_state, rng=rng)
  batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), batch)
  stats = step.lower(state, batch).compile().memory_analysis()
  if stats is None:
    raise RuntimeError("this backend gives no memory analysis for compiled programs.")
  return CompiledMemory(
      argument=int(stats.argument_size_in_bytes), output=int(stats.output_size_in_bytes),
      alias=int(stats.alias_size_in_bytes), temp=int(stats.temp_size_in_bytes),
      generated_code=int(stats.generated_code_size_in_bytes))
