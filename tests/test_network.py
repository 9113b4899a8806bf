"""The network between hosts: `zj.gpu.with_network` (a figure per host, shared by its GPUs) and
how `zero_jax.gpu.links` (re-exported by `zero_jax.gpu.predict`) times a collective that spans
hosts (by what crosses them)."""

import warnings

import pytest

import zero_jax as zj
from zero_jax.gpu import links, measure, targets
from zero_jax.gpu import predict as overlap

# Two hosts of 4 devices; the network 10x slower than the links within a host.
DEV = overlap.Device("test", peak_flops=1e12, hbm_bandwidth=1e11,
                     intra=overlap.Link(1e9, 1e-6), cross=overlap.Link(1e8, 1e-5),
                     devices_per_host=4)
S = 8e6


# ------------------------------------------------------------------ with_network
def test_the_defaults_are_the_reference_systems_network():
  # DGX/HGX H100: 8 x 400 Gb/s NDR per host = 50 GB/s per GPU; DGX A100: 8 x 200 Gb/s HDR.
  assert zj.gpu.with_network("h100", gbps_per_host=zj.gpu.DGX_H100_GBPS) == zj.gpu.H100
  assert zj.gpu.with_network("h200", gbps_per_host=3200) == zj.gpu.H200
  assert zj.gpu.with_network("a100", gbps_per_host=zj.gpu.DGX_A100_GBPS) == zj.gpu.A100


@pytest.mark.parametrize("gbps, per_host, share", [
    (400, 8, 400e9 / 8 / 8),      # one 400 Gb/s NIC shared by 8 GPUs: 6.25 GB/s each
    (100, 8, 100e9 / 8 / 8),
    (800, 4, 800e9 / 8 / 4),
    (200.5, 1, 200.5e9 / 8),
])
def test_each_gpu_gets_the_hosts_network_over_its_gpus(gbps, per_host, share):
  t = zj.gpu.with_network(zj.gpu.A100, gbps_per_host=gbps, gpus_per_host=per_host)
  assert t.cross_bandwidth == pytest.approx(share, rel=1e-15)
  assert t._replace(cross_bandwidth=zj.gpu.A100.cross_bandwidth) == zj.gpu.A100  # nothing else
  device = measure.device_for(t, per_host, "bf16")  # what zj.plan and the benchmarks predict on
  assert device.cross.bandwidth == t.cross_bandwidth and device.devices_per_host == per_host


@pytest.mark.parametrize("kw, match", [
    ({"gbps_per_host": 0}, r"gbps_per_host=0: expected a positive number of gigabits"),
    ({"gbps_per_host": -400}, r"gbps_per_host=-400"),
    ({"gbps_per_host": float("inf")}, r"gbps_per_host=inf"),
    ({"gbps_per_host": float("nan")}, r"gbps_per_host=nan"),
    ({"gbps_per_host": "400"}, r"gbps_per_host='400'"),
    ({"gbps_per_host": True}, r"gbps_per_host=True"),
    ({"gbps_per_host": 400, "gpus_per_host": 0}, r"gpus_per_host=0: expected an int >= 1"),
    ({"gbps_per_host": 400, "gpus_per_host": 8.0}, r"gpus_per_host=8.0"),
])
def test_bad_figures_are_refused_by_name(kw, match):
  with pytest.raises(ValueError, match=match):
    zj.gpu.with_network("h100", **kw)


def test_an_unknown_gpu_is_refused_as_everywhere():
  with pytest.raises(ValueError, match=r"gpu='v100'"):
    zj.gpu.with_network("v100", gbps_per_host=400)


@pytest.mark.parametrize("gbps, match", [
    (3.2, r"below 10 Gb/s per host.*3.2 Tb/s is 3200"),          # Tb/s given as Gb/s
    (400e9, r"more than NVIDIA H100 80GB HBM3's links within a host"),  # bits/s given
])
def test_figures_in_the_wrong_unit_warn(gbps, match):
  with pytest.warns(UserWarning, match=match):
    zj.gpu.with_network("h100", gbps_per_host=gbps)


def test_ordinary_figures_do_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for gbps in (10, 100, 400, 3200, 25600):
      zj.gpu.with_network("h100", gbps_per_host=gbps)


# --------------------------------------------- collectives across hosts, timed
def test_one_device_per_host_sends_everything_over_its_share():
  # hybrid / hpZ across hosts: 4 groups (one per local device) of 2, one device per host. Each
  # device's ring sends (n-1)/n of the buffer, all of it across, on its share of the network.
  t = overlap.Transfer("all-gather", S, ((0, 4), (1, 5), (2, 6), (3, 7)))
  assert overlap.cross_host_bytes(t, DEV) == 1 / 2 * S
  assert overlap.transfer_time(t, DEV) == pytest.approx(1 / 2 * S / 1e8 + 1 * 1e-5, rel=1e-12)


@pytest.mark.parametrize("op, wire, crossing, steps, inter", [
    # one ring over both hosts' 8 devices: it enters and leaves each host once, so of the wire
    # each device sends 1/4 (4 members a host) crosses on average; the rest stays within. Of
    # its steps, one per pass crosses hosts (NCCL's nInterSteps = nNodes - 1 per pass).
    ("all-gather", 7 / 8 * S, 7 / 8 * S / 4, 7, 1),
    ("reduce-scatter", 7 * S, 7 * S / 4, 7, 1),
    ("all-reduce", 2 * 7 / 8 * S, 2 * 7 / 8 * S / 4, 14, 2),
    # an all-to-all sends the 4/8 of its buffer addressed to the other host across, 4 of its
    # 7 sends
    ("all-to-all", 7 / 8 * S, 4 / 8 * S, 7, 4),
])
def test_a_flat_group_is_timed_by_what_crosses_hosts(op, wire, crossing, steps, inter):
  t = overlap.Transfer(op, S, (tuple(range(8)),))
  assert overlap.wire_bytes(t, DEV) == pytest.approx(wire, rel=1e-12)
  assert overlap.cross_host_bytes(t, DEV) == pytest.approx(crossing, rel=1e-12)
  slower = max(crossing / 1e8, (wire - crossing) / 1e9)   # the two parts run pipelined
  latency = inter * 1e-5 + (steps - inter) * 1e-6
  assert overlap.transfer_time(t, DEV) == pytest.approx(slower + latency, rel=1e-12)
  # what all 4 devices of a host send across, over the host's whole network (4 x 1e8): the
  # same time. The host's network is shared by its devices, not each device's own.
  host = 4 * overlap.cross_host_bytes(t, DEV) / (4 * 1e8)
  assert overlap.transfer_time(t, DEV) - latency == pytest.approx(
      max(host, (wire - crossing) / 1e9), rel=1e-12)


def test_a_ring_over_many_hosts_pays_the_cross_host_latency_once_per_host():
  big = DEV._replace(devices_per_host=8)
  flat = overlap.Transfer("all-gather", 0.0, (tuple(range(256)),))       # 32 hosts
  across = overlap.Transfer("all-gather", 0.0, tuple(tuple(range(i, 256, 8)) for i in range(8)))
  assert overlap.transfer_time(flat, big) == pytest.approx(31 * 1e-5 + 224 * 1e-6, rel=1e-12)
  assert overlap.transfer_time(across, big) == pytest.approx(31 * 1e-5, rel=1e-12)


def test_bytes_across_hosts_follow_hosts_for_a_flat_ring_and_not_for_one_per_host():
  big = DEV._replace(devices_per_host=8)
  flat = lambda hosts: overlap.Transfer("all-gather", S, (tuple(range(8 * hosts)),))
  across = lambda hosts: overlap.Transfer("all-gather", S,
                                          tuple(tuple(range(i, 8 * hosts, 8)) for i in range(8)))
  for hosts in (2, 4, 32):
    n = 8 * hosts
    assert overlap.cross_host_bytes(flat(hosts), big) == pytest.approx((n - 1) / n * S / 8)
    assert overlap.cross_host_bytes(across(hosts), big) == pytest.approx(
        (hosts - 1) / hosts * S)


def test_sent_bytes_splits_a_flat_ring_into_its_parts_within_and_across():
  t = overlap.Transfer("all-gather", S, (tuple(range(8)),))
  program = overlap.Loop("main", 1, (), (t,), (overlap.Loop("layers", 3, (), (t,), ()),))
  intra, cross = measure.sent_bytes(program, DEV)
  assert cross == pytest.approx(4 * 7 / 8 * S / 4)
  assert intra + cross == pytest.approx(4 * 7 / 8 * S)


def test_a_thinner_network_slows_only_collectives_across_hosts():
  wide = overlap.device_from_target(targets.H100)
  thin = overlap.device_from_target(zj.gpu.with_network("h100", gbps_per_host=100))
  within = overlap.Transfer("reduce-scatter", S, (tuple(range(8)),))
  across = overlap.Transfer("all-reduce", S, tuple(tuple(range(i, 16, 8)) for i in range(8)))
  assert overlap.transfer_time(within, thin) == overlap.transfer_time(within, wide)
  # 1/2 of 2 x S each way per device over 100e9 / 8 / 8 B/s against 3200e9 / 8 / 8: 32x
  bandwidth = lambda d: overlap.transfer_time(across, d) - 2 * d.cross.latency
  assert bandwidth(thin) == pytest.approx(32 * bandwidth(wide), rel=1e-12)
  assert bandwidth(thin) == pytest.approx(S / (100e9 / 64), rel=1e-12)


def test_a_small_all_reduce_over_many_hosts_takes_nccls_tree():
  # NCCL picks the faster of ring and tree for an all-reduce (src/graph/tuning.cc). 32 hosts of
  # 8, 12 KiB (a bias's gradient): the ring's 2 x 255 steps (62 across) against the tree's
  # 2 x (7 within + log2(32) = 5 across); the tree moves the bytes at 0.9 of the ring's rate.
  big = DEV._replace(devices_per_host=8)
  t = overlap.Transfer("all-reduce", 12 * 1024, (tuple(range(256)),))
  cross = overlap.cross_host_bytes(t, big)
  seconds = max(cross / 1e8, (overlap.wire_bytes(t, big) - cross) / 1e9)
  ring = seconds + 62 * 1e-5 + 448 * 1e-6
  tree = seconds / 0.9 + 2 * (7 * 1e-6 + 5 * 1e-5)
  assert tree < ring
  assert overlap.transfer_time(t, big) == pytest.approx(tree, rel=1e-12)
  # a large one stays on the ring (its bandwidth term dominates)
  t = t._replace(nbytes=1 << 30)
  cross = overlap.cross_host_bytes(t, big)
  seconds = max(cross / 1e8, (overlap.wire_bytes(t, big) - cross) / 1e9)
  assert overlap.transfer_time(t, big) == pytest.approx(
      seconds + 62 * 1e-5 + 448 * 1e-6, rel=1e-12)


def test_predict_re_exports_the_links_timing():
  # The links' timing moved to zero_jax.gpu.links; code written against zero_jax.gpu.predict
  # (the guides, the benchmarks) still finds the same objects there.
  for name in ("Device", "Link", "transfer_time", "wire_bytes", "cross_host_bytes",
               "crosses_hosts"):
    assert getattr(overlap, name) is getattr(links, name), name
