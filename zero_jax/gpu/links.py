"""How long a collective takes on a GPU's links: ring and tree, within and across hosts.

A `Device` is one accelerator and its links (`Link`: bandwidth each way and latency per ring
step), within its host (``intra``) and its share of the network between hosts (``cross``);
devices ``0 .. k-1`` are one host. `transfer_time` times one collective (a
`zero_jax.gpu.program.Transfer`: its op, bytes and device groups) by a ring algorithm: what
each device sends (`wire_bytes`), what of it crosses hosts (`cross_host_bytes`: a ring
enters and leaves each host once), the cross-host latency on the ring steps that cross, and,
for an all-reduce across hosts, the faster of NCCL's ring and tree. `zero_jax.gpu.predict`
puts these times beside a program's compute; `zero_jax.gpu.predict.device_from_target` makes
the `Device` of a `zero_jax.gpu.Target` (its network from `zero_jax.gpu.with_network`).

Example:
  >>> from zero_jax.gpu import links
  >>> from zero_jax.gpu.program import Transfer
  >>> gpu = links.Device("toy", peak_flops=1e15, hbm_bandwidth=3e12,
  ...                    intra=links.Link(100e9, 0.0), cross=links.Link(10e9, 0.0),
  ...                    devices_per_host=4)
  >>> within = Transfer("all-gather", 4e9, ((0, 1, 2, 3),))  # 3/4 of 4 GB at 100 GB/s
  >>> round(links.transfer_time(within, gpu), 6)
  0.03
  >>> across = Transfer("all-gather", 4e9, ((0, 4),))  # one GPU a host: 2 GB cross at 10 GB/s
  >>> links.crosses_hosts(across, gpu), links.cross_host_bytes(across, gpu)
  (True, 2000000000.0)
  >>> round(links.transfer_time(across, gpu), 6)
  0.2
"""

from __future__ import annotations

import math
from typing import NamedTuple

from zero_jax.gpu.program import Transfer


class Link(NamedTuple):
  """A link as one device sees it: ``bandwidth`` in bytes/s each way, ``latency`` in s
  per ring step."""
  bandwidth: float
  latency: float


class Device(NamedTuple):
  """What `zero_jax.gpu.predict` needs to know about one accelerator and its links.

  The defaults of the last three fields are an ideal machine (every matmul at peak, no
  kernel overhead, compute that shares nothing with the collectives), for reasoning about
  the schedule alone; `zero_jax.gpu.predict.device_from_target` gives the honest one
  (`zero_jax.gpu.predict.GEMM_EFFICIENCY`, ``GEMM_LAUNCH_S``, ``OVERLAP_SLOWDOWN``).

  Attributes:
    name: for tables.
    peak_flops: dense matmul flops/s in the program's compute dtype.
    hbm_bandwidth: memory bandwidth, bytes/s.
    intra: the link between devices of one host.
    cross: each device's share of the network between hosts.
    devices_per_host: devices ``0 .. k-1`` are one host, ``k .. 2k-1`` the next, ...
    gemm_efficiency: the fraction of ``peak_flops`` a large matmul reaches.
    gemm_launch: seconds each matmul kernel takes beyond its flops or bytes (what makes
      small matmuls reach a small fraction of peak).
    overlap_slowdown: the factor by which compute slows while a collective is in flight
      (the SMs and HBM bandwidth NCCL's kernels take).
  """
  name: str
  peak_flops: float
  hbm_bandwidth: float
  intra: Link
  cross: Link
  devices_per_host: int = 8
  gemm_efficiency: float = 1.0
  gemm_launch: float = 0.0
  overlap_slowdown: float = 1.0


def crosses_hosts(t: Transfer, device: Device) -> bool:
  """Whether one of ``t``'s device groups spans more than one of ``device``'s hosts."""
  return any(len({d // device.devices_per_host for d in g}) > 1 for g in t.groups)


def _link(t: Transfer, device: Device) -> tuple[int, Link]:
  """The group size and the link it runs at (the cross-host one if a group spans hosts)."""
  n = max((len(g) for g in t.groups), default=1)
  return n, device.cross if crosses_hosts(t, device) else device.intra


def _wire(t: Transfer, n: int) -> tuple[float, int]:
  """``(bytes each device sends, ring steps)`` of a ring algorithm for ``t`` on ``n`` devices."""
  return {"all-gather": ((n - 1) / n * t.nbytes, n - 1),
          "reduce-scatter": ((n - 1) * t.nbytes, n - 1),
          "all-reduce": (2 * (n - 1) / n * t.nbytes, 2 * (n - 1)),
          "all-to-all": ((n - 1) / n * t.nbytes, n - 1),
          "collective-permute": (t.nbytes, 1)}[t.op]


def _per_host(t: Transfer, device: Device) -> tuple[int, float]:
  """``(n, m)``: the largest group's size and its members per host (on average over the hosts
  it spans)."""
  g = max(t.groups, key=len) if t.groups else ()
  hosts = {d // device.devices_per_host for d in g}
  return len(g), len(g) / max(len(hosts), 1)


def wire_bytes(t: Transfer, device: Device) -> float:
  """Bytes one device sends for ``t`` by a ring algorithm, within and across hosts."""
  n = _link(t, device)[0]
  return _wire(t, n)[0] if n > 1 else 0.0


def cross_host_bytes(t: Transfer, device: Device) -> float:
  """Bytes one device sends across hosts for ``t`` (averaged over the devices; 0 within a host).

  A ring over a group with ``m`` members on each of its hosts enters and leaves each host once:
  the ``(n-1)/n`` of the buffer (all-gather; twice for an all-reduce) that every member sends
  crosses the host's boundary once per host, so the ``m`` members' share of the network
  carries ``1/m`` of what each sends (NCCL runs one ring per NIC, so the crossing is spread
  over the host's NICs: its bus bandwidth across nodes is the host's aggregate network
  bandwidth, nccl-tests doc/PERFORMANCE.md). With one member per host (a hybrid or hpZ
  collective across hosts) all of it crosses. An all-to-all sends the ``(n-m)/n`` of its
  buffer addressed to other hosts.
  """
  if not crosses_hosts(t, device):
    return 0.0
  n, m = _per_host(t, device)
  if t.op == "all-to-all":
    return (n - m) / n * t.nbytes
  return _wire(t, n)[0] / m


def transfer_time(t: Transfer, device: Device, link_efficiency: float = 1.0) -> float:
  """Seconds a ring algorithm needs for ``t`` on ``device``'s links (0 for one device).

  Per device, a ring sends ``(n-1)/n`` of the whole buffer in ``n-1`` steps: the result for
  an all-gather, the operand (``n`` results) for a reduce-scatter, the buffer twice for an
  all-reduce (a reduce-scatter then an all-gather); an all-to-all sends ``(n-1)/n`` of its
  buffer, a collective-permute all of it in one step. A group that spans hosts is timed by the
  slower of its two parts, pipelined: what crosses hosts (`cross_host_bytes`) on each device's
  share of the network (``device.cross``: every device of a host sends at once, so each gets
  the host's network over ``devices_per_host``), and the rest within the host on ``intra``;
  of its ring steps, those that cross hosts (one per host it spans, less one, per pass)
  take the cross-host latency and the others the latency within a host, as NCCL's own
  tuning model counts a ring (``nInterSteps``, src/graph/tuning.cc); an all-to-all's steps
  to other hosts cross.
  """
  n, link = _link(t, device)
  if n <= 1:
    return 0.0
  wire, steps = _wire(t, n)
  if not crosses_hosts(t, device):
    return wire / (link.bandwidth * link_efficiency) + steps * link.latency
  cross = cross_host_bytes(t, device)
  seconds = max(cross / device.cross.bandwidth, (wire - cross) / device.intra.bandwidth)
  _, m = _per_host(t, device)
  hosts = round(n / m)
  inter = {"all-reduce": 2 * (hosts - 1), "all-to-all": n - m,
           "collective-permute": 1}.get(t.op, hosts - 1)
  inter = min(inter, steps)
  ring = (seconds / link_efficiency + inter * device.cross.latency
          + (steps - inter) * device.intra.latency)
  if t.op != "all-reduce":
    return ring
  # NCCL's all-reduce across hosts takes the faster of a ring and a tree (src/graph/tuning.cc):
  # the tree's latency is 2 * ((devices a host - 1) intra steps + log2(hosts) cross steps), its
  # bandwidth 0.9 of the ring's. A small all-reduce over many hosts (a replicated bias's
  # gradient) is latency-bound: the tree takes log2(hosts) steps across, the ring 2 (hosts-1).
  tree = (seconds / (0.9 * link_efficiency) + 2 * (
      (math.ceil(m) - 1) * device.intra.latency + math.ceil(math.log2(hosts)) * device.cross.latency))
  return min(ring, tree)
