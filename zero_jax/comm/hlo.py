"""Reading the collectives out of a compiled step's HLO text.

``step.lower(state, batch).compile().as_text()`` is what XLA will run. Which
collectives it holds, their sizes, which devices each one spans (its replica
groups) and whether it sits inside a loop (the micro-batch or layer scan) are
how the tests and benchmarks check that a reduce-scatter stays within a host
or runs inside the backward loop.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> from zero_jax.comm.hlo import collectives
  >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1),
  ...                                   mesh=jax.make_mesh((8,), ("data",)))
  >>> state = step.init({"w": jnp.zeros((16, 4))})
  >>> batch = {"x": jnp.ones((32, 16)), "y": jnp.ones((32, 4))}
  >>> text = step.lower(state, batch).compile().as_text()
  >>> rs = [c for c in collectives(text) if c.op == "reduce-scatter"]
  >>> rs[0].shapes, rs[0].groups      # each device gets its (2, 4) block of the gradient
  ([(2, 4)], [(0, 1, 2, 3, 4, 5, 6, 7)])
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

_OP = re.compile(r"=\s*(.+?)\s+(all-reduce|reduce-scatter|all-gather|all-to-all|"
                 r"collective-permute)(?:-start)?\(")
_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")  # compiled or lowered
_CALLED = re.compile(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_SHAPE = re.compile(r"([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_DT_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
             "pred": 1, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
             "f8e4m3fn": 1, "f8e5m2": 1}
_GROUPS_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\]"
                          r"(?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}")


class Collective(NamedTuple):
  """One collective of a compiled program.

  Attributes:
    op: ``"all-reduce"``, ``"reduce-scatter"``, ``"all-gather"``, ...
    shape_text: its result type as printed (a tuple for combined collectives).
    shapes: the result's array shapes.
    nbytes: the result's bytes (per device).
    groups: the device groups it spans (tuples of device ids), or None.
    in_loop: whether it runs inside a ``while`` loop (or a computation one calls).
  """
  op: str
  shape_text: str
  shapes: list
  nbytes: int
  groups: list | None
  in_loop: bool


def shapes_in(shape_text: str) -> list[tuple[int, ...]]:
  """Every array shape in an HLO result type, e.g. '(f32[2,3]{1,0}, f32[])' -> [(2, 3), ()]."""
  return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _SHAPE.findall(shape_text)]


def _nbytes(shape_text: str) -> int:
  return int(sum(_DT_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                 for dt, dims in _SHAPE.findall(shape_text)))


def _mesh_groups(m) -> list:
  """Groups of the mesh form: ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}`` (without
  ``device_ids``, the devices in order)."""
  axes = [(n.strip().strip("'"), int(v)) for n, v in
          (a.split("=") for a in m.group(1).split(","))]
  dims = [int(d) for d in m.group(2).split(",")] if m.group(2) else [v for _, v in axes]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(d) for d in m.group(3).split(",")])
  ids = ids.reshape([v for _, v in axes])
  reduced = {a.strip().strip("'") for a in m.group(4).split(",")}
  order = [i for i, (n, _) in enumerate(axes) if n not in reduced] + \
          [i for i, (n, _) in enumerate(axes) if n in reduced]
  size = int(np.prod([v for n, v in axes if n in reduced]))
  return [tuple(int(d) for d in g) for g in ids.transpose(order).reshape(-1, size)]


def replica_groups(line: str) -> list | None:
  """The device groups of one HLO collective, as a list of tuples of device ids.

  Reads the forms XLA prints: ``{{0,1},{2,3}}``, the iota form ``[2,4]<=[8]`` /
  ``[4,2]<=[2,4]T(1,0)`` (iota over the second shape, transposed, reshaped to
  the first), and the mesh form ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0))
  {'a'}`` (devices on a mesh, grouped along the named axes).
  """
  m = _GROUPS_MESH.search(line)
  if m:
    return _mesh_groups(m)
  m = _GROUPS_EXPLICIT.search(line)
  if m:
    return [tuple(int(d) for d in g.split(",") if d)
            for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = _GROUPS_IOTA.search(line)
  if m:
    shape = [int(d) for d in m.group(1).split(",")]
    dims = [int(d) for d in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    return [tuple(int(d) for d in g) for g in ids.reshape(shape[0], -1)]
  return None


def _computations(hlo: str) -> dict:
  comps: dict = {}
  cur = None
  for line in hlo.splitlines():
    m = _HEAD.match(line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
    elif cur is not None:
      if line.strip() == "}":
        cur = None
      else:
        comps[cur].append(line)
  return comps


def _in_loops(comps: dict) -> set:
  """Names of the computations that a ``while`` runs (directly or through calls)."""
  todo = [c for lines in comps.values() for line in lines if " while(" in line
          for c in re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)]
  seen = set()
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    for line in comps[c]:
      todo += _CALLED.findall(line)
      for group in _BRANCHES.findall(line):
        todo += [x.strip().lstrip("%") for x in group.split(",")]
  return seen


def collectives(hlo: str) -> list[Collective]:
  """Every collective in compiled HLO text (see `Collective`)."""
  comps = _computations(hlo)
  loops = _in_loops(comps)
  out = []
  for name, lines in comps.items():
    for line in lines:
      m = _OP.search(line)
      if m:
        out.append(Collective(m.group(2), m.group(1), shapes_in(m.group(1)),
                              _nbytes(m.group(1)), replica_groups(line), name in loops))
  return out


def sent_bytes(c: Collective) -> float:
  """Bytes one device sends for ``c`` (ring reduce-scatter, all-gather and all-reduce; an
  all-to-all sends every chunk but its own), from its result's size and its group.

  >>> c = Collective("all-gather", "f32[8,4]", [(8, 4)], 128, [tuple(range(8))], False)
  >>> sent_bytes(c)      # 7 of the 8 blocks of 16 bytes
  112.0
  """
  g = len(c.groups[0]) if c.groups else 1
  if g <= 1:
    return 0.0
  if c.op == "reduce-scatter":
    return float((g - 1) * c.nbytes)
  if c.op == "all-reduce":
    return 2 * (g - 1) / g * c.nbytes
  if c.op in ("all-gather", "all-to-all"):
    return (g - 1) / g * c.nbytes
  return float(c.nbytes)


# ------------------------------------------------------------- loops, dataflow
_COMPUTE = frozenset({"dot", "convolution"})
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


class Instruction(NamedTuple):
  """One HLO instruction: its name, opcode, result type, operands and the computations
  it calls (a fusion's, a while's body and condition)."""
  name: str
  op: str
  shape_text: str
  operands: list
  called: list
  line: str


def _balanced(text: str, start: int) -> int:
  """Index just past the parenthesis group opening at ``text[start]``."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  return len(text)


def parse_instruction(line: str) -> Instruction | None:
  """``%x = f32[2]{0} add(%a, %b), ...`` -> an `Instruction` (None for other lines)."""
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
  if not m:
    return None
  rest = line[m.end():]
  end = _balanced(rest, 0) if rest.startswith("(") else rest.find(" ")
  shape_text, tail = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", tail)
  if not op:
    return None
  args = tail[op.end() - 1:_balanced(tail, op.end() - 1)]
  return Instruction(m.group(1), op.group(1), shape_text, _operand_names(args[1:-1]),
                     _CALLED.findall(tail), line)


def _operand_names(args: str) -> list:
  """``%a, %b`` (compiled), ``a, b`` (lowered) or ``f32[2]{0} %a, ...`` -> ``["a", "b"]``."""
  parts, depth, cur = [], 0, ""
  for ch in args:
    depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(cur)
      cur = ""
    else:
      cur += ch
  return [p.split()[-1].lstrip("%") for p in parts + [cur] if p.strip()]


class LoopCollective(NamedTuple):
  """A collective in a loop body, and how it meets this iteration's compute.

  Attributes:
    op: its opcode (``all-gather``, ``reduce-scatter``, ...; async pairs as one).
    shapes: its result's array shapes.
    operand_from_compute: whether its operand depends on a ``dot`` or
      ``convolution`` of the same iteration (False: it reads what earlier
      iterations carried in).
    used_by_compute: whether a ``dot`` or ``convolution`` of the same iteration
      reads its result.
    carried_to: the loop tuple indices its result reaches only moved (sliced,
      copied, bitcast): what it hands the next iteration as it is.
    groups: the device groups it spans (as `Collective.groups`).
  """
  op: str
  shapes: list
  operand_from_compute: bool
  used_by_compute: bool
  carried_to: list
  groups: list | None = None


class Loop(NamedTuple):
  """One ``while`` loop of a compiled program (see `loops`).

  Attributes:
    name: the ``while`` instruction's name.
    trip_count: its iteration count when XLA knows it, else None.
    carried: the shapes of its loop tuple, in order.
    collectives: the collectives of its body (`LoopCollective`).
  """
  name: str
  trip_count: int | None
  carried: list
  collectives: list


def _contains(comps: dict, name: str, ops: frozenset, seen=None) -> bool:
  """Whether computation ``name`` (or one it calls) holds an instruction with an op in ``ops``."""
  seen = set() if seen is None else seen
  if name in seen or name not in comps:
    return False
  seen.add(name)
  for line in comps[name]:
    ins = parse_instruction(line)
    if ins and (ins.op in ops or any(_contains(comps, c, ops, seen) for c in ins.called)):
      return True
  return False


def _closure(start, edges: dict) -> set:
  todo, seen = list(start), set()
  while todo:
    x = todo.pop()
    if x not in seen:
      seen.add(x)
      todo += edges.get(x, [])
  return seen


def _moves(instrs: dict, name: str) -> bool:
  """Whether an instruction only moves one array (a slice, copy, bitcast, tuple element):
  it has at most one operand that is not a scalar."""
  arrays = [o for o in instrs[name].operands
            if o in instrs and shapes_in(instrs[o].shape_text) not in ([()], [])]
  return instrs[name].op == "tuple" or len(arrays) <= 1


def _loop(comps: dict, ins: Instruction) -> Loop:
  body = re.search(r"body=%?([\w.\-]+)", ins.line)
  instrs = {i.name: i for i in map(parse_instruction, comps.get(body.group(1) if body else "", []))
            if i}
  users: dict = {}
  for i in instrs.values():
    for o in i.operands:
      users.setdefault(o, []).append(i.name)
  compute = {n for n, i in instrs.items() if i.op in _COMPUTE or any(
      _contains(comps, c, _COMPUTE) for c in i.called)}
  root = next((i for i in instrs.values() if i.line.lstrip().startswith("ROOT")), None)
  out = []
  for name, i in instrs.items():
    kind = re.sub(r"-(start|done)$", "", i.op)
    if kind not in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                    "collective-permute") or i.op.endswith("-done"):
      continue
    before = _closure(i.operands, {n: x.operands for n, x in instrs.items()})
    after = _closure(users.get(name, []), users)
    passed = _closure([name], {n: [u for u in us if _moves(instrs, u)] for n, us in users.items()})
    carried = [k for k, o in enumerate(root.operands) if o in passed] if root else []
    out.append(LoopCollective(kind, shapes_in(i.shape_text), bool(before & compute),
                              bool(after & compute), carried, replica_groups(i.line)))
  trips = _TRIPS.search(ins.line)
  return Loop(ins.name, int(trips.group(1)) if trips else None, shapes_in(ins.shape_text), out)


def loops(hlo: str) -> list[Loop]:
  """Every ``while`` loop of compiled HLO text, with its collectives' dataflow.

  This is how a schedule is checked where it cannot be timed (XLA:CPU runs
  collectives synchronously): a prefetching layer loop (`zero_jax.scan`, two
  layers an iteration) carries its second layer's all-gather result to the
  next iteration without using it (``used_by_compute`` False, ``carried_to``
  not empty; it waits for the first layer's results: ``operand_from_compute``)
  and hands the first layer's to the second, and a delayed reduce-scatter reads
  a gradient the previous iteration carried in (``operand_from_compute``
  False).

  Example:
    >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> from zero_jax.comm.hlo import loops
    >>> def loss_fn(p, b):
    ...   h, _ = zj.scan(lambda h, w: (jnp.tanh(h @ w), None), b["x"], p["w"])
    ...   return jnp.mean(h ** 2)
    >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), stage=3, stacked=True,
    ...                                   mesh=jax.make_mesh((8,), ("data",)))
    >>> state = step.init({"w": jnp.ones((6, 16, 16)) / 16})
    >>> text = step.lower(state, {"x": jnp.ones((8, 16))}).compile().as_text()
    >>> [(l.trip_count, [(c.op, c.used_by_compute, c.operand_from_compute)
    ...                  for c in l.collectives]) for l in loops(text)]  # doctest: +NORMALIZE_WHITESPACE
    [(2, [('all-gather', True, False), ('all-gather', False, True)]),
     (2, [('reduce-scatter', False, False), ('reduce-scatter', False, False),
          ('all-gather', True, False), ('all-gather', False, True)])]
  """
  comps = _computations(hlo)
  return [_loop(comps, i) for lines in comps.values() for i in map(parse_instruction, lines)
          if i and i.op == "while"]
