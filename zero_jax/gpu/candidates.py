"""The planner's search space, and the memory formulas that prune it before anything compiles.

`search_space` lists the `make_sharded_train_step` options worth trying on ``hosts x per_host``
GPUs: ZeRO stages 2 and 3 (stage 1 is kept only when the user fixes it: it all-reduces whole
gradients, so stage 2 holds less and sends less), hybrid sharding (the state split within a
host, replicated across hosts), hpZ, ZeRO++ int8 weights with int8 or int4 gradients,
``gather_once``, and `zero_jax.scan`'s ``prefetch`` 0 and 1 when the loss takes a ``prefetch``
keyword. Options the user passes to `zero_jax.plan` are not searched. Offload and micro-batches
(``grad_accum_steps``) are fallbacks: `fallbacks` adds them to a candidate that does not fit.

`lower_bound` is the state a candidate holds on each device by `zero_jax.memory_report`'s
formulas (parameters, gradients, optimizer state, master copy, prefetch buffers): every
compiled program holds at least that, so a candidate whose bound exceeds the memory is dropped
without compiling it.

Example:
  >>> from zero_jax.gpu import candidates
  >>> space = candidates.search_space({}, hosts=2, per_host=8, takes_prefetch=False)
  >>> len(space), candidates.describe(space[0])
  (21, 'ZeRO-2 flat')
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import jax

from zero_jax.comm.collectives import Quantize
from zero_jax.step.memory import memory_report

HOSTS, DATA = "hosts", "data"  # the axis names of the meshes the planner compiles on

# ZeRO++ choices: none, int8 weights and gradients (qwZ + qgZ), int8 weights with int4 grads.
QUANTIZE = (None, Quantize(weights=True, grads=True, grad_bits=8),
            Quantize(weights=True, grads=True, grad_bits=4))
SEARCHED = ("stage", "axis_name", "replica_axis", "hpz_axis", "quantize", "gather_once",
            "offload", "grad_accum_steps")


def takes_prefetch(loss_fn) -> bool:
  """Whether ``loss_fn`` takes a ``prefetch`` keyword (`zero_jax.scan`'s, which the planner
  then searches and passes)."""
  try:
    params = inspect.signature(loss_fn).parameters
  except (TypeError, ValueError):
    return False
  p = params.get("prefetch")
  return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


def layouts(hosts: int) -> list[dict]:
  """How the devices split the state: over every device (``flat``), or hybrid."""
  if hosts == 1:
    return [{"axis_name": DATA}]
  return [{"axis_name": (HOSTS, DATA)}, {"axis_name": DATA, "replica_axis": HOSTS}]


def mesh_shape(hosts: int, per_host: int) -> tuple[tuple, tuple]:
  """``(shape, axis names)`` of the compile-only mesh: hosts first, then the GPUs of one."""
  return ((hosts, per_host), (HOSTS, DATA)) if hosts > 1 else ((per_host,), (DATA,))


def search_space(fixed: dict, *, hosts: int, per_host: int, takes_prefetch: bool) -> list[dict]:
  """Every combination of the searched options, less those the user fixed (``fixed`` wins).

  Each entry is a dict of `make_sharded_train_step` options (no mesh) plus ``"prefetch"``
  (None when the loss takes none). Combinations `make_sharded_train_step` would refuse are
  left to `zero_jax.plan` to drop (it builds each step).
  """
  stages = (fixed["stage"],) if "stage" in fixed else (2, 3)
  lays = [{}] if {"axis_name", "replica_axis"} & set(fixed) else layouts(hosts)
  quants = (fixed["quantize"],) if "quantize" in fixed else QUANTIZE
  prefetches = (1,) if takes_prefetch else (None,)  # 0: a memory fallback (`fallbacks`)
  out = []
  for stage, lay, q, pre in itertools.product(stages, lays, quants, prefetches):
    hpzs = [fixed.get("hpz_axis")]
    if "hpz_axis" not in fixed and stage == 3 and lay.get("axis_name") == (HOSTS, DATA):
      hpzs.append(DATA)
    onces = [fixed.get("gather_once", False)]
    if "gather_once" not in fixed and stage == 3:
      onces.append(True)
    for hpz, once in itertools.product(hpzs, onces):
      if hpz and once:
        continue
      if q is not None and stage == 1:
        q = q._replace(grads=False)
      opts = {"stage": stage, **lay, "quantize": q, "prefetch": pre}
      opts.update({k: v for k, v in (("hpz_axis", hpz), ("gather_once", once)) if v})
      if opts not in out:
        out.append(opts)
  return out


def fallbacks(opts: dict, rows_per_device: int, fixed: dict, take_prefetch: bool) -> list[dict]:
  """Options that hold less than ``opts``: prefetch 0, then micro-batches (2, 4, ... while
  they divide each device's rows), then offload of the optimizer state."""
  out = []
  if take_prefetch and opts.get("prefetch") == 1:
    out.append({**opts, "prefetch": 0})
  if "grad_accum_steps" not in fixed:
    k = opts.get("grad_accum_steps", 1) * 2
    if rows_per_device % k == 0 and k <= rows_per_device:
      out.append({**opts, "grad_accum_steps": k})
  if "offload" not in fixed and not opts.get("offload"):
    out.append({**opts, "offload": "optimizer"})
  return out


def describe(opts: dict) -> str:
  """A short name for a candidate's options, for tables: ``'ZeRO-3 hybrid int8 prefetch 1'``."""
  parts = [f"ZeRO-{opts['stage']}"]
  parts.append("hybrid" if opts.get("replica_axis") else
               "flat" if opts.get("axis_name") in ((HOSTS, DATA), DATA) else "")
  if opts.get("hpz_axis"):
    parts.append("hpZ")
  q = opts.get("quantize")
  if q is not None:
    parts.append("qwZ" * q.weights + ("+" if q.weights and q.grads else "")
                 + (f"qgZ int{q.grad_bits}" if q.grads else ""))
  if opts.get("gather_once"):
    parts.append("gather_once")
  if opts.get("prefetch") is not None:
    parts.append(f"prefetch {opts['prefetch']}")
  if opts.get("grad_accum_steps", 1) > 1:
    parts.append(f"{opts['grad_accum_steps']} micro-batches")
  if opts.get("offload"):
    parts.append("offload")
  return " ".join(p for p in parts if p)


def lower_bound(params: Any, optimizer, mesh, opts: dict, fixed: dict) -> tuple[int, int]:
  """``(device bytes, host bytes)`` of the state a candidate keeps, by the memory formulas.

  Args:
    params: the parameters as ``jax.ShapeDtypeStruct``s.
    optimizer: the optax transformation.
    mesh: the compile-only (or an abstract) mesh the candidate runs on.
    opts: the candidate's options (`search_space`).
    fixed: the user's options (precision, stacked, trainable, comm_dtype, param_specs, wrt).
  """
  keys = ("precision", "trainable", "stacked", "wrt", "comm_dtype", "param_specs")
  kw = {k: fixed[k] for k in keys if k in fixed}
  kw.update(axis_name=opts.get("axis_name", fixed.get("axis_name", DATA)),
            replica_axis=opts.get("replica_axis", fixed.get("replica_axis")),
            hpz_axis=opts.get("hpz_axis"), offload=opts.get("offload"),
            prefetch=opts.get("prefetch") or 0, stages=(opts["stage"],))
  abstract = jax.sharding.AbstractMesh(tuple(mesh.shape.values()), tuple(mesh.axis_names))
  row = memory_report(params, optimizer, mesh=abstract, **kw)[opts["stage"]]
  return row.device, row.host
