"""`plan`: which configuration fits on the user's GPUs and runs fastest, found by compiling.

The flow, on any machine with JAX's CUDA plugin and no GPU: the target's compile-only mesh
(`zero_jax.gpu.targets`) -> the search space, pruned by the memory formulas
(`zero_jax.gpu.candidates`) -> each plausible candidate lowered and its step time estimated,
then the most promising compiled for the target, in parallel threads
(`zero_jax.gpu.measure`) -> XLA's memory analysis and the overlap model's prediction read from
each GPU-compiled program (`zero_jax.gpu.predict`) -> the fastest candidate that fits. Where
none fits, the closest one gets prefetch 0, micro-batches and offload, in that order.

Example (needs JAX's CUDA plugin; no GPU; see the docs' "Planning a run"):
  >>> plan = zj.plan(loss_fn, optax.adamw(3e-4), init, batch, gpu="h100", hosts=2,
  ...                precision="bf16", stacked=True)                  # doctest: +SKIP
  >>> print(plan)                                                     # doctest: +SKIP
  >>> step = plan.make_step(mesh=jax.make_mesh((2, 8), ("hosts", "data")))  # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import inspect
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from zero_jax.gpu import candidates as cands
from zero_jax.gpu import measure
from zero_jax.gpu.targets import Target, check_cluster, compile_only_mesh, get_target
from zero_jax.step import init as init_lib
from zero_jax.step.memory import CompiledMemory, format_bytes
from zero_jax.step.train_step import make_sharded_train_step

# JAX preallocates this fraction of a GPU's memory for its allocator unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: the default budget of a plan.
DEFAULT_MEM_FRACTION = 0.75


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
    step_time_s: PREDICTED seconds per step (`zero_jax.gpu.predict` on the target's figures).
    compute_s: PREDICTED matmul seconds per step.
    intra_bytes: bytes each device sends per step within its host (from the program).
    cross_bytes: bytes each device sends per step across hosts (from the program).
    memory: XLA's figures of the compiled program.
    exact: False for offload, which compile-only GPUs cannot hold: device bytes are then the
      program without offload less ``host_bytes``, its time plus the host copies.
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

  @property
  def fits(self) -> bool:
    """Whether ``bytes_per_device`` is within ``hbm``."""
    return self.bytes_per_device <= self.hbm

  @property
  def name(self) -> str:
    """A short description (``'ZeRO-3 hybrid prefetch 1'``)."""
    return cands.describe({**self.options, "prefetch": self.prefetch})


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `plan` found. ``print(plan)`` shows the table.

  Attributes:
    candidates: the compiled candidates, fastest (predicted) first.
    best: the fastest candidate that fits, or None.
    target: the GPU planned for.
    hosts, per_host: the cluster.
    hbm: bytes per device a candidate may hold.
    ranked_out: ``(options, predicted seconds)`` of candidates lowered but not compiled (their
      lowered programs predicted slower than those compiled).
    pruned: ``(options, bytes)`` of candidates whose state alone, by the memory formulas,
      exceeds ``hbm`` (never compiled).
    refused: ``(options, reason)`` of combinations `make_sharded_train_step` refuses.
    seconds: how long planning took: ``{"total", "lower", "compile"}`` (compiles overlap).
    loss_fn, optimizer, fixed: what `make_step` builds the step from.
  """
  candidates: tuple
  target: Target
  hosts: int
  per_host: int
  hbm: int
  ranked_out: tuple
  pruned: tuple
  refused: tuple
  seconds: dict
  loss_fn: Any = dataclasses.field(repr=False, default=None)
  optimizer: Any = dataclasses.field(repr=False, default=None)
  fixed: dict = dataclasses.field(repr=False, default_factory=dict)

  @property
  def best(self) -> Candidate | None:
    """The fastest (predicted) candidate that fits, or None."""
    return next((c for c in self.candidates if c.fits), None)

  @property
  def closest(self) -> Candidate | None:
    """The candidate that holds the fewest bytes (the nearest miss when nothing fits)."""
    return min(self.candidates, key=lambda c: c.bytes_per_device, default=None)

  def make_step(self, candidate: Candidate | None = None, *, mesh=None):
    """The real step of ``candidate`` (default `best`) on ``mesh``: a mesh of real devices
    with the planned mesh's shape and axis names (default: the compile-only mesh)."""
    c = candidate or self.best
    if c is None:
      raise ValueError(f"no candidate fits in {format_bytes(self.hbm)}; pass one of "
                       f"plan.candidates explicitly.\n{self}")
    planned = c.options["mesh"]
    if mesh is not None and (dict(mesh.shape) != dict(planned.shape)
                             or tuple(mesh.axis_names) != tuple(planned.axis_names)):
      raise ValueError(f"mesh has axes {dict(mesh.shape)}, the plan {dict(planned.shape)}: "
                       f"build it with jax.make_mesh({tuple(planned.devices.shape)}, "
                       f"{tuple(planned.axis_names)}).")
    opts = {k: v for k, v in c.options.items() if k != "mesh"}
    return measure.build_step(self.loss_fn, self.optimizer, {**opts, "prefetch": c.prefetch},
                              mesh if mesh is not None else planned, self.fixed)

  def to_markdown(self) -> str:
    """The plan as a caption and a Markdown table."""
    t = self.target
    head = (f"Plan for {self.hosts} x {self.per_host} {t.name}, {format_bytes(self.hbm)} per "
            f"device; {len(self.candidates)} compiled, {len(self.ranked_out)} ranked out by "
            f"predicted time, {len(self.pruned)} pruned by the memory formulas, "
            f"{len(self.refused)} refused; {self.seconds['total']:.0f} s. Times are PREDICTIONS "
            f"(overlap model, {t.key} figures), bytes from the GPU-compiled programs.")
    lines = [head, "", "| candidate | bytes/device | fits | predicted step | predicted "
             "compute | sent within hosts | sent across hosts |",
             "|---|---:|:-:|---:|---:|---:|---:|"]
    for c in self.candidates:
      mark = "**best**" if c is self.best else ("yes" if c.fits else "no")
      size = format_bytes(c.bytes_per_device) + ("" if c.exact else " (est.)") + (
          f" + {format_bytes(c.host_bytes)} host" if c.host_bytes else "")
      lines.append(f"| {c.name} | {size} | {mark} | {c.step_time_s * 1e3:.3g} ms | "
                   f"{c.compute_s * 1e3:.3g} ms | {format_bytes(c.intra_bytes)} | "
                   f"{format_bytes(c.cross_bytes)} |")
    if self.best is None and self.closest is not None:
      c = self.closest
      lines += ["", f"Nothing fits in {format_bytes(self.hbm)}: the closest is {c.name} at "
                f"{format_bytes(c.bytes_per_device)}, {format_bytes(c.bytes_per_device - self.hbm)}"
                f" over. More GPUs, more hosts, a smaller batch or model, or hbm= (a larger "
                f"XLA_PYTHON_CLIENT_MEM_FRACTION) would change that."]
    elif self.best is None and self.pruned:
      opts, need = min(self.pruned, key=lambda p: p[1])
      lines += ["", f"Nothing fits in {format_bytes(self.hbm)}: the closest is "
                f"{cands.describe(opts)}, whose state alone needs {format_bytes(need)} by the "
                f"memory formulas, {format_bytes(need - self.hbm)} over. More GPUs or hosts, "
                f"or a smaller model, would change that."]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.to_markdown()

  def _repr_markdown_(self) -> str:
    return self.to_markdown()


def default_hbm(target: Target) -> int:
  """``target.memory_bytes`` times XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 when unset: JAX's
  default); the rest is the reserve JAX leaves to CUDA and other processes."""
  frac = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
  return int(target.memory_bytes * frac)


class _Search:
  """The state of one planning run (the inputs, and what was compiled so far)."""

  def __init__(self, loss_fn, optimizer, init, batch, fixed, mesh, target, hbm):
    self.loss_fn, self.optimizer, self.fixed = loss_fn, optimizer, fixed
    self.mesh, self.target, self.hbm = mesh, target, hbm
    self.device = measure.device_for(target, mesh.devices.shape[-1],
                                     fixed.get("precision", "fp32"))
    source = init_lib.resolve(init, None, fixed.get("wrt", nnx.Param))
    self.params = source.params
    self.state_from = init if source.module is not None else source.params
    self.batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    self.refused, self.pruned = [], []
    self.lower_s = self.compile_s = 0.0

  def prepare(self, opts: dict):
    """``(step, host bytes)``, or None (refused, or pruned by the formulas; recorded).

    Compile-only GPUs have no host memory: an offload candidate's step is built without
    offload, and `candidate` takes the host part out of its bytes.
    """
    try:
      step = measure.build_step(self.loss_fn, self.optimizer,
                                {k: v for k, v in opts.items() if k != "offload"},
                                self.mesh, self.fixed)
    except ValueError as e:
      self.refused.append((opts, str(e).split(". ")[0]))
      return None
    dev, host = cands.lower_bound(self.params, self.optimizer, self.mesh, opts, self.fixed)
    if dev > self.hbm:
      self.pruned.append((opts, dev))
      return None
    return step, host

  def lower(self, step):
    t0 = time.perf_counter()
    lowered = step.lower(step.abstract_state(self.state_from), self.batch)
    self.lower_s += time.perf_counter() - t0
    return lowered

  def candidate(self, opts, lowered, host: int, offload: bool) -> Candidate:
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options=measure.FAST_COMPILE)
    self.compile_s += time.perf_counter() - t0
    r = measure.read(compiled, self.device, opts.get("prefetch"))
    extra = 2 * host / measure.HOST_LINK.get(self.target.key, 25e9) if offload else 0.0
    options = {**self.fixed, **{k: v for k, v in opts.items() if k != "prefetch"},
               "mesh": self.mesh}
    return Candidate(options, opts.get("prefetch"), r.memory.peak - (host if offload else 0),
                     host if offload else 0, self.hbm, r.step_s + extra, r.compute_s,
                     r.intra_bytes, r.cross_bytes, r.memory, exact=not offload)


def _check_fixed(fixed: dict) -> None:
  """Raises TypeError naming a ``fixed`` option `make_sharded_train_step` does not take."""
  known = [k for k in inspect.signature(make_sharded_train_step).parameters
           if k not in ("loss_fn", "optimizer", "mesh")]
  if "prefetch" in fixed:
    raise TypeError("zj.plan got prefetch=, a keyword of your loss (zj.scan's), not of "
                    "make_sharded_train_step: the plan searches 0 and 1 when loss_fn takes it. "
                    "To fix it, bind it: zj.plan(functools.partial(loss_fn, prefetch=1), ...).")
  for k in fixed:
    if k not in known:
      near = difflib.get_close_matches(k, known, n=1)
      raise TypeError(f"zj.plan got {k}=, which make_sharded_train_step does not take"
                      + (f" (did you mean {near[0]}=?)" if near else "")
                      + f". Its options: {', '.join(known)}.")


def _all_refused(refused: list) -> str:
  """The error when `make_sharded_train_step` refused every candidate: its distinct reasons."""
  reasons = list(dict.fromkeys(r for _, r in refused))
  return ("zj.plan: make_sharded_train_step refused every candidate, so nothing was compiled. "
          "Its reasons (fix the options passed to zj.plan):\n" +
          "\n".join(f"  - {r}" for r in reasons))


def _compile(s: _Search, ready: list, workers: int) -> list:
  """The candidates of ``ready`` (``(time, options, lowered, host bytes)``), compiled in
  ``workers`` threads."""
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    jobs = [pool.submit(s.candidate, o, low, host, bool(o.get("offload")))
            for _, o, low, host in ready]
    return [f.result() for f in jobs]


def _fall_back(s: _Search, done: list, made_from: list, rounds: int, rows: int, fixed: dict,
               prefetchable: bool) -> None:
  """While no candidate of ``done`` (made from the options ``made_from``, in order) fits,
  compiles the nearest one's next fallback (prefetch 0, micro-batches, offload) and appends it
  to both; at most ``rounds`` of them."""
  tried = list(made_from)
  for _ in range(rounds):
    if not done or any(c.fits for c in done):
      return
    nearest = min(zip(done, made_from), key=lambda ct: ct[0].bytes_per_device)[1]
    nexts = [o for o in cands.fallbacks(nearest, rows, fixed, prefetchable) if o not in tried]
    if not nexts:
      return
    tried.append(nexts[0])
    got = s.prepare(nexts[0])  # None: refused or pruned, and the next round tries the next
    if got is not None:
      done.append(s.candidate(nexts[0], s.lower(got[0]), got[1],
                              bool(nexts[0].get("offload"))))
      made_from.append(nexts[0])


def plan(loss_fn, optimizer, init, batch, *, gpu: str | Target = "h100", hosts: int = 1,
         per_host: int = 8, hbm: int | None = None, max_compiles: int = 4, workers: int = 2,
         **fixed) -> Plan:
  """Finds the fastest configuration that fits on ``hosts x per_host`` GPUs, by compiling.

  Nothing is materialised and no GPU is needed (JAX's CUDA plugin is): each candidate is
  compiled for compile-only devices of ``gpu`` (`zero_jax.compile_only_mesh`). Searched:
  stages 2-3 (1 when fixed), hybrid sharding across hosts, hpZ, ZeRO++ int8/int4
  quantization, ``gather_once``, `zero_jax.scan`'s ``prefetch`` 0/1 when ``loss_fn`` takes a
  ``prefetch`` keyword, then micro-batches and offload where nothing fits. The memory
  formulas drop candidates whose state alone exceeds ``hbm``; the rest are lowered and ranked
  by predicted time, and the ``max_compiles`` fastest compiled (then fallbacks, as many again,
  while none fits). Times are predictions; bytes are the compiled programs'. The host memory
  it takes is XLA's compiler's (about 350 MiB per compile in flight for GPT-2 small), not the
  model's: JAX's persistent compilation cache is off while it compiles (compile-only programs
  cannot be read back from it), and back on when it returns.

  Args:
    loss_fn: as for `make_sharded_train_step` (optionally with a ``prefetch`` keyword).
    optimizer: the optax transformation.
    init: what ``step.init`` takes: an init function, an (abstract) ``nnx.Module``, or the
      parameters as ``jax.ShapeDtypeStruct``s.
    batch: the global batch, as ``jax.ShapeDtypeStruct``s (or arrays).
    gpu: ``"h100"``, ``"h200"``, ``"a100"`` or a `zero_jax.gpu.Target`.
    hosts: hosts in the cluster (the mesh's first axis, ``"hosts"``, spans them).
    per_host: GPUs per host (the ``"data"`` axis).
    hbm: bytes per device a candidate may hold (default `default_hbm`).
    max_compiles: how many candidates to compile (ranked by predicted time).
    workers: compiles run in this many threads at once.
    **fixed: `make_sharded_train_step` options already chosen (``precision="bf16"``,
      ``stacked=``, ...); those the planner searches are then not searched.

  Returns:
    A `Plan`: ``plan.best`` (None when nothing fits), ``plan.candidates``, ``print(plan)``.
  """
  t0 = time.perf_counter()
  if "mesh" in fixed:
    raise TypeError("zj.plan builds its own compile-only mesh (hosts x per_host, axes "
                    "('hosts', 'data')); pass hosts= and per_host=, not mesh=.")
  target = get_target(gpu)
  check_cluster(hosts, per_host)
  for name, v in (("max_compiles", max_compiles), ("workers", workers)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"zj.plan: {name}={v!r} must be an int >= 1 (defaults: max_compiles=4, "
                       f"workers=2).")
  _check_fixed(fixed)
  shape, names = cands.mesh_shape(hosts, per_host)
  mesh = compile_only_mesh(shape, names, gpu=target, hosts=hosts, per_host=per_host)
  s = _Search(loss_fn, optimizer, init, batch, fixed, mesh, target,
              default_hbm(target) if hbm is None else int(hbm))
  prefetchable = cands.takes_prefetch(loss_fn)
  ready = []
  for opts in cands.search_space(fixed, hosts=hosts, per_host=per_host,
                                 takes_prefetch=prefetchable):
    got = s.prepare(opts)
    if got is None and "offload" not in fixed and s.pruned and \
        s.pruned[-1][0] is opts:  # the state does not fit: try it offloaded
      opts = {**opts, "offload": "optimizer"}
      got = s.prepare(opts)
    if got is not None:
      lowered = s.lower(got[0])
      ready.append((measure.estimate(lowered, s.device, opts.get("prefetch")), opts,
                    lowered, got[1]))
      ready.sort(key=lambda r: r[0])  # only the fastest so far keep their lowered program
      ready[max_compiles:] = [(t, o, None, h) for t, o, _, h in ready[max_compiles:]]
  if not ready and not s.pruned:
    raise ValueError(_all_refused(s.refused))
  rows = max(1, jax.tree.leaves(s.batch)[0].shape[0] // (hosts * per_host))
  with measure.without_persistent_cache():
    done = _compile(s, ready[:max_compiles], workers)
    _fall_back(s, done, [o for _, o, _, _ in ready[:max_compiles]], max_compiles, rows,
               fixed, prefetchable)
  ranked_out = tuple((o, t) for t, o, _, _ in ready[max_compiles:])
  seconds = {"total": time.perf_counter() - t0, "lower": s.lower_s, "compile": s.compile_s}
  return Plan(tuple(sorted(done, key=lambda c: c.step_time_s)), target, hosts, per_host,
              s.hbm, ranked_out, tuple(s.pruned), tuple(s.refused), seconds,
              loss_fn, optimizer, dict(fixed))
