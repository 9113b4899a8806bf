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
  where the first gather (fill) and the last reduce-scatter (drain) stay exposed. A loop that
  runs ``k`` layers an iteration (a scan unrolled ``k`` times, as ``zj.scan``'s prefetching
  loops run two: `zero_jax.gpu.program.Loop.layers`) is timed layer by layer, each layer a
  ``1/k`` share of the iteration: its fill and drain are one layer's, not ``k``'s.

A collective costs what a ring costs (`zero_jax.gpu.links`, re-exported here: `Device`, `Link`,
`transfer_time`, `wire_bytes`, `cross_host_bytes`, `crosses_hosts`): ``(n-1)/n`` of its whole
buffer over the link (twice for an all-reduce) plus a latency per ring step; a group that spans
hosts runs at the cross-host link's speed for what crosses them. Collectives run one at a time
on one stream, compute on another, and a layer's collectives hide only behind its compute, which
runs ``overlap_slowdown`` slower while they are in flight (NCCL's SMs). Compute time is each
matmul's roofline, ``max(flops / (gemm_efficiency * peak), bytes / HBM bandwidth)`` plus a
kernel's ``gemm_launch`` (matmul throughput by shape from XLA's measured H100 table), plus the
bytes the other kernels (elementwise work, reductions, copies: quantizing and dequantizing, the
optimizer update) move over HBM bandwidth, counted where the program is fused (a compiled
program). Scale ``peak_flops`` (and the links) to what your software reaches
(``compute_efficiency``, ``link_efficiency``). These are predictions, not measurements; any
program ``jax.jit`` compiles can be read, not only zero_jax's steps.

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
from zero_jax.gpu.links import (Device, Link, cross_host_bytes, crosses_hosts,  # noqa: F401
                                transfer_time, wire_bytes)  # (re-exported: the links' timing)
from zero_jax.gpu.program import _ENTRY, Loop, Transfer, analyze  # noqa: F401  (re-exported)
from zero_jax.gpu.targets import H100, Target


# Matmuls by shape, from measurements: XLA's own table of cuBLAS/Triton matmul throughput on
# H100 SXM (sm_90), bf16 x bf16 -> bf16, openxla/xla xla/service/gpu/model/
# matmul_interpolator_data.h (kDefaultMatmulPTable, 2025). A few of its entries, (batch, m, n,
# k, measured flop/s): large square GEMMs reach ~79% of the 989 TFLOP/s dense peak, small or
# skinny ones a few percent (a kernel takes ~5-6 us however few its flops).
GEMM_MEASURED_H100 = ((1, 4096, 4096, 4096, 783.3e12), (2, 4096, 4096, 2048, 763.0e12),
                      (1, 2048, 2048, 2048, 632.0e12), (1, 4096, 4096, 256, 392.2e12),
                      (1, 4096, 512, 512, 238.8e12), (1, 1024, 2048, 256, 139.5e12),
                      (1, 256, 2048, 256, 41.8e12), (1, 256, 512, 256, 11.5e12))
# The model fitted to it (tests/test_overlap.py holds it to every entry within 35%): a matmul
# takes max(flops / (GEMM_EFFICIENCY * peak), bytes / HBM bandwidth) + GEMM_LAUNCH_S. The
# largest entry sets the efficiency (783.3 / 989 = 0.79), the smallest the launch time (256 x
# 512 x 256 in 5.9 us). A100 gets the same two figures: XLA's table has no sm_80 matmuls, and
# large bf16 GEMMs on A100 are published at 80-87% of its 312 TFLOP/s (e.g. NVIDIA's "Matrix
# Multiplication Background" guide), so 0.79 does not flatter it.
GEMM_EFFICIENCY = 0.79
GEMM_LAUNCH_S = 5e-6
# Compute overlapping a collective: NCCL's kernels run one thread block per channel on SMs of
# their own, and read and write HBM. With 16 channels (an assumption of NCCL's order on an
# 8-GPU NVLink host; it may use more) of 132 SMs, a GEMM keeps at most 116 of them:
# 132 / 116 = 1.14 slower while a collective is in flight.
OVERLAP_SLOWDOWN = 132 / 116


def device_from_target(target: Target, devices_per_host: int = 8) -> Device:
  """The `Device` of a `zero_jax.gpu.Target`: its dense bf16 peak, HBM bandwidth and links,
  matmuls at `GEMM_EFFICIENCY` plus `GEMM_LAUNCH_S` each, and `OVERLAP_SLOWDOWN`."""
  return Device(target.name, target.peak_flops, target.hbm_bandwidth,
                intra=Link(target.intra_bandwidth, target.intra_latency),
                cross=Link(target.cross_bandwidth, target.cross_latency),
                devices_per_host=devices_per_host, gemm_efficiency=GEMM_EFFICIENCY,
                gemm_launch=GEMM_LAUNCH_S, overlap_slowdown=OVERLAP_SLOWDOWN)


# NVIDIA's H100 SXM datasheet (`zero_jax.gpu.H100`): 989 TFLOP/s dense bf16, 3.35 TB/s HBM3,
# NVLink 450 GB/s each way, one 400 Gb/s NDR port per GPU, 8 GPUs a host.
H100_SXM = device_from_target(H100)._replace(name="H100 SXM")


# ------------------------------------------------------------------ timing
def compute_time(dots, device: Device, compute_efficiency: float = 1.0) -> float:
  """Seconds for ``dots`` (``(flops, bytes)`` pairs), each at its roofline on ``device``
  (flops at ``gemm_efficiency`` of the peak, times ``compute_efficiency``) plus the
  device's ``gemm_launch``."""
  peak = device.peak_flops * device.gemm_efficiency * compute_efficiency
  return sum(max(f / peak, b / device.hbm_bandwidth) + device.gemm_launch for f, b in dots)


def overlapped(compute: float, comm: float, slowdown: float = 1.0) -> float:
  """Seconds for ``compute`` and ``comm`` started together, the compute ``slowdown`` times
  slower while the collective is in flight: ``comm`` when the collective outlasts the
  slowed compute, else the compute plus what the collective's time cost it."""
  if comm <= 0:
    return compute
  if comm >= compute * slowdown:
    return comm
  return compute + comm * (1 - 1 / slowdown)


class LoopTime(NamedTuple):
  """One innermost loop on a device. Seconds per iteration: ``compute`` (matmuls and the
  memory-bound kernels: ``elementwise`` of it), ``gather`` (all-gathers: what prefetching
  issues one layer early), ``reduce`` (the other collectives: issued one layer late),
  ``cross_host`` (the part of ``gather + reduce`` on the cross-host link); ``runs``: times
  the loop runs per step; ``layers``: the layers an iteration runs (`zero_jax.gpu.program.Loop`),
  each a ``1/layers`` share of the iteration's times."""
  name: str
  trips: int
  runs: int
  compute: float
  gather: float
  reduce: float
  cross_host: float
  elementwise: float = 0.0
  slowdown: float = 1.0
  layers: int = 1

  def total(self, prefetch: int) -> float:
    """Seconds for one run: serial (0), or overlapped one layer ahead (1). Overlapped, the
    gather and the reduce in flight during a layer share one stream (their times add) and
    hide only behind that layer's compute, slowed by ``slowdown`` meanwhile (`overlapped`);
    the first layer's gather and the last one's reduce stay exposed (one layer's, however
    many layers an iteration runs)."""
    k = max(self.layers, 1)
    n, c, g, r = self.trips * k, self.compute / k, self.gather / k, self.reduce / k
    if not prefetch or n == 1:
      return n * (c + g + r)
    middle = sum(overlapped(c, (g if i < n - 1 else 0.0) + (r if i > 0 else 0.0),
                            self.slowdown) for i in range(n))
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
                          sum(times) - gather, cross, memory, device.overlap_slowdown,
                          loop.layers))

  visit(program, 1)
  return Prediction(device, tuple(loops), serial[0], serial[1], serial[2])


# ------------------------------------------------------- on XLA:GPU's schedule
class WindowTime(NamedTuple):
  """The async collectives of a compiled GPU program in flight together (one, or several
  whose windows overlap: ``op`` joins their names with ``+``), seconds per run: ``comm``
  (their ring times, added on a link they share), ``compute`` (the matmuls XLA:GPU
  scheduled inside the union of their windows, each counted once) and ``exposed``: what the
  step waits for them beyond that compute, slowed by ``slowdown`` while they are in flight
  (`overlapped`)."""
  op: str
  nbytes: float
  comm: float
  compute: float
  slowdown: float = 1.0

  @property
  def exposed(self) -> float:
    return overlapped(self.compute, self.comm, self.slowdown) - self.compute


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


def _in_flight(ws: list, device: Device, compute_efficiency: float,
               link_efficiency: float) -> WindowTime:
  """One `WindowTime` for windows in flight together: the ring times of those on one link
  add (they share its bandwidth), and hide behind the matmuls inside those collectives' own
  windows (each matmul counted once); the links run side by side, and the link that leaves
  the most exposed is the group's. A collective is never credited with a matmul outside its
  own link's windows (one on another link that started earlier, say)."""
  links: dict = {}  # link -> (ring times, {matmul: cost})
  for w in ws:
    t = Transfer(w.op, float(w.nbytes), tuple(w.groups or ()))
    link = links.setdefault(crosses_hosts(t, device), [0.0, {}])
    link[0] += transfer_time(t, device, link_efficiency)
    for k, dot in enumerate(w.dots):  # by (instruction, its k-th matmul): counted once
      name = w.dot_names[k] if w.dot_names else (id(w), k)
      link[1][(name, w.dot_names[:k].count(name) if w.dot_names else 0)] = dot
  times = [WindowTime("+".join(w.op for w in ws), float(sum(w.nbytes for w in ws)), comm,
                      compute_time(list(dots.values()), device, compute_efficiency),
                      device.overlap_slowdown) for comm, dots in links.values()]
  return max(times, key=lambda t: (t.exposed, t.comm), default=WindowTime(
      "+".join(w.op for w in ws), 0.0, 0.0, 0.0, device.overlap_slowdown))


def predict_scheduled(hlo_text: str, device: Device, *, compute_efficiency: float = 1.0,
                      link_efficiency: float = 1.0) -> tuple[ScheduledLoop, ...]:
  """Exposed communication per collective from what XLA:GPU put inside each one's window.

  Reads a program compiled for GPUs (``compiled.as_text()`` on a `zero_jax.compile_only_mesh`
  or real GPUs) with `zero_jax.gpu.schedule`: each async collective costs its ring time on
  ``device``'s links (`transfer_time`, bytes from the HLO) and hides behind the matmuls
  scheduled between its start and its done (`compute_time`, flops counted from the operands'
  shapes). Collectives whose windows overlap are in flight together: on one link their ring
  times add (they share its bandwidth), and together they hide only behind the matmuls of
  the union of their windows, counted once, slowed by the device's ``overlap_slowdown``
  meanwhile; each such group is one `WindowTime`. A loop's
  ``exposed`` counts its own trip count, its ``step_exposed`` also the runs of the loops around
  it (a layer loop inside the micro-batch loop of gradient accumulation runs once per
  micro-batch). A prediction, not a measurement.

  Returns:
    The program's code outside loops (``"ENTRY"``) and its loops, as `ScheduledLoop`s.
  """
  comps = hlo._computations(hlo_text)  # pylint: disable=protected-access
  entry = _ENTRY.search(hlo_text)

  def timed(ws) -> tuple:
    return tuple(_in_flight(group, device, compute_efficiency, link_efficiency)
                 for group in schedule.in_flight_together(ws))

  out = [ScheduledLoop("ENTRY", 1, timed(schedule.windows(comps, entry.group(1)) if entry
                                         else ()))]
  loops = schedule.loops(hlo_text)
  runs = _runs(comps, entry.group(1), {l.body: l.trip_count or 1 for l in loops}) if entry \
      else {}
  for loop in loops:
    out.append(ScheduledLoop(loop.body, loop.trip_count or 1, timed(loop.windows),
                             runs.get(loop.body, 1)))
  return tuple(out)
