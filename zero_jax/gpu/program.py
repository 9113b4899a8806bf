"""What a program does, read from its HLO text: loops, matmuls, memory-bound kernels, collectives.

`analyze` walks any HLO module (a zero_jax step, a GSPMD program, anything ``jax.jit``
compiles): its loops with their trip counts, and for each loop's iteration the matmuls
(flops and bytes), the bytes every other kernel reads and writes (elementwise work,
reductions, copies, slices: what `zero_jax.gpu.predict` times at HBM bandwidth) and the
collectives with their bytes and device groups. `kernel_bytes` is that count for one
instruction.

Memory-bound kernels are counted where XLA has fused the program (a compiled program's text:
each fusion is one kernel that reads its operands and writes its result once). In a lowered,
unfused program (``lowered.as_text(dialect="hlo")``) every elementwise op would count as a
kernel of its own, and code outside a ``shard_map`` in global shapes: there they are left out
unless ``elementwise=True``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from zero_jax.gpu import program
  >>> f = jax.jit(lambda w, x: jnp.tanh(x @ w) * 2.0)
  >>> text = f.lower(jnp.ones((256, 256)), jnp.ones((64, 256))).compile().as_text()
  >>> p = program.analyze(text)
  >>> p.flops, p.elementwise_bytes >= 2 * 64 * 256 * 4   # tanh(.) * 2 reads and writes (64, 256)
  (8388608.0, True)
"""

from __future__ import annotations

import re
import warnings
from typing import NamedTuple

from zero_jax.comm import hlo
from zero_jax.comm.hlo import _nbytes, replica_groups  # pylint: disable=protected-access
from zero_jax.gpu import schedule

_COLLECTIVES = schedule.COLLECTIVES
_REDUCERS = ("reduce", "reduce-window", "scatter", "sort", "map", "select-and-scatter")  # to_apply
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)", re.M)
# Instructions that move no data of their own (views, bookkeeping, control flow whose callees
# are walked, the two halves of async pairs, annotations).
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "reshape", "broadcast",
    "iota", "after-all", "partition-id", "replica-id", "opt-barrier", "optimization-barrier",
    "while", "conditional", "call", "add-dependency", "domain", "get-dimension-size",
    "copy-start", "copy-done", "send", "send-done", "recv", "recv-done", "async-start",
    "async-update", "async-done", "rng-get-and-update-state"})
_ANNOTATIONS = ("Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "xla.sdy.",
                "annotate_device_placement", "MoveToHost", "MoveToDevice")
_SLICING = ("slice", "dynamic-slice", "gather")
_VIEWS = ("bitcast", "reshape")


class Transfer(NamedTuple):
  """One collective: ``op``, its result's bytes per device and its device groups."""
  op: str
  nbytes: float
  groups: tuple


class Loop(NamedTuple):
  """A loop of the program (the whole program is a loop with one trip).

  Attributes:
    name: the loop body's computation name.
    trips: iterations per run.
    dots: ``(flops, bytes read and written)`` of each matmul of one iteration (not of the
      loops nested in it).
    transfers: the collectives of one iteration (not of nested loops), in program order.
    loops: the loops nested in it.
    elementwise_bytes: bytes the other kernels of one iteration read and write (fusions
      without a matmul, copies, reductions, slices; not nested loops): see `kernel_bytes`.
    layers: the layers an iteration runs: ``k`` where the body is ``k`` calls of one
      computation that hold all its matmuls and collectives (a scan unrolled ``k`` times, as
      `zero_jax.scan`'s prefetching loops run two layers an iteration), else 1.
  """
  name: str
  trips: int
  dots: tuple
  transfers: tuple
  loops: tuple
  elementwise_bytes: float = 0.0
  layers: int = 1

  @property
  def flops(self) -> float:
    """Matmul flops of one iteration, without nested loops."""
    return float(sum(f for f, _ in self.dots))

  def total_flops(self) -> float:
    """Matmul flops of all its iterations, nested loops included (per device)."""
    return self.trips * (self.flops + sum(l.total_flops() for l in self.loops))

  def total_elementwise_bytes(self) -> float:
    """`elementwise_bytes` of all its iterations, nested loops included (per device)."""
    return self.trips * (self.elementwise_bytes
                         + sum(l.total_elementwise_bytes() for l in self.loops))


def _trips(comps: dict, ins: hlo.Instruction) -> int:
  """A loop's trip count: XLA's ``known_trip_count``, else a ``counter < constant`` condition."""
  m = hlo._TRIPS.search(ins.line)  # pylint: disable=protected-access
  if m:
    return int(m.group(1))
  cond = re.search(r"condition=%?([\w.\-]+)", ins.line)
  consts: dict = {}
  for c in map(hlo.parse_instruction, comps.get(cond.group(1) if cond else "", [])):
    if c and c.op == "constant":
      consts[c.name] = c.operands[0] if c.operands else ""
    elif c and c.op == "compare" and "direction=LT" in c.line:
      bound = [consts[o] for o in c.operands if o in consts]
      if bound and bound[0].lstrip("-").isdigit():
        return int(bound[0])
  warnings.warn(f"overlap.analyze: the trip count of the loop {ins.name} is not in the program "
                f"(neither known_trip_count nor a `counter < constant` condition); it is "
                f"counted once per run.", stacklevel=4)
  return 1


def _fused_bytes(comps: dict, ins: hlo.Instruction, shapes: dict) -> float:
  """Bytes a fusion reads and writes: each operand once, or only the part its slicing users
  take (a layer of a stacked weight, rows of a table), and the result, or only the update of
  an in-place ``dynamic-update-slice`` root."""
  body = [i for i in map(hlo.parse_instruction, comps.get(ins.called[0], [])) if i]
  users: dict = {}
  for i in body:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  sizes = {i.name: _nbytes(i.shape_text) for i in body}
  total = 0.0
  for i in body:
    m = re.search(r"parameter\((\d+)\)", i.line) if i.op == "parameter" else None
    if not m or int(m.group(1)) >= len(ins.operands):
      continue
    uses = _through_views(i.name, users) or [(i.name, u) for u in users.get(i.name, [])]
    if uses and all(u.op in _SLICING and u.operands[0] == v for v, u in uses):
      total += sum(sizes[u.name] for _, u in uses)
    elif uses and all(u.op == "dynamic-update-slice" and u.operands[0] == v for v, u in uses):
      continue  # updated in place: only the update is written (below)
    else:
      total += shapes.get(ins.operands[int(m.group(1))], ((), sizes[i.name]))[1]
  root = next((i for i in body if i.line.lstrip().startswith("ROOT")), None)
  if root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
    return total + sizes.get(root.operands[1], 0)
  return total + _nbytes(ins.shape_text)


def _through_views(name: str, users: dict) -> list:
  """``(operand name, user)`` of every use of ``name`` past views of it (bitcasts and
  reshapes, which move nothing inside a fusion): a parameter seen through a bitcast and
  sliced is read only where sliced, and a buffer seen through one and updated in place is
  not read. Empty if no view lies between."""
  out, views = [], False
  todo = [name]
  while todo:
    v = todo.pop()
    for u in users.get(v, []):
      if u.op in _VIEWS and u.operands[0] == v:
        views = True
        todo.append(u.name)
      else:
        out.append((v, u))
  return out if views else []


def kernel_bytes(comps: dict, ins: hlo.Instruction, shapes: dict) -> float:
  """Bytes one instruction reads from and writes to memory as a kernel of its own.

  A fusion: `_fused_bytes`. A slice, dynamic slice or gather reads what it returns; a
  dynamic-update-slice reads and writes its update. Any other op (``add``, ``copy``,
  ``transpose``, ``reduce``, a custom call that is not a matmul): its operands and its result.
  Views, control flow, collectives and annotations: 0. ``shapes`` maps the computation's
  instruction names to ``(shape, bytes)``.
  """
  if ins.op in _FREE or ins.op in _COLLECTIVES or ins.op.endswith(("-start", "-done")):
    return 0.0
  if ins.op == "custom-call" and any(t in ins.line for t in _ANNOTATIONS):
    return 0.0
  if ins.op == "fusion" and ins.called:
    return _fused_bytes(comps, ins, shapes)
  if ins.op in _SLICING:
    return 2.0 * _nbytes(ins.shape_text)
  if ins.op == "dynamic-update-slice" and len(ins.operands) > 1:
    return 2.0 * shapes.get(ins.operands[1], ((), 0))[1]
  return float(_nbytes(ins.shape_text) + sum(shapes.get(o, ((), 0))[1] for o in ins.operands))


class _Acc(NamedTuple):
  dots: list
  transfers: list
  loops: list
  memory: list  # one float: elementwise bytes


def _walk(comps: dict, name: str, acc: _Acc, n_devices: int | None, kernels: bool) -> None:
  """Adds what computation ``name`` does (and what it calls) to ``acc``; loops nest. With
  ``kernels``, each instruction outside a fusion adds its `kernel_bytes`."""
  shapes: dict = {}
  instrs = [i for i in map(hlo.parse_instruction, comps.get(name, [])) if i]
  # An async collective's start is typed (operands, results): its done holds the result.
  results = {i.operands[0]: i.shape_text for i in instrs if i.op.endswith("-done") and i.operands}
  for ins in instrs:
    arrays = hlo.shapes_in(ins.shape_text)
    if len(arrays) == 1 and not ins.shape_text.startswith("("):
      shapes[ins.name] = (arrays[0], _nbytes(ins.shape_text))
    base = re.sub(r"-(start|done)$", "", ins.op)
    body = re.search(r"\bbody=%?([\w.\-]+)", ins.line)
    branches = hlo._BRANCHES.search(ins.line)  # pylint: disable=protected-access
    if ins.op == "dot" or schedule._is_gemm_call(ins):  # pylint: disable=protected-access
      acc.dots.append(schedule.dot_cost(ins, shapes))
    elif base in _COLLECTIVES and not ins.op.endswith("-done"):
      groups = replica_groups(ins.line) or ([tuple(range(n_devices))] if n_devices else None)
      if groups is None:
        raise ValueError(f"{ins.name}: an {ins.op} over all devices; pass n_devices=")
      result = results.get(ins.name, ins.shape_text)
      acc.transfers.append(Transfer(base, float(_nbytes(result)), tuple(groups)))
    elif ins.op == "while" and body:
      inner = _Acc([], [], [], [0.0])
      _walk(comps, body.group(1), inner, n_devices, kernels)
      acc.loops.append(Loop(body.group(1), _trips(comps, ins), tuple(inner.dots),
                            tuple(inner.transfers), tuple(inner.loops), inner.memory[0],
                            _layers(comps, body.group(1), inner, n_devices)))
    elif branches:
      _most_expensive_branch(comps, branches.group(1), acc, n_devices, kernels)
    elif ins.op == "fusion":
      matmuls = len(acc.dots)
      for called in ins.called:
        _walk(comps, called, acc, n_devices, False)
      if kernels and len(acc.dots) == matmuls:  # a matmul fusion's bytes are its matmul's
        acc.memory[0] += kernel_bytes(comps, ins, shapes)
    else:
      if kernels:
        acc.memory[0] += kernel_bytes(comps, ins, shapes)
      if ins.op not in _REDUCERS:
        for called in ins.called:
          _walk(comps, called, acc, n_devices, kernels)


def _layers(comps: dict, body: str, whole: _Acc, n_devices) -> int:
  """Layers an iteration of loop ``body`` runs (`Loop.layers`): ``k`` when the body calls one
  computation ``k >= 2`` times and those calls hold all of its matmuls and collectives (JAX
  lowers a scan unrolled ``k`` times so, until XLA inlines the calls), else 1."""
  calls: dict = {}
  for ins in map(hlo.parse_instruction, comps.get(body, [])):
    if ins and ins.op == "call" and ins.called:
      calls[ins.called[0]] = calls.get(ins.called[0], 0) + 1
  for target, k in sorted(calls.items(), key=lambda kv: -kv[1]):
    if k < 2:
      break
    one = _Acc([], [], [], [0.0])
    _walk(comps, target, one, n_devices, False)
    if (one.dots or one.transfers) and (k * len(one.dots), k * len(one.transfers)) == (
        len(whole.dots), len(whole.transfers)):
      return k
  return 1


def _most_expensive_branch(comps: dict, names: str, acc: _Acc, n_devices, kernels) -> None:
  """A conditional: adds the branch with the most matmul flops (then collective bytes)."""
  options = []
  for b in names.split(","):
    one = _Acc([], [], [], [0.0])
    _walk(comps, b.strip().lstrip("%"), one, n_devices, kernels)
    options.append(one)
  best = max(options, key=lambda a: (sum(f for f, _ in a.dots),
                                     sum(t.nbytes for t in a.transfers), a.memory[0]))
  for field, more in zip(acc[:3], best[:3]):
    field.extend(more)
  acc.memory[0] += best.memory[0]


def analyze(hlo_text: str, *, n_devices: int | None = None,
            elementwise: bool | None = None) -> Loop:
  """The program's loops, matmuls, memory-bound kernels and collectives (see `Loop`).

  Args:
    hlo_text: an HLO module's text: ``compiled.as_text()`` (any backend; XLA:GPU's
      compile-only programs included) or ``lowered.as_text(dialect="hlo")`` (the dtypes
      as written, before XLA's passes; then pass ``elementwise=False``).
    n_devices: the number of devices, needed only for collectives printed without
      device groups.
    elementwise: count the bytes of the kernels that are not matmuls (`kernel_bytes`).
      Default: where the program is fused (it holds ``fusion`` instructions: a compiled
      program), not in a lowered one.

  Returns:
    A `Loop` with one trip whose ``loops`` are the program's top-level loops (e.g. the
    forward and backward layer scans).
  """
  entry = _ENTRY.search(hlo_text)
  if entry is None:
    raise ValueError("no ENTRY computation in this text: pass a whole HLO module's text, "
                     "e.g. step.lower(state, batch).compile().as_text()")
  comps = hlo._computations(hlo_text)  # pylint: disable=protected-access
  if elementwise is None:
    elementwise = re.search(r"\sfusion\(", hlo_text) is not None
  acc = _Acc([], [], [], [0.0])
  _walk(comps, entry.group(1), acc, n_devices, elementwise)
  return Loop(entry.group(1), 1, tuple(acc.dots), tuple(acc.transfers), tuple(acc.loops),
              acc.memory[0])


# XLA's combiners merge collectives of one kind (same op, same device groups) into one up to
# this many bytes: kDefaultAllGatherCombineThreshold, ...ReduceScatter..., ...AllReduce...
# (openxla/xla xla/service/collective_utils.h, the GPU compiler's defaults).
COMBINE_THRESHOLD = 30 * 2**20 + 7


def combined(program: Loop, threshold: float = COMBINE_THRESHOLD) -> Loop:
  """``program`` with each loop's collectives merged as XLA's combiners merge them.

  A lowered program (``lowered.as_text(dialect="hlo")``) issues one collective per leaf
  (every bias, every layer norm); XLA:GPU's compiled program combines those of one kind (same
  op, same device groups) into one collective of their summed bytes, up to ``threshold``
  bytes, so it pays one ring's latency where the lowered program pays many. Within each loop
  (iteration), in program order, a collective joins the last combined one of its kind while
  the sum stays within ``threshold``, else starts the next (one larger than ``threshold``
  stays alone). XLA also needs the collectives to be independent, which this does not check:
  it is the estimate of a program before XLA has seen it.

  Example:
    >>> t = lambda op, mib: Transfer(op, mib * 2**20, ((0, 1, 2, 3),))
    >>> p = Loop("main", 1, (), (t("all-gather", 20), t("all-gather", 8), t("all-gather", 8),
    ...                          t("reduce-scatter", 1), t("reduce-scatter", 1)), ())
    >>> [(x.op, x.nbytes / 2**20) for x in combined(p).transfers]
    [('all-gather', 28.0), ('all-gather', 8.0), ('reduce-scatter', 2.0)]
  """
  bins: list = []
  for t in program.transfers:
    last = next((i for i in range(len(bins) - 1, -1, -1)
                 if (bins[i].op, bins[i].groups) == (t.op, t.groups)), None)
    if last is not None and bins[last].nbytes + t.nbytes <= threshold:
      bins[last] = bins[last]._replace(nbytes=bins[last].nbytes + t.nbytes)
    else:
      bins.append(t)
  return program._replace(transfers=tuple(bins),
                          loops=tuple(combined(l, threshold) for l in program.loops))
