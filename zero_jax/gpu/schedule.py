"""What XLA:GPU scheduled inside each async collective's window.

XLA:GPU runs a collective asynchronously as a ``*-start`` / ``*-done`` pair; whatever the
schedule puts between the two runs while the collective moves data. `loops` reads a
compiled GPU program's text (``compiled.as_text()``, instructions in schedule order) and
lists, for each ``while`` loop's body (a layer scan, a micro-batch loop), every async
collective with the compute scheduled inside its window: matmul fusions, cuBLAS/cuDNN
custom calls, dots. A collective whose window holds no compute is exposed: the step waits
for it. `synchronous` lists the collectives that are not asynchronous at all. Matmul flops
are counted here from the operands' shapes (``compiled.cost_analysis()`` is None for
compile-only devices).

Example (needs JAX's CUDA plugin; no GPU):
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> from zero_jax.gpu import schedule
  >>> def loss_fn(p, b):
  ...   h, _ = zj.scan(lambda h, w: (jnp.tanh(h @ w), None), b, p["w"])
  ...   return jnp.mean(h ** 2)
  >>> mesh = zj.compile_only_mesh((8,), ("data",), gpu="h100")       # doctest: +SKIP
  >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
  ...                                   stacked=True)               # doctest: +SKIP
  >>> params = {"w": jax.ShapeDtypeStruct((6, 512, 512), jnp.float32)}
  >>> text = step.lower(step.abstract_state(params), jax.ShapeDtypeStruct((64, 512),
  ...                   jnp.float32)).compile().as_text()           # doctest: +SKIP
  >>> [[(w.op, w.overlapped) for w in l.windows] for l in schedule.loops(text)]  # doctest: +SKIP
  [[('all-gather', True)], [('reduce-scatter', True), ('all-gather', True)]]
"""

from __future__ import annotations

import json
import math
import re
from typing import NamedTuple

from zero_jax.comm import hlo
from zero_jax.comm.hlo import _nbytes, replica_groups  # pylint: disable=protected-access

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_MATMUL = frozenset({"dot", "convolution"})
_GEMM_TARGETS = ("gemm", "cublas", "cudnn", "matmul")


class Window(NamedTuple):
  """One async collective and what the schedule runs while it moves data.

  Attributes:
    op: ``"all-gather"``, ``"reduce-scatter"``, ``"all-reduce"``, ...
    name: its ``*-start`` instruction's name.
    shapes: the result's array shapes (per device).
    nbytes: the result's bytes per device.
    groups: the device groups it spans (as `zero_jax.comm.hlo.replica_groups`).
    compute: the names of the matmul instructions (fusions, custom calls, dots) scheduled
      between its start and its done.
    dots: ``(flops, bytes read and written)`` of each matmul in ``compute``.
    span: ``(start, done)``: the positions of its two halves in the computation's schedule
      (windows whose spans overlap are in flight together).
    dot_names: the instruction (of ``compute``) each of ``dots`` runs in.
  """
  op: str
  name: str
  shapes: list
  nbytes: int
  groups: list | None
  compute: tuple
  dots: tuple
  span: tuple = (0, 0)
  dot_names: tuple = ()

  @property
  def overlapped(self) -> bool:
    """Whether some compute runs inside its window."""
    return bool(self.compute)

  @property
  def flops(self) -> float:
    """Matmul flops (per device) scheduled inside its window."""
    return float(sum(f for f, _ in self.dots))


class LoopSchedule(NamedTuple):
  """One ``while`` loop's body as scheduled.

  Attributes:
    name: the ``while`` instruction's name.
    body: its body computation's name (`zero_jax.gpu.predict.Loop.name`).
    trip_count: iterations, when XLA knows them, else None.
    windows: its async collectives in schedule order (`Window`).
    dots: ``(flops, bytes)`` of every matmul of one iteration (nested loops excluded).
  """
  name: str
  body: str
  trip_count: int | None
  windows: tuple
  dots: tuple


def _dims(attr: str, line: str) -> list[int]:
  m = re.search(attr + r"=\{([\d,]*)\}", line)
  return [int(d) for d in m.group(1).split(",") if d] if m else []


def _contracting(ins: hlo.Instruction) -> list[int]:
  """The lhs contracting dimensions of a dot (its attribute) or a gemm custom call (its
  backend config)."""
  if ins.op == "dot":
    return _dims("lhs_contracting_dims", ins.line)
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.line)
  return [int(json.loads(d)) for d in m.group(1).split(",") if d.strip()] if m else []


def fmha_cost(ins: hlo.Instruction, shapes: dict) -> tuple[float, float]:
  """``(flops, bytes read and written)`` of a cuDNN fused attention call
  (``__cudnn$fmha...``, what ``jax.nn.dot_product_attention(..., implementation="cudnn")``
  compiles to): per score of its ``intermediate_tensor_shape`` ``[B, N, T, S]`` and head
  dimension ``H`` (the query's last), 2 matmuls of ``2 * H`` flops forward and 5 backward
  (scores recomputed, then dP, dV, dQ, dK: FlashAttention-2's count), half of them under a
  causal mask (the kernel skips the masked blocks); bytes: its operands and results once
  (the scores stay on chip)."""
  scores = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]',
                     ins.line)
  if scores is None or not ins.operands or ins.operands[0] not in shapes:
    raise ValueError(f"fused attention {ins.name}: cannot read its score shape or its query")
  n_scores = math.prod(int(json.loads(d)) for d in scores.group(1).split(","))
  head = shapes[ins.operands[0]][0][-1]
  matmuls = 5 if "backward" in ins.line.lower().split("custom_call_target=")[1][:60] else 2
  causal = re.search(r'"mask_type":\s*"CAUSAL"', ins.line) is not None
  flops = matmuls * 2.0 * n_scores * head * (0.5 if causal else 1.0)
  return flops, float(_nbytes(ins.shape_text) + sum(shapes[o][1] for o in ins.operands
                                                   if o in shapes))


def dot_cost(ins: hlo.Instruction, shapes: dict) -> tuple[float, float]:
  """``(flops, bytes read and written)`` of a ``dot`` (or gemm custom call, or cuDNN fused
  attention: `fmha_cost`) whose operands' ``(shape, bytes)`` are in ``shapes``."""
  if ins.op == "custom-call" and "$fmha" in ins.line:
    return fmha_cost(ins, shapes)
  if len(ins.operands) < 2 or not all(o in shapes for o in ins.operands[:2]):
    raise ValueError(f"dot {ins.name}: cannot find the shapes of its operands {ins.operands}")
  lhs, rhs = (shapes[o] for o in ins.operands[:2])
  out = hlo.shapes_in(ins.shape_text)[0]
  k = math.prod(lhs[0][d] for d in _contracting(ins))
  return 2.0 * math.prod(out) * k, float(_nbytes(ins.shape_text) + lhs[1] + rhs[1])


def _is_gemm_call(ins: hlo.Instruction) -> bool:
  target = re.search(r'custom_call_target="([^"]*)"', ins.line)
  return ins.op == "custom-call" and bool(target) and any(
      t in target.group(1).lower() for t in _GEMM_TARGETS)


def _shape_of(ins: hlo.Instruction, shapes: dict) -> None:
  arrays = hlo.shapes_in(ins.shape_text)
  if len(arrays) == 1 and not ins.shape_text.startswith("("):
    shapes[ins.name] = (arrays[0], _nbytes(ins.shape_text))
  elif ins.op == "parameter" and arrays:  # a tuple parameter: not a dot operand
    shapes.pop(ins.name, None)


def matmuls(comps: dict, name: str, seen: frozenset = frozenset()) -> list:
  """``(flops, bytes)`` of every matmul in computation ``name`` and the fusions and calls
  it makes (not the loops it runs: a ``while`` is a loop of its own)."""
  if name in seen or name not in comps:
    return []
  shapes: dict = {}
  out: list = []
  for ins in filter(None, map(hlo.parse_instruction, comps[name])):
    _shape_of(ins, shapes)
    if ins.op in _MATMUL or _is_gemm_call(ins):
      out.append(dot_cost(ins, shapes) if ins.op != "convolution" else (0.0, 0.0))
    elif ins.op not in ("while", "all-reduce", "all-reduce-start", "reduce-scatter",
                        "reduce-scatter-start", "reduce", "scatter", "sort", "map"):
      for called in ins.called:
        out += matmuls(comps, called, seen | {name})
  return out


def _window(comps: dict, instrs: list, shapes: dict, start: int, done: int) -> Window:
  ins = instrs[start]
  kind = re.sub(r"-start$", "", ins.op)
  if ins.op == "async-start":  # a wrapped collective: its op is in the called computation
    kind = next((o for c in ins.called for o in COLLECTIVES
                 if any(f" {o}(" in line for line in comps.get(c, []))), "async")
  result = instrs[done].shape_text if done < len(instrs) else ins.shape_text
  compute, dots, names = [], [], []
  for x in instrs[start + 1:done]:
    if x.op in _MATMUL or _is_gemm_call(x):
      found = [dot_cost(x, shapes) if x.op != "convolution" else (0.0, 0.0)]
    elif x.op in ("fusion", "call", "conditional"):
      found = [d for c in x.called for d in matmuls(comps, c)]
    else:  # a loop nested in the window: compute, counted as its own loop
      found = []
      contains = hlo._contains  # pylint: disable=protected-access
      if x.op == "while" and any(contains(comps, c, _MATMUL) for c in x.called):
        compute.append(x.name)
    if found:
      compute.append(x.name)
      dots += found
      names += [x.name] * len(found)
  return Window(kind, ins.name, hlo.shapes_in(result), _nbytes(result), replica_groups(ins.line),
                tuple(compute), tuple(dots), (start, done), tuple(names))


def in_flight_together(ws) -> list[list]:
  """``ws`` (one computation's windows, in schedule order) grouped by overlap: windows whose
  spans overlap, directly or through another, are one group (their collectives are in flight
  together and share the time of the compute in the union of their windows)."""
  groups: list = []
  end = -1
  for w in sorted(ws, key=lambda w: w.span):
    if groups and w.span[0] < end:
      groups[-1].append(w)
      end = max(end, w.span[1])
    else:
      groups.append([w])
      end = w.span[1]
  return groups


def windows(comps: dict, name: str) -> tuple:
  """The async collectives of computation ``name`` in schedule order, with their windows."""
  instrs = [i for i in map(hlo.parse_instruction, comps.get(name, [])) if i]
  shapes: dict = {}
  for ins in instrs:
    _shape_of(ins, shapes)
  out = []
  for k, ins in enumerate(instrs):
    base = re.sub(r"-start$", "", ins.op)
    if ins.op.endswith("-start") and (base in COLLECTIVES or base == "async"):
      done = next((j for j, x in enumerate(instrs) if x.op.endswith("-done")
                   and x.operands and x.operands[0] == ins.name), len(instrs))
      out.append(_window(comps, instrs, shapes, k, done))
  return tuple(out)


def loops(hlo_text: str) -> list[LoopSchedule]:
  """Every ``while`` loop of a compiled GPU program with its async collectives' windows.

  Args:
    hlo_text: ``compiled.as_text()`` of a program compiled for GPUs (compile-only devices
      from `zero_jax.compile_only_mesh`, or real ones). XLA:CPU's programs hold no async
      pairs: every list comes back empty.

  Returns:
    A `LoopSchedule` per ``while`` loop, in program text order.
  """
  comps = hlo._computations(hlo_text)  # pylint: disable=protected-access
  out = []
  for lines in comps.values():
    for ins in filter(None, map(hlo.parse_instruction, lines)):
      body = re.search(r"\bbody=%?([\w.\-]+)", ins.line)
      if ins.op == "while" and body:
        trips = hlo._TRIPS.search(ins.line)  # pylint: disable=protected-access
        out.append(LoopSchedule(ins.name, body.group(1), int(trips.group(1)) if trips else None,
                                windows(comps, body.group(1)),
                                tuple(matmuls(comps, body.group(1)))))
  return out


def synchronous(hlo_text: str) -> list[str]:
  """The collectives of a compiled GPU program that XLA did not make asynchronous (no
  start/done pair), one line each. XLA:GPU runs every collective it can as a pair."""
  return [f"{ins.op} {ins.name} {ins.shape_text}"
          for lines in hlo._computations(hlo_text).values()  # pylint: disable=protected-access
          for ins in filter(None, map(hlo.parse_instruction, lines)) if ins.op in COLLECTIVES]


def run_synchronously(hlo_text: str) -> list[str]:
  """The async pairs XLA:GPU marked ``"is_sync":true``: it found nothing to run inside
  their windows and runs them on the compute stream. One line each."""
  return [f"{ins.op} {ins.name} {ins.shape_text}"
          for lines in hlo._computations(hlo_text).values()  # pylint: disable=protected-access
          for ins in filter(None, map(hlo.parse_instruction, lines))
          if ins.op.endswith("-start") and '"is_sync":true' in ins.line]
