"""Per-device memory of a ZeRO step, from shapes alone, before training.

`memory_report` answers "will this fit, and which stage do I need?" for a
parameter tree, an optimizer, a number of devices and a precision policy. It
needs only shapes and dtypes (``jax.ShapeDtypeStruct``s or
``jax.eval_shape(model.init, ...)``), allocates nothing and takes
milliseconds even for billions of parameters. Every sharded leaf is counted
with the `zero_jax.layout` the step uses, so the padding of uneven leaves
(vocabularies like 50257, biases, scalars) is included exactly: the figures
equal the bytes of one device's shards of a real `TrainState`.

What is counted, per device (stage 0 is plain data parallelism):

| part            | stage 0 | stage 1 | stage 2 | stage 3 |
|-----------------|---------|---------|---------|---------|
| params          | full    | full    | full    | 1/N     |
| gradients       | full    | full    | 1/N     | 1/N     |
| optimizer state | full    | 1/N     | 1/N     | 1/N     |
| master copy     | full    | 1/N     | 1/N     | 1/N     |

Parameters are counted in the policy's parameter dtype (under ``"fp32"``,
and for frozen and non-float leaves, in their own dtype); the optimizer state
as ``jax.eval_shape(optimizer.init, params)`` gives it, with the parameters in
float32 under the mixed-precision policies; the master copy (``"bf16"`` and
``"fp16"`` policies) in float32; gradients in the dtype they are reduced in
(``comm_dtype``, by default the parameter dtype).
Gradients live only during a step, and the backward pass, activations and
communication buffers add temporaries that depend on the model and batch:
for those ask XLA with `compiled_memory`, which reads
``step.lower(...).compile().memory_analysis()`` for the real program.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> params = {"emb": jax.ShapeDtypeStruct((50257, 768), jnp.float32)}
  >>> report = zj.memory_report(params, optax.adam(1e-3), n_devices=8, precision="bf16")
  >>> report[2].optimizer_state      # Adam's moments split 8 ways along 768, and its count
  38597380
  >>> print(report)                  # a Markdown table, one row per stage
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero_jax.layout import leaf_layout, local_storage_shape
from zero_jax.precision import get_policy
from zero_jax.train_step import stacked_flags, trainable_flags

STAGE_NAMES = {0: "DP (replicated)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


class StageMemory(NamedTuple):
  """Bytes one device holds at one ZeRO stage.

  Attributes:
    stage: 0 (plain data parallelism), 1, 2 or 3.
    params: the parameters the loss sees.
    gradients: the reduced gradient the update reads.
    optimizer_state: the optax state.
    master: the float32 master copy (0 when the policy keeps none).
  """
  stage: int
  params: int
  gradients: int
  optimizer_state: int
  master: int

  @property
  def total(self) -> int:
    return self.params + self.gradients + self.optimizer_state + self.master


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
  """
  n_devices: int
  precision: str
  n_params: int
  n_trainable: int
  rows: tuple[StageMemory, ...]

  def __getitem__(self, stage: int) -> StageMemory:
    for row in self.rows:
      if row.stage == stage:
        return row
    raise KeyError(f"stage {stage} is not in this report, which has stages "
                   f"{[r.stage for r in self.rows]}; pass stages=(..., {stage}) to "
                   f"memory_report.")

  def to_markdown(self) -> str:
    """The report as a Markdown table with a one-line caption."""
    base = self[0].total if any(r.stage == 0 for r in self.rows) else None
    lines = [f"Per-device memory: {self.n_params:,} parameters ({self.n_trainable:,} "
             f"trainable), {self.n_devices} devices, precision {self.precision}.", "",
             "| stage | params | gradients | optimizer state | master copy | total |"
             + (" vs DP |" if base else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if base else "")]
    for r in self.rows:
      cells = [STAGE_NAMES[r.stage], *(format_bytes(b) for b in
               (r.params, r.gradients, r.optimizer_state, r.master, r.total))]
      if base:
        cells.append(f"{r.total / base:.2f}x")
      lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.to_markdown()

  def _repr_markdown_(self) -> str:  # rendered as a table in Jupyter
    return self.to_markdown()

  def as_dict(self) -> dict:
    """``{stage: {"params": ..., "gradients": ..., ..., "total": ...}}`` in bytes."""
    return {r.stage: {**r._asdict(), "total": r.total} for r in self.rows}


def _shape_dtype(path, x):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"params{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
                    f"array or jax.ShapeDtypeStruct; pass arrays, or shapes from "
                    f"jax.eval_shape(model.init, ...).")
  return tuple(int(d) for d in np.shape(x)), jnp.dtype(x.dtype)


def _is_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _full(shape, dtype) -> int:
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def _block(shape, dtype, n: int, stacked: bool = False) -> int:
  """Bytes of one device's block of the padded storage view (scalars: replicated)."""
  layout = leaf_layout(shape, n, stacked=stacked)
  return math.prod(local_storage_shape(layout, n)) * jnp.dtype(dtype).itemsize


def memory_report(params: Any, optimizer: optax.GradientTransformation, *, n_devices: int,
                  precision: str = "fp32", stages=(0, 1, 2, 3), trainable=None,
                  stacked=None, comm_dtype=None) -> MemoryReport:
  """Per-device bytes of params, gradients, optimizer state and master copy.

  Computed from shapes only, with the exact layouts (and padding) the step
  uses on ``n_devices`` devices; see the module docstring for what is counted.

  Example:
    >>> shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    >>> print(zj.memory_report(shapes, optax.adamw(3e-4), n_devices=8, precision="bf16"))

  Args:
    params: the parameter tree: arrays or ``jax.ShapeDtypeStruct``s.
    optimizer: the ``optax.GradientTransformation`` the step will use.
    n_devices: devices on the data axis.
    precision: the step's precision policy (``"fp32"``, ``"bf16"``, ``"fp16"``,
      ``"fp16_memory_efficient"``).
    stages: which rows to report; 0 is plain (replicated) data parallelism.
    trainable: as for `make_sharded_train_step`: ``None``, a pytree of bools
      (or a prefix) or a function ``(path, leaf) -> bool``.
    stacked: as for `make_sharded_train_step` (changes only the padding).
    comm_dtype: as for `make_sharded_train_step`; the dtype gradients are
      reduced in (default: the parameter dtype).

  Returns:
    A `MemoryReport`; ``print`` it for a table, index it by stage for numbers.
  """
  if not (isinstance(n_devices, (int, np.integer)) and n_devices >= 1):
    raise ValueError(f"n_devices must be a positive int, got {n_devices!r}.")
  bad = [s for s in stages if s not in STAGE_NAMES]
  if bad:
    raise ValueError(f"stages={tuple(stages)!r}: each stage must be 0 (plain data "
                     f"parallelism), 1, 2 or 3; got {bad}.")
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(f"optimizer must be an optax.GradientTransformation (e.g. "
                    f"optax.adamw(3e-4)); got {type(optimizer).__name__}.")
  n = int(n_devices)
  policy = get_policy(precision)
  paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  shapes = [_shape_dtype(p, x) for p, x in paths_leaves]
  structs = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, dt) for s, dt in shapes])
  flags = trainable_flags(trainable, structs)
  stacks = stacked_flags(stacked, structs)

  # What the step keeps: trainable leaves in the policy's dtype (under "fp32"
  # their own), frozen ones as given; the optimizer sees float32 under the
  # mixed-precision policies and each leaf's own dtype under "fp32".
  param_dt = [(policy.param_dtype or dt) if t else dt for (_, dt), t in zip(shapes, flags)]
  src_dt = [(jnp.dtype(jnp.float32) if policy.param_dtype is not None else dt) if t else dt
            for (_, dt), t in zip(shapes, flags)]
  grad_dt = jnp.dtype(comm_dtype) if comm_dtype is not None else None
  trained = [(s, grad_dt or pdt, st)
             for (s, _), pdt, t, st in zip(shapes, param_dt, flags, stacks) if t]
  src = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, dt)
                                     for (s, _), dt in zip(shapes, src_dt)])
  opt = optimizer if all(flags) else optax.masked(
      optimizer, jax.tree.unflatten(treedef, flags))
  opt_leaves = [(tuple(x.shape), x.dtype, False)
                for x in jax.tree.leaves(jax.eval_shape(opt.init, src))]
  masters = ([(s, policy.master_dtype, st) for s, _, st in trained]
             if policy.master_dtype else [])

  def total(items, sharded):  # items: (shape, dtype, stacked)
    return sum(_block(s, dt, n, st) if sharded else _full(s, dt) for s, dt, st in items)

  rows = []
  for stage in stages:
    rows.append(StageMemory(
        stage=stage,
        params=total([(s, dt, st) for (s, _), dt, st in zip(shapes, param_dt, stacks)],
                     stage >= 3),
        gradients=total(trained, stage >= 2),
        optimizer_state=total(opt_leaves, stage >= 1),
        master=total(masters, stage >= 1)))
  return MemoryReport(
      n_devices=n, precision=policy.name, n_params=sum(math.prod(s) for s, _ in shapes),
      n_trainable=sum(math.prod(s) for s, _, _ in trained), rows=tuple(rows))


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
    >>> shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    >>> batch = {"tokens": jax.ShapeDtypeStruct((64, 129), jnp.int32)}
    >>> print(zj.compiled_memory(step, shapes, batch))

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
