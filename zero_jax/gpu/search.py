"""How `zero_jax.plan` searches: rank by prediction, compile the fastest, then settle the fit.

Two phases, both on one `Search` (the inputs, the compile-only mesh and what was found):

1. **Rank** (`rank`): each candidate of the search space is judged by the cluster's shape
   (`zero_jax.gpu.candidates.pointless`), built (`make_sharded_train_step` may refuse it),
   bounded by the memory formulas (a state over the budget is tried offloaded), lowered and
   its step time estimated; the ``max_compiles`` fastest are compiled (`compile`). With a
   loss taking ``policy``, the remat policy is ranked by compiling, since only the compiled
   program shows the memory-bound work a policy saves: the budget goes to the fastest-ranked
   layout with each policy, then the next layout (`zero_jax.gpu.candidates.compile_order`).
   Beyond the budget, every exact candidate estimated within
   `zero_jax.gpu.candidates.NEAR_TIE` of the fastest exact one is compiled too, under the
   remat policy of the fastest fitting candidate compiled by then (`_compile_ties`,
   `zero_jax.gpu.candidates.near_ties`: the estimate has no memory-bound work, so it cannot
   order those). Where a layout compiled under one policy beat, under the same policy, a layout whose
   every policy was compiled (the estimate ranked them the wrong way round), its other
   policies are compiled too, beyond ``max_compiles`` (`reversed_policies`).
2. **Fit**, only when none of those fits, whatever ``max_compiles`` was: first those compiled,
   each with a leaner remat policy (`leaner_policies`, when the loss takes ``policy``); if
   none fits (`settle`), the leanest candidate of the space (smallest state by the formulas)
   and its fallbacks
   (`zero_jax.gpu.candidates.fallbacks`: prefetch 0, leaner remat policies, micro-batches,
   offload, and their combinations). Its leanest variant is compiled first: if that does not
   fit, nothing does, and it is the closest. Otherwise the variants are compiled in order
   until one fits; a variant that holds at least what a compiled misfit holds is skipped.

A time bound holds throughout: once ``time_limit`` seconds have passed, nothing new is lowered
or compiled (a compile in flight finishes) and `Search.stopped` says what was left. Progress
goes to the ``zero_jax.plan`` logger at INFO (``logging.basicConfig(level=logging.INFO)`` shows
it): each compile as it ends, and when the fallbacks start.

Example (needs JAX's CUDA plugin; `zero_jax.plan` drives it):
  >>> s = Search(loss_fn, optax.adamw(3e-4), init, batch, {}, mesh, H100, hbm,
  ...            time_limit=600)                                             # doctest: +SKIP
  >>> done, ranked_out = rank(s, space, max_compiles=4, workers=2)           # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import jax
import numpy as np
from flax import nnx

from zero_jax.gpu import candidates as cands
from zero_jax.gpu import measure
from zero_jax.gpu.candidates import Candidate
from zero_jax.step import init as init_lib

log = logging.getLogger("zero_jax.plan")


class Search:
  """The state of one planning run: its inputs, and what was refused, pruned, skipped and
  compiled so far."""

  def __init__(self, loss_fn, optimizer, init, batch, fixed, mesh, target, hbm, *,
               time_limit: float | None, hosts: int, per_host: int):
    self.t0 = time.perf_counter()
    self.loss_fn, self.optimizer, self.fixed = loss_fn, optimizer, fixed
    self.mesh, self.target, self.hbm, self.time_limit = mesh, target, hbm, time_limit
    self.hosts, self.per_host = hosts, per_host
    self.device = measure.device_for(target, mesh.devices.shape[-1],
                                     fixed.get("precision", "fp32"))
    source = init_lib.resolve(init, None, fixed.get("wrt", nnx.Param))
    self.params = source.params
    self.state_from = init if source.module is not None else source.params
    self.batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
    self.refused, self.pruned, self.skipped, self.bounds = [], [], [], []
    self.estimated = []  # (options, estimated seconds) of each lowered candidate ranked
    self.lower_s = self.compile_s = 0.0
    self.stopped = None

  def out_of_time(self, left: str) -> bool:
    """Whether ``time_limit`` has passed; the first time, `stopped` records ``left``."""
    if self.time_limit is None or time.perf_counter() - self.t0 < self.time_limit:
      return False
    if self.stopped is None:
      self.stopped = (f"stopped at time_limit={self.time_limit:g} s with {left} left: pass a "
                      f"larger time_limit=, fewer hosts to compare, or fix options (stage=, "
                      f"hpz_axis=, a bound prefetch) so that fewer candidates are searched")
    return True

  def prepare(self, opts: dict, *, prune: bool = True):
    """``(step, host bytes)``, or None (pointless, refused, or pruned by the formulas when
    ``prune``; recorded). Compile-only GPUs have no host memory: an offload candidate's step
    is built without offload, and `candidate` takes the host part out of its bytes."""
    why = cands.pointless(opts, self.fixed, hosts=self.hosts, per_host=self.per_host)
    if why:
      self.skipped.append((opts, why))
      return None
    try:
      step = measure.build_step(self.loss_fn, self.optimizer,
                                {k: v for k, v in opts.items() if k != "offload"},
                                self.mesh, self.fixed)
    except ValueError as e:
      self.refused.append((opts, str(e).split(". ")[0]))
      return None
    dev, host = cands.lower_bound(self.params, self.optimizer, self.mesh, opts, self.fixed)
    if prune and dev > self.hbm:
      self.pruned.append((opts, dev))
      return None
    return step, host

  def lower(self, step):
    t0 = time.perf_counter()
    lowered = step.lower(step.abstract_state(self.state_from), self.batch)
    self.lower_s += time.perf_counter() - t0
    return lowered

  def candidate(self, opts: dict, lowered, host: int) -> Candidate:
    """``opts`` compiled for the target and read (an offloaded state's bytes moved to the
    host, its PCIe copies added to the time)."""
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options=measure.FAST_COMPILE)
    self.compile_s += time.perf_counter() - t0
    r = measure.read(compiled, self.device)
    log.info("zj.plan: compiled %s in %.0f s: %.3g GiB per device, predicted %.3g ms "
             "(%.0f s so far)", cands.describe(opts), time.perf_counter() - t0,
             r.memory.peak / 2**30, r.step_s * 1e3, time.perf_counter() - self.t0)
    offload = bool(opts.get("offload"))
    extra = measure.offload_s(host, self.target) if offload else 0.0
    options = {**self.fixed, **{k: v for k, v in opts.items() if k not in cands.KEYWORDS},
               "mesh": self.mesh}
    return Candidate(options, opts.get("prefetch"), r.memory.peak - (host if offload else 0),
                     host if offload else 0, self.hbm, r.step_s + extra, r.compute_s,
                     r.intra_bytes, r.cross_bytes, r.memory, exact=not offload,
                     policy=opts.get("policy"), elementwise_s=r.elementwise_s,
                     loss_keywords=measure.loss_keywords(opts))

  def compile(self, jobs: list, workers: int) -> list:
    """``(options, candidate)`` of ``jobs`` (``(options, lowered, host bytes)``) compiled in
    ``workers`` threads, in order; those not started before the time bound are left out."""
    def one(o, low, host):
      if self.out_of_time(f"queued compiles not started (of {len(jobs)})"):
        return None
      return self.candidate(o, low, host)

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
      futures = [(o, pool.submit(one, o, low, host)) for o, low, host in jobs]
      return [(o, c) for o, c in ((o, f.result()) for o, f in futures) if c is not None]


def _with_exact(ready: list, k: int) -> list:
  """The ``k`` fastest of ``ready`` (sorted ``(time, options, ...)``), the fastest exact one
  among them when any is exact: a lossy candidate is best only if its compiled prediction
  beats it (the lowered estimates leave quantization's elementwise work out)."""
  top = ready[:k]
  if any(not cands.lossy(r[1]) for r in top):
    return top
  exact = next((r for r in ready[k:] if not cands.lossy(r[1])), None)
  return top[:k - 1] + [exact] if exact is not None else top


def _drop_programs(ready: list, k: int) -> None:
  """Frees the lowered programs of ``ready`` that `_with_exact` will not compile."""
  keep = {id(r) for r in _with_exact(ready, k)}
  ready[:] = [r if id(r) in keep else (r[0], r[1], None, r[3]) for r in ready]


def rank(s: Search, space: list, max_compiles: int, workers: int) -> tuple[list, list, list]:
  """Phase 1: ``(compiled candidates, their options, ranked out)``; ranked out are
  ``(options, estimated seconds)`` lowered but not compiled. With a ``policy`` loss the
  budget is spent as `zero_jax.gpu.candidates.compile_order` says (the fastest-ranked layout
  with every remat policy first); variants it leaves out are recorded as skipped. Near ties
  (`zero_jax.gpu.candidates.near_ties`) are compiled after the budget (`_compile_ties`);
  ``s.estimated`` gets every estimate."""
  ready = []
  k = cands.layouts_to_compile(max_compiles, space[0]) if space else max_compiles
  log.info("zj.plan: lowering up to %d candidates, then compiling %d of the fastest",
           len(space), max_compiles)
  for i, opts in enumerate(space):
    if s.out_of_time(f"{len(space) - i} of {len(space)} candidates not lowered"):
      break
    got = s.prepare(opts)
    if got is None and "offload" not in s.fixed and s.pruned and s.pruned[-1][0] is opts:
      opts = {**opts, "offload": "optimizer"}  # the state does not fit: try it offloaded
      got = s.prepare(opts)
    if got is not None:
      low = s.lower(got[0])
      t = measure.estimate(low, s.device, opts.get("prefetch"))
      if opts.get("offload"):
        t += measure.offload_s(got[1], s.target)
      ready.append((t, opts, low, got[1]))
      s.estimated.append((opts, t))
      ready.sort(key=lambda r: r[0])
      _drop_programs(ready, k)  # host memory: only those to compile keep theirs
  chosen = _with_exact(ready, k)
  pairs = s.compile(_policy_jobs(s, chosen, max_compiles), workers)
  done, made_from = [c for _, c in pairs], [o for o, _ in pairs]
  ties = [o for o in cands.near_ties([(t, o) for t, o, _, _ in ready])
          if all(o is not c[1] for c in chosen)]
  if ties and done:
    _compile_ties(s, ties, done, made_from, workers)
  taken = [c[1] for c in chosen] + ties
  ranked_out = [(o, t) for t, o, _, _ in ready if all(o is not c for c in taken)]
  return done, made_from, ranked_out


def _fastest_fitting(done: list, made_from: list) -> dict | None:
  """The options of the fastest fitting compiled candidate, or None when none fits."""
  fit = [(c.step_time_s, o) for c, o in zip(done, made_from) if c.fits]
  return min(fit, key=lambda x: x[0])[1] if fit else None


def _compile_ties(s: Search, ties: list, done: list, made_from: list, workers: int) -> None:
  """The near ties (`zero_jax.gpu.candidates.near_ties`: layouts the estimate cannot order)
  compiled beyond ``max_compiles``, each under the remat policy of the fastest fitting
  candidate compiled so far (the smallest when none fits): the question is whether it beats
  that candidate, so it is asked there, one compile per tie; `reversed_policies` then adds
  its other policies where it does. Appends to ``done`` and ``made_from``."""
  lead = (_fastest_fitting(done, made_from) or
          min(zip(done, made_from), key=lambda x: x[0].bytes_per_device)[1])
  at = {"policy": lead["policy"]} if "policy" in lead else {}
  todo = [{**o, **at} for o in ties]
  for o in todo:
    s.skipped += [(v, f"not compiled: a near tie by the estimate (within "
                      f"{cands.NEAR_TIE:.0%} of the fastest), compiled under the fastest "
                      f"candidate's remat policy only (its others follow where it beats that "
                      f"layout)") for v in cands.policy_variants(o) if v != o]
  if s.out_of_time(f"{len(todo)} near ties by the estimate"):
    return
  log.info("zj.plan: %d more candidates estimated within %.0f%% of the fastest, compiled "
           "beyond max_compiles", len(todo), 100 * cands.NEAR_TIE)
  _compile_more(s, todo, done, made_from, workers)
  s.skipped[:] = [(o, why) for o, why in s.skipped if o not in made_from]


def _policy_jobs(s: Search, chosen: list, max_compiles: int) -> list:
  """The compile jobs ``(options, lowered, host bytes)`` of ``chosen`` (ranked ``(time,
  options, lowered, host)``) and their remat policies, in `compile_order`'s order; the
  variants past ``max_compiles`` are recorded in ``s.skipped``."""
  todo, left = cands.compile_order([o for _, o, _, _ in chosen], max_compiles)
  for o in left:
    s.skipped.append((o, f"not compiled: max_compiles={max_compiles} went to layouts ranked "
                         f"faster and their remat policies (a larger max_compiles compares it)"))
  jobs = []
  for o in todo:
    root = next((r for r in chosen if r[1] == o), None)
    if root is not None:  # the ranked layout itself: its program is lowered already
      jobs.append((root[1], root[2], root[3]))
      continue
    got = s.prepare(o)
    if got is not None and not s.out_of_time("remat policies not lowered"):
      jobs.append((o, s.lower(got[0]), got[1]))
  return jobs


def _compile_more(s: Search, options: list, done: list, made_from: list, workers: int) -> list:
  """``(options, candidate)`` of those of ``options`` that build, lowered and compiled;
  appended to ``done`` and ``made_from``."""
  jobs = []
  for o in options:
    got = s.prepare(o)
    if got is not None:
      jobs.append((o, s.lower(got[0]), got[1]))
  pairs = s.compile(jobs, workers)
  done.extend(c for _, c in pairs)
  made_from.extend(o for o, _ in pairs)
  return pairs


def reversed_policies(s: Search, done: list, made_from: list, workers: int) -> None:
  """After phase 1: where a compiled layout beat, under the same remat policy, one whose every
  policy was compiled (the lowered estimate ranked them the wrong way round), its other
  policies are compiled too (`zero_jax.gpu.candidates.reversed_layouts`), and every compiled
  layout under the remat policy of the fastest fitting candidate so far
  (`zero_jax.gpu.candidates.at_policy`), until no such variant is left: beyond
  ``max_compiles``, so that the best is never slower, by the plan's own prediction, than a
  layout it compiled under the policy that made the best fast. Appends to ``done`` and
  ``made_from``."""
  while not s.out_of_time("remat policies of layouts the estimate ranked too slow"):
    todo = cands.reversed_layouts([(o, c.step_time_s) for c, o in zip(done, made_from)])
    lead = _fastest_fitting(done, made_from)
    if lead is not None and "policy" in lead:
      todo += cands.at_policy(made_from, lead["policy"])
    todo = [o for i, o in enumerate(todo) if o not in made_from and o not in todo[:i]]
    if not todo:
      return
    log.info("zj.plan: %d remat policies of layouts that compiled faster than ranked", len(todo))
    pairs = _compile_more(s, todo, done, made_from, workers)
    s.skipped[:] = [(o, why) for o, why in s.skipped if o not in made_from]
    if len(pairs) < len(todo):  # refused, pruned or out of time: not tried again
      return


def leaner_policies(s: Search, done: list, made_from: list, workers: int) -> None:
  """Between the phases, when none of the compiled fits and the loss takes ``policy``: those
  compiled, each with the next leaner remat policy (`zero_jax.gpu.candidates.POLICIES`), all
  at once, until some fit or no leaner policy is left. Activations are what a policy changes,
  so the fastest layouts get their chance before the leanest candidate's fallbacks (which
  found only the leanest layout's variants: flat ZeRO-3 across 32 hosts for an 8B model where
  hybrid fits keeping the matmuls' outputs). Appends to ``done`` and ``made_from``."""
  current = [o for c, o in zip(done, made_from) if not c.fits and "policy" in o]
  while current and not any(c.fits for c in done):
    nxt = []
    for o in current:
      i = cands.POLICIES.index(o["policy"])
      if i + 1 < len(cands.POLICIES):
        leaner = {**o, "policy": cands.POLICIES[i + 1]}
        if leaner not in made_from and leaner not in nxt:
          nxt.append(leaner)
    if not nxt or s.out_of_time(f"{len(nxt)} leaner remat policies"):
      return
    log.info("zj.plan: none fits; %d of those compiled with a leaner remat policy", len(nxt))
    pairs = _compile_more(s, nxt, done, made_from, workers)
    current = [o for o, c in pairs if not c.fits]


def leanest_root(s: Search, space: list) -> dict | None:
  """The candidate of ``space`` whose state is smallest by the formulas (the first such in
  the space's order), not pointless and not refused; None if there is none."""
  best = None
  for opts in space:
    if cands.pointless(opts, s.fixed, hosts=s.hosts, per_host=s.per_host):
      continue
    try:
      measure.build_step(s.loss_fn, s.optimizer, opts, s.mesh, s.fixed)
    except ValueError:
      continue
    dev = cands.lower_bound(s.params, s.optimizer, s.mesh, opts, s.fixed)[0]
    if best is None or dev < best[0]:
      best = (dev, opts)
  return None if best is None else best[1]


def _dominated(levels: tuple, misfits: list) -> dict | None:
  """A compiled misfit at least as lean as ``levels`` on every axis, or None."""
  return next((o for lv, o in misfits if all(a <= b for a, b in zip(levels, lv))), None)


def settle(s: Search, root: dict, done: list, made_from: list, rows: int, workers: int) -> None:
  """Phase 2 (see the module docstring): compiles ``root``'s fallbacks until one fits or none
  can; appends each compiled candidate and its options to ``done`` and ``made_from``."""
  chain = cands.fallbacks(root, rows, s.fixed)
  log.info("zj.plan: none of the %d compiled fits; %d fallbacks of %s, the leanest first",
           len(done), len(chain), cands.describe(root))
  tried, misfits = set(), []
  for i, (lv, o) in enumerate(chain):
    if o in made_from:
      tried.add(i)
      if not done[made_from.index(o)].fits:
        misfits.append((lv, o))

  def run(entries: list, prune: bool) -> list:  # the candidates compiled from chain[entries]
    jobs = []
    for i in entries:
      lv, o = chain[i]
      tried.add(i)
      pruned = len(s.pruned)
      got = s.prepare(o, prune=prune)
      if got is None and len(s.pruned) > pruned:  # over the budget by the formulas alone
        misfits.append((lv, o))
      elif got is not None:
        jobs.append((lv, o, s.lower(got[0]), got[1]))
    pairs = s.compile([(o, low, host) for _, o, low, host in jobs], workers)
    level = {id(o): lv for lv, o, _, _ in jobs}
    done.extend(c for _, c in pairs)
    made_from.extend(o for o, _ in pairs)
    misfits.extend((level[id(o)], o) for o, c in pairs if not c.fits)
    return [c for _, c in pairs]

  # The leanest variant first (the last the step accepts), compiled even if the formulas rule
  # it out: if it does not fit, nothing leaner exists, and it is the nearest miss.
  for i in reversed(range(len(chain))):
    if i in tried:
      if not done[made_from.index(chain[i][1])].fits:
        return
      break
    if s.out_of_time("the leanest fallback not compiled"):
      return
    new = run([i], prune=False)
    if new:
      if not new[0].fits:
        return
      break
  todo = [i for i in range(len(chain)) if i not in tried]
  while todo:
    batch = []
    while todo and len(batch) < max(1, workers):
      i = todo.pop(0)
      worse = _dominated(chain[i][0], misfits)
      if worse is None:
        batch.append(i)
      else:
        s.skipped.append((chain[i][1], f"holds at least what {cands.describe(worse)} holds, "
                                       f"which does not fit"))
    if batch and (s.out_of_time(f"{len(batch) + len(todo)} fallbacks")
                  or any(c.fits for c in run(batch, True))):
      return
