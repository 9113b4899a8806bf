"""The planner's search space, its fallbacks, the memory formulas that prune it before anything
compiles, and `Candidate`, the record of one compiled configuration.

`search_space` lists the `make_sharded_train_step` options worth trying on ``hosts x per_host``
GPUs: ZeRO stages 2 and 3 (stage 1 is kept only when the user fixes it: it all-reduces whole
gradients, so stage 2 holds less and sends less), hybrid sharding (the state split within a
host, replicated across hosts), hpZ, ``gather_once``, and `zero_jax.scan`'s ``prefetch=1`` when
the loss takes a ``prefetch`` keyword, and the remat policy when it takes a ``policy`` keyword
(ranked by compiling: `compile_order`). The math stays exact: ZeRO++ int8 weights with int8 or int4 gradients
(lossy) are searched only with ``quantize="search"``. Options the user passes to
`zero_jax.plan` are not searched; `pointless` names the searched ones a cluster's shape makes
useless (hpZ or hybrid with one GPU per host). Prefetch 0, leaner remat policies (for a
layout the ranking did not compile with them),
micro-batches (``grad_accum_steps``) and offload are fallbacks: `fallbacks` lists them, and
their combinations, for a candidate that does not fit.

`lower_bound` is the state a candidate holds on each device by `zero_jax.memory_report`'s
formulas (parameters, gradients, optimizer state, master copy, prefetch buffers): every
compiled program holds at least that, so a candidate whose bound exceeds the memory is dropped
without compiling it.

Example:
  >>> from zero_jax.gpu import candidates
  >>> space = candidates.search_space({}, hosts=2, per_host=8, takes_prefetch=False)
  >>> len(space), candidates.describe(space[0])
  (7, 'ZeRO-2 flat')
  >>> len(candidates.search_space({"quantize": "search"}, hosts=2, per_host=8,
  ...                             takes_prefetch=False))
  21
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from typing import Any

import jax

from zero_jax.comm.collectives import Quantize
from zero_jax.step.memory import CompiledMemory, memory_report

HOSTS, DATA = "hosts", "data"  # the axis names of the meshes the planner compiles on

# ZeRO++ choices with quantize="search": none, int8 weights and gradients (qwZ + qgZ), int8
# weights with int4 grads. Without it, communication stays exact.
QUANTIZE = (None, Quantize(weights=True, grads=True, grad_bits=8),
            Quantize(weights=True, grads=True, grad_bits=4))
SEARCH = "search"  # quantize="search": add QUANTIZE's lossy choices to the space
SEARCHED = ("stage", "axis_name", "replica_axis", "hpz_axis", "quantize", "gather_once",
            "offload", "grad_accum_steps")
# Remat policies for a loss's `policy` keyword, fastest and largest first: keep every
# activation (no recompute), save the matmul outputs without batch dimensions (the
# projections; attention scores and elementwise work are recomputed), save nothing.
POLICIES = (None, jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.nothing_saveable)
POLICY_NAMES = ("no remat", "remat saving dots", "full remat")
KEYWORDS = ("prefetch", "policy")  # the loss's keywords the planner binds
# Candidates whose lowered estimates lie within this fraction of the fastest exact one's are
# near ties: the estimate cannot order them, so each is compiled (`near_ties`). What it leaves
# out is what only the compiled program shows, the memory-bound work (60% of a GPT-2 small
# step without remat), and that differs between layouts: on GPT-2 small at 4 x 8 H100s hybrid
# sharding does 0.31 ms more of it than flat ZeRO-3, 2.9% of its 10.8 ms estimate, which put
# flat 0.7% behind by estimate and 1.0% ahead compiled (BENCHMARKS.md "scale" tabulates the
# two orders per row). 5% leaves room for models whose memory-bound share is larger.
NEAR_TIE = 0.05


def takes_keyword(loss_fn, name: str) -> bool:
  """Whether ``loss_fn`` takes a keyword ``name`` (``prefetch``, `zero_jax.scan`'s, or a remat
  ``policy``: the planner then searches and passes it)."""
  try:
    params = inspect.signature(loss_fn).parameters
  except (TypeError, ValueError):
    return False
  p = params.get(name)
  return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


def takes_prefetch(loss_fn) -> bool:
  """Whether ``loss_fn`` takes a ``prefetch`` keyword (`takes_keyword`)."""
  return takes_keyword(loss_fn, "prefetch")


def lossy(opts: dict) -> bool:
  """Whether a candidate's communication rounds values (ZeRO++ quantization): its training
  is then no longer the exact single-device math."""
  q = opts.get("quantize")
  return q is not None and not isinstance(q, str) and bool(q.weights or q.grads)


def pointless(opts: dict, fixed: dict, *, hosts: int, per_host: int) -> str | None:
  """Why the cluster's shape makes a searched candidate useless, or None. Options the user
  fixed are never judged (they asked for them)."""
  if per_host == 1 and opts.get("hpz_axis") and "hpz_axis" not in fixed:
    return ("hpZ within a host of 1 GPU keeps a whole copy of the parameters on each GPU: "
            "ZeRO-2's memory, with stage 3's gathers on top")
  if per_host == 1 and opts.get("replica_axis") and "replica_axis" not in fixed:
    return ("hybrid sharding with 1 GPU per host splits nothing: every GPU holds the whole "
            "state (plain data parallelism)")
  if hosts * per_host == 1 and opts.get("stage") == 3 and "stage" not in fixed:
    return "one GPU: nothing to split, and ZeRO-3 holds what ZeRO-2 holds plus its gathers"
  return None


def layouts(hosts: int) -> list[dict]:
  """How the devices split the state: over every device (``flat``), or hybrid."""
  if hosts == 1:
    return [{"axis_name": DATA}]
  return [{"axis_name": (HOSTS, DATA)}, {"axis_name": DATA, "replica_axis": HOSTS}]


def mesh_shape(hosts: int, per_host: int) -> tuple[tuple, tuple]:
  """``(shape, axis names)`` of the compile-only mesh: hosts first, then the GPUs of one."""
  return ((hosts, per_host), (HOSTS, DATA)) if hosts > 1 else ((per_host,), (DATA,))


def search_space(fixed: dict, *, hosts: int, per_host: int, takes_prefetch: bool,
                 takes_policy: bool = False) -> list[dict]:
  """Every combination of the searched options, less those the user fixed (``fixed`` wins).

  Each entry is a dict of `make_sharded_train_step` options (no mesh) plus ``"prefetch"``
  (None when the loss takes none) and, when the loss takes one, ``"policy"`` (None; the
  others are `policy_variants`, compiled as `compile_order` says). ``fixed["quantize"] == "search"`` adds ZeRO++ quantization;
  without it ``quantize`` is None (exact) unless fixed. Combinations
  `make_sharded_train_step` would refuse are left to `zero_jax.plan` to drop (it builds each
  step).
  """
  stages = (fixed["stage"],) if "stage" in fixed else (2, 3)
  lays = [{}] if {"axis_name", "replica_axis"} & set(fixed) else layouts(hosts)
  quants = QUANTIZE if fixed.get("quantize") == SEARCH else (fixed.get("quantize"),)
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
      if takes_policy:
        opts["policy"] = POLICIES[0]
      if opts not in out:
        out.append(opts)
  return out


def policy_variants(opts: dict) -> list[dict]:
  """``opts`` with each of `POLICIES` (fastest and largest first) when the loss takes a
  ``policy`` (``"policy" in opts``), else ``[opts]``.

  Which policy is fastest is the compiled program's to say, not the lowered one's: remat adds
  matmuls, but what it saves the backward pass from reading back (float32 attention
  probabilities, written-out masks) is memory-bound work only the fused program shows. So the
  policy is ranked by compiling, not by the lowered estimate (`compile_order`).
  """
  if "policy" not in opts:
    return [opts]
  return [{**opts, "policy": p} for p in POLICIES]


def layouts_to_compile(max_compiles: int, opts: dict) -> int:
  """How many of the fastest-ranked layouts `compile_order` reaches with ``max_compiles``
  compiles: each takes as many as it has `policy_variants`."""
  return -(-max_compiles // len(policy_variants(opts)))


def compile_order(layouts: list[dict], max_compiles: int) -> tuple[list[dict], list[dict]]:
  """``(compiled, left out)``: how the planner spends ``max_compiles`` on ``layouts``.

  ``layouts`` are candidates ranked fastest first by their lowered estimate (each with the
  loss's ``policy`` None when it takes one). The budget goes layout by layout: the fastest
  layout with every remat policy of `policy_variants`, then the next, until ``max_compiles``
  programs; the rest are left out (said in the plan). So with a ``policy`` loss, 3 compiles
  compare every policy of the layout the estimate ranks fastest (the default 4 adds the next
  layout without remat), and the plan's best is never slower, by its own prediction, than
  that layout under another policy that fits.

  Example:
    >>> lays = [{"stage": 3, "policy": None}, {"stage": 2, "policy": None}]
    >>> done, left = compile_order(lays, 4)
    >>> [describe({**o, "axis_name": "data"}) for o in done]
    ['ZeRO-3 flat no remat', 'ZeRO-3 flat remat saving dots', 'ZeRO-3 flat full remat', \
'ZeRO-2 flat no remat']
    >>> len(left)
    2
  """
  order = [v for o in layouts for v in policy_variants(o)]
  return order[:max_compiles], order[max_compiles:]


def near_ties(ranked: list[tuple[float, dict]], *, within: float = NEAR_TIE) -> list[dict]:
  """The exact candidates of ``ranked`` whose estimate the fastest exact one's does not beat
  by more than ``within``: those the plan compiles whatever ``max_compiles`` is.

  The estimate of a lowered program leaves out the memory-bound work only the compiled
  program shows (see `NEAR_TIE`), so it cannot order candidates closer than that: the plan
  compiles each of them, under the remat policy of the fastest fitting candidate compiled by
  then (`zero_jax.gpu.search`; `reversed_layouts` then adds its other policies where it beats
  that layout), so that its best is never slower, by its own prediction, than a candidate the
  estimate could not tell apart from it under that policy. Lossy candidates
  are never near ties: their estimate leaves out quantization's work too, and the plan
  compiles them only when the budget reaches them.

  Example:
    >>> a, b, c = {"stage": 3}, {"stage": 2}, {"stage": 1}
    >>> [o["stage"] for o in near_ties([(0.100, a), (0.104, b), (0.106, c)])]
    [3, 2]

  Args:
    ranked: ``(estimated seconds, options)`` of each lowered candidate, fastest first.
    within: the fraction of the fastest exact estimate within which candidates tie.

  Returns:
    The options of the tied exact candidates, the fastest first (the fastest included);
    none when no candidate is exact.
  """
  exact = [(t, o) for t, o in ranked if not lossy(o)]
  if not exact:
    return []
  return [o for t, o in exact if t <= exact[0][0] * (1 + within)]


def _layout(opts: dict) -> tuple:
  """``opts`` without its remat policy, hashable: the layout a policy variant belongs to."""
  return tuple(sorted((k, repr(v)) for k, v in opts.items() if k != "policy"))


def reversed_layouts(compiled: list[tuple[dict, float]]) -> list[dict]:
  """The policy variants still to compile where compiled programs reversed the estimate.

  `compile_order` compiles every remat policy of the layout the lowered estimate ranks
  fastest, and the next layouts only under some. When a layout compiled under a policy is
  predicted faster than a layout whose every policy was compiled, under that same policy, the
  estimate ranked them the wrong way round, and the policy that helped the one is likely to
  help the other: that layout's other policies are returned, so that the plan's best is never
  slower than it under a policy the plan compiled elsewhere.

  Example:
    >>> from zero_jax.gpu.candidates import POLICIES as P
    >>> a = [{"stage": 3, "policy": p} for p in P]          # every policy compiled
    >>> b = {"stage": 2, "policy": None}                    # only without remat
    >>> done = [(a[0], 0.050), (a[1], 0.040), (a[2], 0.045), (b, 0.048)]
    >>> [o["policy"] is P[1] for o in reversed_layouts(done)]  # b beat a without remat
    [True, False]
    >>> reversed_layouts(done[:3] + [(b, 0.052)])           # b slower: nothing to add
    []

  Args:
    compiled: ``(options, predicted seconds)`` of each compiled candidate; the options of a
      loss that takes ``policy`` have a ``"policy"`` key (others are never returned).

  Returns:
    Options not in ``compiled``, in `POLICIES` order for each reversed layout, the layouts in
    the order they first appear in ``compiled``.
  """
  times: dict[tuple, dict] = {}
  for o, t in compiled:
    if "policy" in o:
      times.setdefault(_layout(o), {})[POLICIES.index(o["policy"])] = (t, o)
  whole = [k for k, v in times.items() if len(v) == len(POLICIES)]
  out = []
  for k, v in times.items():
    if len(v) == len(POLICIES) or not any(
        v[p][0] < times[w][p][0] for w in whole for p in v):
      continue
    some = next(iter(v.values()))[1]
    out += [{**some, "policy": POLICIES[p]} for p in range(len(POLICIES)) if p not in v]
  return out


def at_policy(compiled: list[dict], policy) -> list[dict]:
  """Each layout of ``compiled`` (options with a ``"policy"`` key) not compiled under
  ``policy``, under it: the layouts the estimate ranked and the budget compiled under other
  policies only, asked once at the best's policy, where the order of two layouts may differ
  from theirs without remat (BENCHMARKS "scale", GPT-2 small on 4 hosts: flat ZeRO-3 was
  slower than flat ZeRO-3 gather_once without remat, and 1.9% faster saving dots).

  Example:
    >>> from zero_jax.gpu.candidates import POLICIES as P
    >>> a = [{"stage": 3, "policy": p} for p in P]
    >>> b = {"stage": 2, "policy": None}
    >>> [(o["stage"], o["policy"] is P[1]) for o in at_policy(a + [b], P[1])]
    [(2, True)]
  """
  have = {_layout(o) for o in compiled if "policy" in o and o["policy"] is policy}
  out, seen = [], set()
  for o in compiled:
    if "policy" in o and _layout(o) not in have and _layout(o) not in seen:
      seen.add(_layout(o))
      out.append({**o, "policy": policy})
  return out


def fallbacks(root: dict, rows_per_device: int, fixed: dict) -> list[tuple[tuple, dict]]:
  """``(levels, options)`` of ``root`` and of every leaner variant of it, in the order the
  planner tries them.

  The variants change, one at a time and then in combination: ``prefetch`` 1 -> 0 (when
  ``root`` has 1), ``policy`` -> the leaner `POLICIES` (when ``root`` has one),
  ``grad_accum_steps`` 2, 4, ... (while they divide each device's ``rows_per_device``) and
  ``offload="optimizer"`` (each unless fixed). Order: fewer changes first, then the smaller
  ones, then prefetch before policy before micro-batches before offload; the last entry
  changes everything (the leanest). ``levels`` says how far a variant went along each of the
  four: a variant whose every level is at most another's holds at least as much.
  """
  dims = [[root.get("prefetch")] + ([0] if root.get("prefetch") == 1 else []),
          list(POLICIES[POLICIES.index(root["policy"]):]) if "policy" in root else [None],
          [root.get("grad_accum_steps", 1)], [root.get("offload")]]
  if "grad_accum_steps" not in fixed:
    k = dims[2][0] * 2
    while k <= rows_per_device and rows_per_device % k == 0:
      dims[2].append(k)
      k *= 2
  if "offload" not in fixed and not root.get("offload"):
    dims[3].append("optimizer")
  grid = sorted(itertools.product(*(range(len(d)) for d in dims)),
                key=lambda lv: (sum(1 for l in lv if l), sum(lv), tuple(-l for l in lv)))
  out = []
  for lv in grid:
    pre, pol, accum, off = (d[l] for d, l in zip(dims, lv))
    opts = {k: v for k, v in root.items() if k not in ("grad_accum_steps", "offload")}
    opts["prefetch"] = pre
    if "policy" in root:
      opts["policy"] = pol
    if accum != 1:
      opts["grad_accum_steps"] = accum
    if off:
      opts["offload"] = off
    out.append((lv, opts))
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
  if "policy" in opts:
    parts.append(POLICY_NAMES[POLICIES.index(opts["policy"])] if opts["policy"] in POLICIES
                 else f"policy {getattr(opts['policy'], '__name__', opts['policy'])}")
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


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration, compiled for the target (``exact``) or estimated from one that was.

  Attributes:
    options: the `make_sharded_train_step` options, ``mesh`` (the compile-only mesh it was
      planned on) included; swap in a real mesh of the same shape and axis names.
    prefetch: the ``prefetch`` passed to the loss (`zero_jax.scan`'s), or None.
    bytes_per_device: what the GPU-compiled program holds on each device: arguments +
      outputs not aliased to them + temporaries (XLA's ``memory_analysis()``).
    host_bytes: bytes kept in pinned host memory (``offload="optimizer"``), by the formulas.
    hbm: the budget ``fits`` compares with.
    step_time_s: PREDICTED seconds per step: the compiled program's schedule walked on the
      target's figures (`zero_jax.gpu.timeline`), an offloaded state's PCIe copies included.
    compute_s: PREDICTED compute seconds per step: matmuls, and the bytes the other kernels
      move over HBM bandwidth (``elementwise_s`` of it).
    intra_bytes: bytes each device sends per step within its host (from the program).
    cross_bytes: bytes each device sends per step across hosts (from the program).
    memory: XLA's figures of the compiled program.
    exact: False for offload, which compile-only GPUs cannot hold: device bytes are then the
      program without offload less ``host_bytes``, its time plus the host copies.
    policy: the remat ``policy`` passed to the loss (None: keep every activation, or the
      loss takes no ``policy``; ``"policy" in loss_keywords`` tells which).
    elementwise_s: PREDICTED seconds of memory-bound kernels per step.
    loss_keywords: every keyword bound to the loss (``prefetch``, ``policy``).
  """
  options: dict
  prefetch: int | None
  bytes_per_device: int
  host_bytes: int
  hbm: int
  step_time_s: float
  compute_s: float
  intra_bytes: float
  cross_bytes: float
  memory: CompiledMemory
  exact: bool = True
  policy: Any = None
  elementwise_s: float = 0.0
  loss_keywords: dict = dataclasses.field(default_factory=dict)

  @property
  def fits(self) -> bool:
    """Whether ``bytes_per_device`` is within ``hbm``."""
    return self.bytes_per_device <= self.hbm

  @property
  def lossy(self) -> bool:
    """Whether its communication is quantized (ZeRO++): training is then not the exact math
    of a single-device step. Never true unless `zero_jax.plan` got ``quantize="search"`` or
    a ``zero_jax.Quantize``."""
    return lossy(self.options)

  @property
  def name(self) -> str:
    """A short description (``'ZeRO-3 hybrid prefetch 1'``)."""
    return describe({**self.options, "prefetch": self.prefetch, **self.loss_keywords})
