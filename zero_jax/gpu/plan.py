"""`plan`: which configuration fits on the user's GPUs and runs fastest, found by compiling.

The flow, on any machine with JAX's CUDA plugin and no GPU: the target's compile-only mesh
(`zero_jax.gpu.targets`) -> the search space, exact unless ``quantize="search"``, pruned by the
cluster's shape and the memory formulas (`zero_jax.gpu.candidates`) -> each plausible
candidate lowered and its step time estimated, the most promising compiled for the target in
parallel threads (with a loss taking ``policy``, the most promising layout with each remat
policy: only the compiled program shows what a policy saves) (`zero_jax.gpu.search`, `zero_jax.gpu.measure`) -> XLA's memory analysis and
the step time predicted by walking each GPU-compiled program's schedule (`zero_jax.gpu.timeline`)
-> the fastest candidate that fits. Where none of those fits, they are compiled again with a
leaner remat policy (when the loss takes ``policy``), then the leanest candidate's fallbacks
(prefetch 0, leaner remat policies, micro-batches, offload) settle whether anything fits,
whatever ``max_compiles`` was.

Example (needs JAX's CUDA plugin; no GPU; see the docs' "Planning a run"):
  >>> plan = zj.plan(loss_fn, optax.adamw(3e-4), init, batch, gpu="h100", hosts=2,
  ...                precision="bf16", stacked=True)                  # doctest: +SKIP
  >>> print(plan)                                                     # doctest: +SKIP
  >>> step = plan.make_step(mesh=jax.make_mesh((2, 8), ("hosts", "data")))  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import numbers
import os
import time
import warnings
from typing import Any

import jax
import numpy as np

from zero_jax.gpu import candidates as cands
from zero_jax.gpu import measure
from zero_jax.gpu import search
from zero_jax.gpu.candidates import Candidate
from zero_jax.gpu.targets import Target, check_cluster, compile_only_mesh, get_target
from zero_jax.step.memory import format_bytes
from zero_jax.step.train_step import make_sharded_train_step

# JAX preallocates this fraction of a GPU's memory for its allocator unless
# XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: the default budget of a plan.
DEFAULT_MEM_FRACTION = 0.75
# Seconds after which a plan starts nothing new and says what it left (GPT-2 small on 32 hosts
# x 8 H100s plans in minutes on 2 CPU cores: BENCHMARKS.md, "scale").
DEFAULT_TIME_LIMIT = 1800.0


@dataclasses.dataclass(frozen=True)
class Plan:
  """What `plan` found. ``print(plan)`` shows the table, then why the others were left out.

  Attributes:
    candidates: the compiled candidates (`ranked`): those that fit, fastest (predicted)
      first, then those that do not (marked "does not fit", never ranked), smallest first.
    best: the fastest candidate that fits, or None.
    closest: with ``best`` None, the compiled candidate that holds the fewest bytes.
    target: the GPU planned for.
    hosts, per_host: the cluster.
    hbm: bytes per device a candidate may hold.
    ranked_out: ``(options, predicted seconds)`` of candidates lowered but not compiled (their
      lowered programs predicted slower than those compiled).
    pruned: ``(options, bytes)`` of candidates whose state alone, by the memory formulas,
      exceeds ``hbm`` (never compiled, except the leanest fallback when nothing fits).
    refused: ``(options, reason)`` of combinations `make_sharded_train_step` refuses.
    skipped: ``(options, reason)`` of candidates not compiled because they cannot help: the
      cluster's shape makes them pointless (hpZ or hybrid with one GPU per host), or they
      hold at least what a compiled misfit holds.
    stopped: None, or why the plan stopped early (its ``time_limit`` passed) and what was left.
    estimated: ``(options, predicted seconds)`` of every candidate ranked by the estimate of
      its lowered program (compiled or not; `zero_jax.gpu.measure.estimate`), in the order
      lowered: beside ``candidates`` it shows where the estimate and the compiled programs
      order layouts differently.
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
  skipped: tuple = ()
  stopped: str | None = None
  estimated: tuple = ()

  @property
  def best(self) -> Candidate | None:
    """The fastest (predicted) candidate that fits, or None."""
    return next((c for c in self.candidates if c.fits), None)

  @property
  def closest(self) -> Candidate | None:
    """The candidate that holds the fewest bytes (the nearest miss when nothing fits); set
    whenever anything was compiled, which `plan` makes sure of when nothing fits."""
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
    return measure.build_step(self.loss_fn, self.optimizer, {**opts, **c.loss_keywords},
                              mesh if mesh is not None else planned, self.fixed)

  def _row(self, c: Candidate) -> str:
    mark = "**best**" if c is self.best else ("yes" if c.fits else "does not fit")
    size = format_bytes(c.bytes_per_device) + ("" if c.exact else " (est.)") + (
        f" + {format_bytes(c.host_bytes)} host" if c.host_bytes else "")
    step = f"{c.step_time_s * 1e3:.3g} ms" if c.fits else "not ranked"
    return (f"| {c.name} | {'**LOSSY**' if c.lossy else 'exact'} | {size} | {mark} | "
            f"{step} | {c.compute_s * 1e3:.3g} ms | "
            f"{c.elementwise_s * 1e3:.3g} ms | {format_bytes(c.intra_bytes)} | "
            f"{format_bytes(c.cross_bytes)} |")

  def _left_out(self) -> list[str]:
    """Why candidates were not compiled: each distinct reason once, with its count."""
    lines = []
    for title, pairs in (("Refused by make_sharded_train_step", self.refused),
                         ("Skipped", self.skipped)):
      counts: dict = {}
      for _, why in pairs:
        counts[why] = counts.get(why, 0) + 1
      if counts:
        lines += ["", f"{title}:"] + [f"- {why}" + (f" ({n} candidates)" if n > 1 else "")
                                      for why, n in list(counts.items())[:8]]
        if len(counts) > 8:
          lines.append(f"- ... and {len(counts) - 8} other reasons")
    if self.pruned:
      opts, need = min(self.pruned, key=lambda p: p[1])
      lines += ["", f"Pruned by the memory formulas: {len(self.pruned)} candidates whose state "
                f"alone exceeds {format_bytes(self.hbm)}; the smallest, {cands.describe(opts)},"
                f" needs {format_bytes(need)}."]
    return lines

  def to_markdown(self) -> str:
    """The plan as a caption, a Markdown table, and why the others were left out."""
    t = self.target
    head = (f"Plan for {self.hosts} x {self.per_host} {t.name}, {format_bytes(self.hbm)} per "
            f"device; {len(self.candidates)} compiled, {len(self.ranked_out)} ranked out by "
            f"predicted time, {len(self.pruned)} pruned by the memory formulas, "
            f"{len(self.skipped)} skipped, {len(self.refused)} refused; "
            f"{self.seconds['total']:.0f} s. Times are PREDICTIONS (schedule walked, {t.key} "
            f"figures), bytes from the GPU-compiled programs."
            + (" LOSSY: quantized communication, not the exact math of a single-device step."
               if any(c.lossy for c in self.candidates) else ""))
    lines = [head, "", "| candidate | math | bytes/device | fits | predicted step | predicted "
             "compute | of which memory-bound | sent within hosts | sent across hosts |",
             "|---|:-:|---:|:-:|---:|---:|---:|---:|---:|"]
    lines += [self._row(c) for c in self.candidates]
    if self.stopped:
      lines += ["", f"Incomplete: {self.stopped}."]
    if self.best is None and self.closest is not None:
      c = self.closest
      lines += ["", f"Nothing fits in {format_bytes(self.hbm)}: the closest is {c.name} at "
                f"{format_bytes(c.bytes_per_device)}, {format_bytes(c.bytes_per_device - self.hbm)}"
                f" over. More GPUs, more hosts, a smaller batch or model, or hbm= (a larger "
                f"XLA_PYTHON_CLIENT_MEM_FRACTION) would change that."]
    return "\n".join(lines + self._left_out())

  def __str__(self) -> str:
    return self.to_markdown()

  def _repr_markdown_(self) -> str:
    return self.to_markdown()


def ranked(candidates) -> tuple:
  """Those that fit, fastest (predicted) first, then those that do not, smallest first: a
  program that does not fit is never ranked by its time (it cannot run at all)."""
  fit = sorted((c for c in candidates if c.fits), key=lambda c: c.step_time_s)
  return tuple(fit) + tuple(sorted((c for c in candidates if not c.fits),
                                   key=lambda c: c.bytes_per_device))


def default_hbm(target: Target) -> int:
  """``target.memory_bytes`` times XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 when unset: JAX's
  default); the rest is the reserve JAX leaves to CUDA and other processes."""
  frac = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_MEM_FRACTION))
  return int(target.memory_bytes * frac)


def _check_fixed(fixed: dict) -> None:
  """Raises TypeError naming a ``fixed`` option `make_sharded_train_step` does not take, and
  ValueError for a ``quantize`` string other than ``"search"``."""
  known = [k for k in inspect.signature(make_sharded_train_step).parameters
           if k not in ("loss_fn", "optimizer", "mesh")]
  for k in cands.KEYWORDS:
    if k in fixed:
      raise TypeError(f"zj.plan got {k}=, a keyword of your loss, not of "
                      f"make_sharded_train_step: the plan searches it when loss_fn takes it. "
                      f"To fix it, bind it: "
                      f"zj.plan(functools.partial(loss_fn, {k}={fixed[k]!r}), ...).")
  for k in fixed:
    if k not in known:
      near = difflib.get_close_matches(k, known, n=1)
      raise TypeError(f"zj.plan got {k}=, which make_sharded_train_step does not take"
                      + (f" (did you mean {near[0]}=?)" if near else "")
                      + f". Its options: {', '.join(known)}.")
  q = fixed.get("quantize")
  if isinstance(q, str) and q != cands.SEARCH:
    raise ValueError(f"zj.plan got quantize={q!r}: pass quantize='search' to add ZeRO++ "
                     f"quantized communication (lossy) to the search, a zero_jax.Quantize to "
                     f"fix it, or nothing (None: exact, the default).")


def _all_refused(refused: list) -> str:
  """The error when `make_sharded_train_step` refused every candidate: its distinct reasons."""
  reasons = list(dict.fromkeys(r for _, r in refused))
  return ("zj.plan: make_sharded_train_step refused every candidate, so nothing was compiled. "
          "Its reasons (fix the options passed to zj.plan):\n" +
          "\n".join(f"  - {r}" for r in reasons))


def _check_counts(**counts) -> None:
  for name, v in counts.items():
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"zj.plan: {name}={v!r} must be an int >= 1 (defaults: max_compiles=4, "
                       f"workers=2).")


def _check_hbm(hbm) -> None:
  """Raises ValueError unless ``hbm`` is None or a positive, finite number of bytes."""
  if hbm is None:
    return
  if isinstance(hbm, bool) or not isinstance(hbm, numbers.Real) or not math.isfinite(hbm) \
      or hbm < 1:
    raise ValueError(f"zj.plan: hbm={hbm!r} must be a positive, finite number of bytes per "
                     f"device, e.g. hbm=80e9 (80 GB) or hbm=80 * 2**30 (80 GiB); or None for "
                     f"the GPU's memory times XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 when "
                     f"unset).")


def _check_inputs(loss_fn, optimizer, batch, time_limit) -> None:
  """Raises TypeError/ValueError naming ``loss_fn``, ``optimizer``, ``batch`` or
  ``time_limit`` when it cannot be what `plan` takes."""
  if not callable(loss_fn):
    raise TypeError(f"zj.plan: loss_fn must be callable, loss_fn(params, batch) -> loss; got "
                    f"{type(loss_fn).__name__}.")
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise TypeError(f"zj.plan: optimizer must be an optax.GradientTransformation (e.g. "
                    f"optax.adamw(3e-4)); got {type(optimizer).__name__}.")
  for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
      raise TypeError(f"zj.plan: batch{jax.tree_util.keystr(path)} is a "
                      f"{type(leaf).__name__}; each leaf of batch must be an array or a "
                      f"jax.ShapeDtypeStruct (the global batch's shape and dtype).")
    if not np.shape(leaf):
      raise ValueError(f"zj.plan: batch{jax.tree_util.keystr(path)} is a scalar; each leaf "
                       f"of batch needs a leading batch dimension (the global batch) to split "
                       f"over the GPUs.")
  if not jax.tree.leaves(batch):
    raise ValueError("zj.plan: batch has no arrays; pass the global batch as arrays or "
                     "jax.ShapeDtypeStructs, e.g. jax.ShapeDtypeStruct((64, 1025), jnp.int32).")
  if time_limit is not None and (isinstance(time_limit, bool)
                                 or not isinstance(time_limit, numbers.Real)
                                 or not time_limit > 0):
    raise ValueError(f"zj.plan: time_limit={time_limit!r} must be seconds > 0, or None.")


def _stand_in_mesh(hosts: int, per_host: int):
  """A mesh of the planned shape and axis names made of this machine's first device repeated:
  enough for `make_sharded_train_step` to check its options (it compiles nothing) where JAX's
  CUDA plugin is missing. (Only then: asking for this machine's devices starts JAX's
  backends, after which the plugin gives no compile-only devices.)"""
  shape, names = cands.mesh_shape(hosts, per_host)
  devices = np.array([jax.devices()[0]] * (hosts * per_host), dtype=object).reshape(shape)
  return jax.sharding.Mesh(devices, names)


def _check_buildable(loss_fn, optimizer, space: list, fixed: dict, mesh) -> None:
  """Raises `_all_refused`'s error when `make_sharded_train_step` refuses every candidate of
  ``space`` with ``fixed`` on ``mesh`` (a fixed option of a wrong value): before anything is
  compiled."""
  refused = []
  for opts in space:
    try:
      measure.build_step(loss_fn, optimizer, {k: v for k, v in opts.items() if k != "offload"},
                         mesh, fixed)
      return
    except ValueError as e:  # as `zero_jax.gpu.search.Search.prepare` records it
      refused.append((opts, str(e).split(". ")[0]))
  if refused:
    raise ValueError(_all_refused(refused))


def plan(loss_fn, optimizer, init, batch, *, gpu: str | Target = "h100", hosts: int = 1,
         per_host: int = 8, hbm: int | None = None, max_compiles: int = 4, workers: int = 2,
         time_limit: float | None = DEFAULT_TIME_LIMIT, **fixed) -> Plan:
  """Finds the fastest configuration that fits on ``hosts x per_host`` GPUs, by compiling.

  Nothing is materialised and no GPU is needed (JAX's CUDA plugin is): each candidate is
  compiled for compile-only devices of ``gpu`` (`zero_jax.compile_only_mesh`). Searched:
  stages 2-3 (1 when fixed), hybrid sharding across hosts, hpZ, ``gather_once``,
  `zero_jax.scan`'s ``prefetch=1`` when ``loss_fn`` takes a ``prefetch`` keyword, and the remat
  policy (none, saving dots, full) when it takes a ``policy`` keyword (a ``jax.checkpoint``
  policy it applies to its layers).
  The math stays exact: ZeRO++ int8/int4 quantization is searched only with
  ``quantize="search"``, and its candidates are marked lossy. Candidates the cluster's shape
  makes pointless are skipped, the memory formulas drop those whose state alone exceeds
  ``hbm``, the rest are lowered and ranked by predicted time, and the ``max_compiles``
  fastest compiled. With a ``policy`` loss the budget goes layout by layout, the fastest
  layout with each policy first (`zero_jax.gpu.candidates.compile_order`): 3 compiles compare
  every policy of it, the default 4 adds the next layout without remat; a layout that then
  compiles faster than the first under the same policy gets its other policies compiled too,
  beyond ``max_compiles`` (the estimate ranked it too slow). Also beyond ``max_compiles``,
  every exact candidate estimated within 5% of the fastest
  (`zero_jax.gpu.candidates.near_ties`: the estimate leaves out the memory-bound work, so it
  cannot order those) is compiled under the remat policy of the fastest fitting candidate
  compiled by then. Every layout compiled is then compiled under the remat policy of the
  fastest fitting candidate too (`zero_jax.gpu.candidates.at_policy`). The best is never
  slower, by the plan's prediction, than a fitting candidate it compiled. If none of them fits, the leanest candidate's fallbacks (prefetch 0, a
  leaner remat policy, micro-batches, offload, and their combinations) are compiled in that
  order until one fits, its leanest variant first: whether anything fits does not depend on
  ``max_compiles``. Times are predictions; bytes are the compiled programs'. The host memory
  it takes is XLA's compiler's (about 350 MiB per compile in flight for GPT-2 small), not the
  model's: JAX's persistent compilation cache is off while it compiles (compile-only programs
  cannot be read back from it), and back on when it returns.

  Args:
    loss_fn: as for `make_sharded_train_step` (optionally with ``prefetch`` and ``policy``
      keywords, which the planner binds).
    optimizer: the optax transformation.
    init: what ``step.init`` takes: an init function, an (abstract) ``nnx.Module``, or the
      parameters as ``jax.ShapeDtypeStruct``s.
    batch: the global batch, as ``jax.ShapeDtypeStruct``s (or arrays).
    gpu: ``"h100"``, ``"h200"``, ``"a100"`` or a `zero_jax.gpu.Target`.
    hosts: hosts in the cluster (the mesh's first axis, ``"hosts"``, spans them).
    per_host: GPUs per host (the ``"data"`` axis).
    hbm: bytes per device a candidate may hold (default `default_hbm`).
    max_compiles: how many programs to compile for the ranking: the fastest-estimated
      candidates, each with every remat policy when the loss takes ``policy`` (plus the
      other policies of a layout that compiled faster than ranked).
    workers: compiles run in this many threads at once.
    time_limit: seconds after which nothing new is lowered or compiled (a compile in flight
      finishes); the plan then says what was left (``plan.stopped``) and warns. None: no
      limit.
    **fixed: `make_sharded_train_step` options already chosen (``precision="bf16"``,
      ``stacked=``, ...), not searched; ``quantize="search"`` adds ZeRO++ quantization.

  Returns:
    A `Plan`: ``plan.best`` (None when nothing fits; ``plan.closest`` then), ``plan.candidates``,
    ``print(plan)``.
  """
  if "mesh" in fixed:
    raise TypeError("zj.plan builds its own compile-only mesh (hosts x per_host, axes "
                    "('hosts', 'data')); pass hosts= and per_host=, not mesh=.")
  # Every argument is checked before anything is compiled, and all but the fixed options'
  # values before the CUDA plugin is looked for (those are checked by building the steps).
  target = get_target(gpu)
  check_cluster(hosts, per_host)
  _check_hbm(hbm)
  _check_counts(max_compiles=max_compiles, workers=workers)
  _check_inputs(loss_fn, optimizer, batch, time_limit)
  _check_fixed(fixed)
  space = cands.search_space(fixed, hosts=hosts, per_host=per_host,
                             takes_prefetch=cands.takes_keyword(loss_fn, "prefetch"),
                             takes_policy=cands.takes_keyword(loss_fn, "policy"))
  shape, names = cands.mesh_shape(hosts, per_host)
  try:
    mesh = compile_only_mesh(shape, names, gpu=target, hosts=hosts, per_host=per_host)
  except RuntimeError:  # no plugin: a bad fixed option is still named, not hidden behind it
    _check_buildable(loss_fn, optimizer, space, fixed, _stand_in_mesh(hosts, per_host))
    raise
  _check_buildable(loss_fn, optimizer, space, fixed, mesh)
  s = search.Search(loss_fn, optimizer, init, batch, fixed, mesh, target,
                    default_hbm(target) if hbm is None else int(hbm), time_limit=time_limit,
                    hosts=hosts, per_host=per_host)
  rows = max(1, jax.tree.leaves(s.batch)[0].shape[0] // (hosts * per_host))
  with measure.without_persistent_cache():
    done, made_from, ranked_out = search.rank(s, space, max_compiles, workers)
    search.reversed_policies(s, done, made_from, workers)
    if not done and not ranked_out and not s.pruned and not s.stopped:
      raise ValueError(_all_refused(s.refused + s.skipped))
    if not any(c.fits for c in done):
      search.leaner_policies(s, done, made_from, workers)
    root = None if any(c.fits for c in done) else search.leanest_root(s, space)
    if root is not None:
      search.settle(s, root, done, made_from, rows, workers)
  if s.stopped:
    warnings.warn(f"zj.plan {s.stopped}.", RuntimeWarning, stacklevel=2)
  seconds = {"total": time.perf_counter() - s.t0, "lower": s.lower_s, "compile": s.compile_s}
  return Plan(ranked(done), target, hosts, per_host,
              s.hbm, tuple(ranked_out), tuple(s.pruned), tuple(s.refused), seconds,
              loss_fn, optimizer, dict(fixed), tuple(s.skipped), s.stopped,
              tuple(s.estimated))
