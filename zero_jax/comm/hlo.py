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
_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_SHAPE = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_DT_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s8": 1, "u8": 1,
             "pred": 1, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
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
  return sum(_DT_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dt, dims in _SHAPE.findall(shape_text))


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
  comps, cur = {}, None
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
