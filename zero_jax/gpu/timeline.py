"""A step's time by walking the schedule XLA:GPU compiled: one stream of kernels, shared links.

`zero_jax.gpu.predict.predict_scheduled` hides each group of collectives in flight together
behind the matmuls of their own windows, link by link, and keeps the link that leaves the most
exposed. Where the two links' waits fall at different points of an iteration their exposures
partly add, so that is a lower bound. `simulate` walks each computation instead, in the order
XLA:GPU scheduled it, on the same figures (`zero_jax.gpu.links`, `compute_time`):

- every kernel runs on one stream, one after the other: a matmul at its roofline
  (`zero_jax.gpu.predict.compute_time`), any other kernel its bytes
  (`zero_jax.gpu.program.kernel_bytes`) over HBM bandwidth (in a fused, compiled program);
  ``overlap_slowdown`` slower while a collective is in flight (`predict.overlapped`);
- an async collective joins its link when its start is reached (the collectives on one link
  share its bandwidth equally, each needing the ring time `transfer_time` gives), and the
  stream waits at its done until it has finished; a synchronous one is waited for at once;
- a loop runs its body's time once per trip (a body holds both halves of its collectives),
  while collectives in flight around it progress only as its own leave their link idle;
  a conditional its slowest branch.

Its ``compute`` is the sum of the kernels' times, `predict.predict`'s; the rest of ``step`` is
what the stream waits for collectives. A prediction, not a measurement.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from zero_jax.gpu import predict, timeline
  >>> f = jax.jit(lambda w, x: jnp.tanh(x @ w))
  >>> text = f.lower(jnp.ones((256, 256)), jnp.ones((64, 256))).compile().as_text()
  >>> t = timeline.simulate(text, predict.H100_SXM)
  >>> t.step == t.compute   # no collective: nothing to wait for
  True
"""

from __future__ import annotations

import re
from typing import NamedTuple

from zero_jax.comm import hlo
from zero_jax.comm.hlo import _nbytes, replica_groups  # pylint: disable=protected-access
from zero_jax.gpu import program, schedule
from zero_jax.gpu.links import Device, crosses_hosts, transfer_time
from zero_jax.gpu.predict import compute_time
from zero_jax.gpu.program import _ENTRY, Transfer


class LoopRun(NamedTuple):
  """One ``while`` loop: its body's name, ``trips`` per run, ``runs`` per step, and seconds
  per iteration: ``seconds`` (wall) and ``compute`` (its kernels)."""
  name: str
  trips: int
  runs: int
  seconds: float
  compute: float


class Timeline(NamedTuple):
  """`simulate`'s result, seconds per step: ``step`` (wall), ``compute`` (the kernels' own
  times, no waiting, no slowdown) and each loop's `LoopRun`."""
  step: float
  compute: float
  loops: tuple

  @property
  def waiting(self) -> float:
    """What the step spends beyond its kernels: waits for collectives, and the kernels'
    slowdown while collectives are in flight."""
    return self.step - self.compute


def simulate(hlo_text: str, device: Device, *, compute_efficiency: float = 1.0,
             link_efficiency: float = 1.0, memory_bound_hides: bool = False) -> Timeline:
  """The step's time on ``device``, walking the compiled program's schedule.

  Args:
    hlo_text: ``compiled.as_text()`` of a program compiled for GPUs (compile-only devices
      from `zero_jax.compile_only_mesh`, or real ones).
    device: the accelerator and its links (`zero_jax.gpu.predict.device_from_target`).
    compute_efficiency: the fraction of the matmuls' roofline your kernels reach.
    link_efficiency: the fraction of the links' bandwidth your collectives reach.
    memory_bound_hides: whether collectives progress during the kernels that are not
      matmuls (they do, but contend for HBM with NCCL's copies). False (the default, and
      what BENCHMARKS.md reads): every link pauses while one runs, so only matmuls hide
      communication, as in `zero_jax.gpu.predict.predict_scheduled`.

  Returns:
    A `Timeline`.
  """
  if not isinstance(device, Device):
    raise TypeError(f"device must be a zero_jax.gpu.predict.Device, got {type(device).__name__}"
                    f" {getattr(device, 'name', device)!r}: for a target, pass "
                    f"zero_jax.gpu.predict.device_from_target(target)")
  entry = _ENTRY.search(hlo_text)
  if entry is None:
    raise ValueError("no ENTRY computation in this text: pass a whole HLO module's text, "
                     "e.g. step.lower(state, batch).compile().as_text()")
  comps = hlo._computations(hlo_text)  # pylint: disable=protected-access
  fused = re.search(r"\sfusion\(", hlo_text) is not None
  walk = _Walk(comps, device, compute_efficiency, link_efficiency, fused, memory_bound_hides)
  seconds, compute, _ = walk.run(entry.group(1), 1)
  return Timeline(seconds, compute, tuple(walk.loops))


class _Links:
  """The collectives in flight, per link: each link's bandwidth shared equally by those on it
  (NCCL's kernels for concurrent collectives run side by side), so a link stays busy until
  the sum of their remaining ring times has passed."""

  def __init__(self):
    self.jobs: dict = {}  # link -> {collective: seconds left at the link's full rate}

  def start(self, link, seconds: float, name: str) -> None:
    self.jobs.setdefault(link, {})[name] = seconds

  def busy(self) -> float:
    """Seconds until every collective in flight has finished."""
    return max((sum(j.values()) for j in self.jobs.values()), default=0.0)

  def until(self, name: str) -> float:
    """Seconds until collective ``name`` finishes (no new one starts meanwhile: the stream
    waits for it). Shared equally, the k-th shortest of n finishes after
    sum_{i<=k} (left_i - left_{i-1}) (n - i + 1)."""
    jobs = next((j for j in self.jobs.values() if name in j), None)
    if jobs is None:  # finished already
      return 0.0
    left = sorted(jobs.values())
    mine, wall, before = jobs[name], 0.0, 0.0
    for i, x in enumerate(left):
      wall += (x - before) * (len(left) - i)
      before = x
      if x >= mine:
        return wall
    return wall

  def advance(self, seconds: float, taken: dict | None = None) -> None:
    """``seconds`` of wall time pass: each link's collectives progress at their share of
    what ``taken`` (link -> seconds) leaves of it."""
    for link, jobs in self.jobs.items():
      left = seconds - (taken or {}).get(link, 0.0)
      while jobs and left > 0:
        share = min(left, min(jobs.values()) * len(jobs))
        jobs = {n: x - share / len(jobs) for n, x in jobs.items()}
        jobs = {n: x for n, x in jobs.items() if x > 1e-15}
        left -= share
      self.jobs[link] = jobs


def _slowed(cost: float, busy: float, slowdown: float) -> float:
  """A kernel's wall time: ``slowdown`` times slower while collectives are in flight (for
  ``busy`` seconds more; `zero_jax.gpu.predict.overlapped`)."""
  if busy <= 0:
    return cost
  if cost * slowdown <= busy:
    return cost * slowdown
  return busy + (cost - busy / slowdown)


class _Walk:
  """Walks computations in schedule order (see `simulate`); ``loops`` collects the loops."""

  def __init__(self, comps: dict, device: Device, compute_efficiency: float,
               link_efficiency: float, fused: bool, memory_bound_hides: bool):
    self.comps, self.device, self.fused = comps, device, fused
    self.memory_bound_hides = memory_bound_hides
    self.compute_efficiency, self.link_efficiency = compute_efficiency, link_efficiency
    self.loops: list = []

  def matmuls(self, dots) -> float:
    return compute_time(dots, self.device, self.compute_efficiency) if dots else 0.0

  def kernel(self, ins: hlo.Instruction, shapes: dict) -> tuple[float, bool]:
    """Seconds of one instruction as a kernel (0 for views, collectives, control flow), and
    whether it is a matmul."""
    if ins.op == "dot" or schedule._is_gemm_call(ins):  # pylint: disable=protected-access
      return self.matmuls([schedule.dot_cost(ins, shapes)]), True
    dots = [d for c in ins.called for d in schedule.matmuls(self.comps, c)] \
        if ins.op == "fusion" else []
    if dots:
      return self.matmuls(dots), True
    if not self.fused:
      return 0.0, False
    return program.kernel_bytes(self.comps, ins, shapes) / self.device.hbm_bandwidth, False

  def run(self, name: str, runs: int) -> tuple[float, float, dict]:
    """``(seconds, compute seconds, {link: seconds of its collectives' ring time})`` of one
    run of computation ``name``."""
    instrs = [i for i in map(hlo.parse_instruction, self.comps.get(name, [])) if i]
    starts = {w.name: w for w in schedule.windows(self.comps, name)}
    shapes: dict = {}
    now = compute = 0.0
    links = _Links()
    used: dict = {}  # link -> ring seconds of the collectives of this run, nested ones included

    def start(t: Transfer, collective: str) -> None:
      link, seconds = self.link(t)
      links.start(link, seconds, collective)
      used[link] = used.get(link, 0.0) + seconds

    def wait(collective: str) -> float:
      seconds = links.until(collective)
      links.advance(seconds)
      return seconds

    def nested(seconds: float, inner: float, busy: dict, times: int = 1) -> None:
      """A loop or call ran: collectives in flight around it progress only while its own
      leave their link idle."""
      nonlocal now, compute
      links.advance(times * seconds, {k: times * v for k, v in busy.items()})
      for k, v in busy.items():
        used[k] = used.get(k, 0.0) + times * v
      now, compute = now + times * seconds, compute + times * inner

    for ins in instrs:
      schedule._shape_of(ins, shapes)  # pylint: disable=protected-access
      body = re.search(r"\bbody=%?([\w.\-]+)", ins.line)
      branches = hlo._BRANCHES.search(ins.line)  # pylint: disable=protected-access
      if ins.name in starts:
        w = starts[ins.name]
        start(Transfer(w.op, float(w.nbytes), tuple(w.groups or ())), ins.name)
      elif ins.op.endswith("-done") and ins.operands and ins.operands[0] in starts:
        now += wait(ins.operands[0])
      elif ins.op in schedule.COLLECTIVES:  # synchronous: shares its link, then the stream goes on
        start(Transfer(ins.op, float(_nbytes(ins.shape_text)),
                       tuple(replica_groups(ins.line) or ())), ins.name)
        now += wait(ins.name)
      elif ins.op == "while" and body:
        trips = program._trips(self.comps, ins)  # pylint: disable=protected-access
        seconds, inner, busy = self.run(body.group(1), runs * trips)
        self.loops.append(LoopRun(body.group(1), trips, runs, seconds, inner))
        nested(seconds, inner, busy, trips)
      elif branches:  # the slowest branch, and only its loops
        got = []
        for c in (b.strip().lstrip("%") for b in branches.group(1).split(",")):
          first = len(self.loops)
          got.append((self.run(c, runs), self.loops[first:]))
          del self.loops[first:]
        slowest, loops = max(got, key=lambda g: g[0][:2])
        self.loops += loops
        nested(*slowest)
      elif ins.op == "call":
        for c in ins.called:
          nested(*self.run(c, runs))
      else:
        cost, matmul = self.kernel(ins, shapes)
        compute += cost
        if matmul or self.memory_bound_hides:
          seconds = _slowed(cost, links.busy(), self.device.overlap_slowdown)
          links.advance(seconds)
          now += seconds
        else:  # the links make no progress meanwhile
          now += cost
    return now + links.busy(), compute, used

  def link(self, t: Transfer) -> tuple[bool, float]:
    return crosses_hosts(t, self.device), transfer_time(t, self.device, self.link_efficiency)
