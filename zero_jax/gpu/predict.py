"""A model of how much communication a step leaves exposed, for hardware we cannot run.

`analyze` (`zero_jax.gpu.program`) reads a program's HLO text: its loops (with their trip
counts), the matmul flops and bytes of each loop's iteration, the bytes its other kernels read
and write, and the collectives it issues with their bytes and device groups. `predict` puts
that on a `Device` (peak flops, HBM bandwidth, the links within and between hosts) and returns
each loop's compute and communication time per iteration and the step's time under two
schedules:

- **prefetch 0** (serial): each layer waits for its gather, computes, then waits for its
  gradient's reduce-scatter (and cross-host hop): ``n * (C + G + R)`` per loop.
- **prefetch 1** (overlapped, ``zj.scan``): layer i+1's gather and layer i-1's reduce-scatter
  run on the communication stream while layer i computes: ``G + sum_i max(C, comm_i) + R``,
  where the first gather (fill) and the last reduce-scatter (drain) stay exposed.

A collective costs what a ring costs: ``(n-1)/n`` of its whole buffer over the link (twice for
an all-reduce) plus a latency per ring step; a group that spans hosts runs at the cross-host
link's speed. Collectives run one at a time on one stream, compute on another. Compute time is
each matmul's roofline, ``max(flops / peak, bytes / HBM bandwidth)``, plus the bytes the other
kernels (elementwise work, reductions, copies: quantizing and dequantizing, the optimizer
update) move over HBM bandwidth, counted where the program is fused (a compiled program).
Scale ``peak_flops`` (and the links) to what your software reaches (``compute_efficiency``,
``link_efficiency``). These are predictions, not measurements; any program ``jax.jit``
compiles can be read, not only zero_jax's steps.

`predict_scheduled` reads instead the program XLA:GPU compiled (on `zero_jax.compile_only_mesh`
devices, no GPU needed): each async collective's exposed time is its ring time less the
matmuls XLA:GPU actually scheduled inside its window. `device_from_target` makes a `Device`
of a `zero_jax.gpu.Target`.

Feed `analyze` the program compiled for the target (``.compile().as_text()`` on a
`zero_jax.compile_only_mesh`: fused kernels, the dtypes the GPU runs), or the lowered program,
``step.lower(state, batch).as_text(dialect="hlo")``: it keeps the dtypes the program asks for
(XLA:CPU's compiled program carries half-precision collectives and matmuls in float32) and
needs no device of the target kind, but is not fused, so its elementwise work is left out.
Both schedules are derived from one program; give it today's (prefetch 0), whose loops gather
and reduce their own layer.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> from zero_jax.gpu import predict as overlap
  >>> def loss_fn(p, b):
  ...   def layer(h, w):
  ...     return jnp.tanh(h @ zj.gather(w)), None
  ...   h, _ = jax.lax.scan(jax.checkpoint(layer), b["x"], p["w"])
  ...   return jnp.mean(h ** 2)
  >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), stage=3, stacked=True,
  ...                                   mesh=jax.make_mesh((8,), ("data",)))
  >>> params = {"w": jax.ShapeDtypeStruct((4, 256, 256), jnp.float32)}
  >>> batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
  >>> text = step.lower(step.abstract_state(params), batch).as_text(dialect="hlo")
  >>> program = overlap.analyze(text)  # forward: 2 * 8 rows * 256 * 256 flops a layer
  >>> [(l.trips, l.flops, [t.op for t in l.transfers]) for l in program.loops]
  [(4, 1048576.0, ['all-gather']), (4, 3145728.0, ['all-gather', 'reduce-scatter'])]
  >>> p = overlap.predict(program, overlap.H100_SXM)
  >>> p.step(prefetch=1) < p.step(prefetch=0)
  True
"""

from __future__ import annotations

import re
from typing import NamedTuple

from zero_jax.comm import hlo
from zero_jax.gpu import schedule
from zero_jax.gpu.program import _ENTRY, Loop, Transfer, analyze  # noqa: F401  (re-exported)
from zero_jax.gpu.targets import H100, Target


class Link(NamedTuple):
  """A link as one device sees it: ``bandwidth`` in bytes/s each way, ``latency`` in s
  per ring step."""
  bandwidth: float
  latency: float


class Device(NamedTuple):
  """What `predict` needs to know about one accelerator and its links.

  Attributes:
    name: for tables.
    peak_flops: dense matmul flops/s in the program's compute dtype.
    hbm_bandwidth: memory bandwidth, bytes/s.
    intra: the link between devices of one host.
    cross: each device's share of the network between hosts.
    devices_per_host: devices ``0 .. k-1`` are one host, ``k .. 2k-1`` the next, ...
  """
  name: str
  peak_flops: float
  hbm_bandwidth: float
  intra: Link
  cross: Link
  devices_per_host: int = 8


def device_from_target(target: Target, devices_per_host: int = 8) -> Device:
  """The `Device` of a `zero_jax.gpu.Target`: its dense bf16 peak, HBM bandwidth and links."""
  return Device(target.name, target.peak_flops, target.hbm_bandwidth,
                intra=Link(target.intra_bandwidth, target.intra_latency),
                cross=Link(target.cross_bandwidth, target.cross_latency),
                devices_per_host=devices_per_host)


# NVIDIA's H100 SXM datasheet (`zero_jax.gpu.H100`): 989 TFLOP/s dense bf16, 3.35 TB/s HBM3,
# NVLink 450 GB/s each way, one 400 Gb/s NDR port per GPU, 8 GPUs a host.
H100_SXM = device_from_target(H100)._replace(name="H100 SXM")


# ------------------------------------------------------------------ timing
def crosses_hosts(t: Transfer, device: Device) -> bool:
  """Whether one of ``t``'s device groups spans more than one of ``device``'s hosts."""
  return any(len({d // device.devices_per_host for d in g}) > 1 for g in t.groups)


def _link(t: Transfer, device: Device) -> tuple[int, Link]:
  """The group size and the link it runs at (the cross-host one if a group spans hosts)."""
  n = max((len(g) for g in t.groups), default=1)
  return n, device.cross if crosses_hosts(t, device) else device.intra


def transfer_time(t: Transfer, device: Device, link_efficiency: float = 1.0) -> float:
  """Seconds a ring algorithm needs for ``t`` on ``device``'s links (0 for one device).

  Per device, a ring sends ``(n-1)/n`` of the whole buffer in ``n-1`` steps: the result for
  an all-gather, the operand (``n`` results) for a reduce-scatter, the buffer twice for an
  all-reduce (a reduce-scatter then an all-gather); an all-to-all sends ``(n-1)/n`` of its
  buffer, a collective-permute all of it in one step.
  """
  n, link = _link(t, device)
  if n <= 1:
    return 0.0
  wire, steps = {"all-gather": ((n - 1) / n * t.nbytes, n - 1),
                 "reduce-scatter": ((n - 1) * t.nbytes, n - 1),
                 "all-reduce": (2 * (n - 1) / n * t.nbytes, 2 * (n - 1)),
                 "all-to-all": ((n - 1) / n * t.nbytes, n - 1),
                 "collective-permute": (t.nbytes, 1)}[t.op]
  return wire / (link.bandwidth * link_efficiency) + steps * link.latency


def compute_time(dots, device: Device, compute_efficiency: float = 1.0) -> float:
  """Seconds for ``dots`` (``(flops, bytes)`` pairs), each at its roofline."""
  return sum(max(f / (device.peak_flops * compute_efficiency), b / device.hbm_bandwidth)
             for f, b in dots)


class LoopTime(NamedTuple):
  """One innermost loop on a device. Seconds per iteration: ``compute`` (matmuls and the
  memory-bound kernels: ``elementwise`` of it), ``gather`` (all-gathers: what prefetching
  issues one layer early), ``reduce`` (the other collectives: issued one layer late),
  ``cross_host`` (the part of ``gather + reduce`` on the cross-host link); ``runs``: times
  the loop runs per step."""
  name: str
  trips: int
  runs: int
  compute: float
  gather: float
  reduce: float
  cross_host: float
  elementwise: float = 0.0

  def total(self, prefetch: int) -> float:
    """Seconds for one run: serial (0), or overlapped one layer ahead (1)."""
    n, c, g, r = self.trips, self.compute, self.gather, self.reduce
    if not prefetch or n == 1:
      return n * (c + g + r)
    middle = sum(max(c, (g if i < n - 1 else 0.0) + (r if i > 0 else 0.0)) for i in range(n))
    return g + middle + r


class Prediction(NamedTuple):
  """`predict`'s result: the innermost loops, and the rest of the step (``serial``: compute
  and collectives outside them, one after the other; ``serial_elementwise``: the part of
  ``serial_compute`` that memory-bound kernels take). Seconds."""
  device: Device
  loops: tuple
  serial_compute: float
  serial_comm: float
  serial_elementwise: float = 0.0

  @property
  def compute(self) -> float:
    """The step's compute time (all matmuls and memory-bound kernels)."""
    return self.serial_compute + sum(l.runs * l.trips * l.compute for l in self.loops)

  @property
  def elementwise(self) -> float:
    """The part of `compute` spent in memory-bound kernels (bytes over HBM bandwidth)."""
    return self.serial_elementwise + sum(l.runs * l.trips * l.elementwise for l in self.loops)

  def step(self, prefetch: int) -> float:
    """The step's time with every innermost loop prefetching ``prefetch`` (0 or 1)."""
    return (self.serial_compute + self.serial_comm
            + sum(l.runs * l.total(prefetch) for l in self.loops))

  def exposed(self, prefetch: int) -> float:
    """Communication time not hidden behind compute."""
    return self.step(prefetch) - self.compute


def predict(program: Loop, device: Device, *, compute_efficiency: float = 1.0,
            link_efficiency: float = 1.0) -> Prediction:
  """The step's time on ``device`` under both schedules (see the module docstring).

  Args:
    program: what `analyze` returned.
    device: the accelerator and its links (e.g. `H100_SXM`).
    compute_efficiency: the fraction of ``peak_flops`` your matmuls reach.
    link_efficiency: the fraction of the links' bandwidth your collectives reach.

  Returns:
    A `Prediction`: per innermost loop (each layer scan) the compute and communication
    time of one iteration, and the step's time with prefetch 0 and 1.
  """
  loops: list = []
  serial = [0.0, 0.0, 0.0]
  comm = lambda ts: [transfer_time(t, device, link_efficiency) for t in ts]

  def visit(loop: Loop, runs: int) -> None:
    memory = loop.elementwise_bytes / device.hbm_bandwidth
    own_compute = compute_time(loop.dots, device, compute_efficiency) + memory
    if loop.loops or loop.trips == 1:  # an outer loop (or the program): its own part is serial
      serial[0] += runs * loop.trips * own_compute
      serial[1] += runs * loop.trips * sum(comm(loop.transfers))
      serial[2] += runs * loop.trips * memory
      for inner in loop.loops:
        visit(inner, runs * loop.trips)
      return
    times = comm(loop.transfers)
    gather = sum(s for t, s in zip(loop.transfers, times) if t.op == "all-gather")
    cross = sum((s for t, s in zip(loop.transfers, times) if crosses_hosts(t, device)), 0.0)
    loops.append(LoopTime(loop.name, loop.trips, runs, own_compute, gather,
                          sum(times) - gather, cross, memory))

  visit(program, 1)
  return Prediction(device, tuple(loops), serial[0], serial[1], serial[2])


# ------------------------------------------------------- on XLA:GPU's schedule
class WindowTime(NamedTuple):
  """One async collective of a compiled GPU program on a device, seconds per run: ``comm``
  (its ring time), ``compute`` (the matmuls XLA:GPU scheduled inside its window) and
  ``exposed``: ``max(0, comm - compute)``, what the step waits for it."""
  op: str
  nbytes: float
  comm: float
  compute: float

  @property
  def exposed(self) -> float:
    return max(0.0, self.comm - self.compute)


class ScheduledLoop(NamedTuple):
  """A loop (or, with ``trips`` 1 and name ``"ENTRY"``, the code outside the loops) and the
  `WindowTime` of each of its async collectives, per iteration. ``runs``: how many times the
  loop runs per step (the product of the trip counts of the loops around it; 1 at the top)."""
  name: str
  trips: int
  windows: tuple
  runs: int = 1

  @property
  def exposed(self) -> float:
    """Seconds of communication one run of the loop leaves exposed (all its iterations)."""
    return self.trips * sum(w.exposed for w in self.windows)

  @property
  def step_exposed(self) -> float:
    """Seconds of communication the loop leaves exposed per step (all its runs)."""
    return self.runs * self.exposed


def _runs(comps: dict, entry: str, trips: dict) -> dict:
  """``{loop body: runs per step}``, walking from ``entry``: a ``while`` nested in a loop's
  body (or in what the body calls) runs once per iteration of it."""
  runs: dict = {}

  def visit(name: str, times: int, path: frozenset) -> None:
    for line in comps.get(name, ()):
      body = re.search(r"\bbody=%?([\w.\-]+)", line)
      if body and body.group(1) not in path:
        runs[body.group(1)] = runs.get(body.group(1), 0) + times
        visit(body.group(1), times * trips.get(body.group(1), 1), path | {body.group(1)})
        continue
      callees = [m.group(1) for m in hlo._CALLED.finditer(line)]  # pylint: disable=protected-access
      branches = hlo._BRANCHES.search(line)  # pylint: disable=protected-access
      if branches:
        callees += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
      for c in callees:
        if c not in path:
          visit(c, times, path | {c})

  visit(entry, 1, frozenset([entry]))
  return runs


def predict_scheduled(hlo_text: str, device: Device, *, compute_efficiency: float = 1.0,
                      link_efficiency: float = 1.0) -> tuple[ScheduledLoop, ...]:
  """Exposed communication per collective from what XLA:GPU put inside each one's window.

  Reads a program compiled for GPUs (``compiled.as_text()`` on a `zero_jax.compile_only_mesh`
  or real GPUs) with `zero_jax.gpu.schedule`: each async collective costs its ring time on
  ``device``'s links (`transfer_time`, bytes from the HLO) and hides behind the matmuls
  scheduled between its start and its done (`compute_time`, flops counted from the operands'
  shapes). Windows are taken one at a time: a matmul inside two windows hides both. A loop's
  ``exposed`` counts its own trip count, its ``step_exposed`` also the runs of the loops around
  it (a layer loop inside the micro-batch loop of gradient accumulation runs once per
  micro-batch). A prediction, not a measurement.

  Returns:
    The program's code outside loops (``"ENTRY"``) and its loops, as `ScheduledLoop`s.
  """
  comps = hlo._computations(hlo_text)  # pylint: disable=protected-access
  entry = _ENTRY.search(hlo_text)

  def timed(ws) -> tuple:
    return tuple(WindowTime(w.op, float(w.nbytes), transfer_time(
        Transfer(w.op, float(w.nbytes), tuple(w.groups or ())), device, link_efficiency),
        compute_time(w.dots, device, compute_efficiency)) for w in ws)

  out = [ScheduledLoop("ENTRY", 1, timed(schedule.windows(comps, entry.group(1)) if entry
                                         else ()))]
  loops = schedule.loops(hlo_text)
  runs = _runs(comps, entry.group(1), {l.body: l.trip_count or 1 for l in loops}) if entry \
      else {}
  for loop in loops:
    out.append(ScheduledLoop(loop.body, loop.trip_count or 1, timed(loop.windows),
                             runs.get(loop.body, 1)))
  return tuple(out)
