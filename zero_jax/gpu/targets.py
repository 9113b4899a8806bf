"""GPUs as data: the figures of the cards users train on, and compile-only meshes of them.

A `Target` holds what a GPU's datasheet publishes (memory, peak matmul flops, HBM
bandwidth, the links within and between hosts) and what XLA:GPU needs to compile for it
without the card (SM count, clocks, shared memory, compute capability). `compile_only_mesh`
turns a target into a `jax.sharding.Mesh` of compile-only devices (JAX's "deviceless AOT"):
a step lowered and compiled on it is the program XLA:GPU would run on that cluster (scheduled
HLO with its async collectives, `memory_analysis()`), built on a machine with no GPU.

It needs JAX's CUDA plugin next to jax: the two wheels ``jax-cuda12-plugin`` and
``jax-cuda12-pjrt`` of jax's version (about 480 MB; no GPU, and none of the multi-GB nvidia-*
wheels ``jax[cuda12]`` brings); `compile_only_mesh` says so when the plugin is missing.

Example (needs the CUDA plugin; no GPU):
  >>> import zero_jax as zj
  >>> mesh = zj.compile_only_mesh((2, 8), ("hosts", "data"), gpu="h100", hosts=2)  # doctest: +SKIP
  >>> mesh.devices.shape, mesh.devices[1, 0].process_index                         # doctest: +SKIP
  ((2, 8), 1)
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from typing import NamedTuple, Sequence

import numpy as np

GiB = 1 << 30


class Target(NamedTuple):
  """One GPU model, from its published figures.

  Attributes:
    key: the short name `compile_only_mesh` and `zj.plan` take (``"h100"``).
    name: the card as NVIDIA names it.
    memory_bytes: HBM as CUDA reports it (``nvidia-smi``'s total).
    peak_flops: dense bf16/fp16 matmul flops/s (tensor cores, no sparsity).
    peak_flops_fp32: dense fp32 matmul flops/s (TF32 tensor cores, no sparsity).
    hbm_bandwidth: HBM bytes/s.
    intra_bandwidth: NVLink bytes/s each way per GPU (half the datasheet's two-way total).
    cross_bandwidth: each GPU's share of the network between hosts, bytes/s each way.
    intra_latency: seconds per ring step within a host (an assumption of NCCL's order).
    cross_latency: seconds per ring step across hosts (likewise).
    sm_count: streaming multiprocessors.
    clock_ghz: boost clock.
    compute_capability: ``(major, minor)``.
    shared_memory_per_sm: bytes of shared memory per SM.
    shared_memory_per_block_optin: the most one block may opt in to.
    l2_bytes: L2 cache.
    fp32_units_per_sm: FP32 lanes per SM.
  """
  key: str
  name: str
  memory_bytes: int
  peak_flops: float
  peak_flops_fp32: float
  hbm_bandwidth: float
  intra_bandwidth: float
  cross_bandwidth: float
  intra_latency: float
  cross_latency: float
  sm_count: int
  clock_ghz: float
  compute_capability: tuple
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  l2_bytes: int
  fp32_units_per_sm: int


MiB = 1 << 20
# NVIDIA's datasheets. H100 SXM5 80 GB: 132 SMs, 1.98 GHz, 989 TFLOP/s dense bf16, 495 TF32,
# HBM3 3.35 TB/s, NVLink 4 900 GB/s (both directions), one 400 Gb/s NDR port per GPU in
# DGX/HGX H100. H200 SXM 141 GB: the H100's compute with HBM3e at 4.8 TB/s. A100 SXM4 80 GB:
# 108 SMs, 1.41 GHz, 312 TFLOP/s bf16, 156 TF32, HBM2e 2.04 TB/s, NVLink 3 600 GB/s, one
# 200 Gb/s HDR port per GPU in DGX A100.
H100 = Target("h100", "NVIDIA H100 80GB HBM3", 81559 * MiB, 989e12, 495e12, 3.35e12,
              450e9, 50e9, 2e-6, 6e-6, 132, 1.98, (9, 0), 233472, 232448, 50 * MiB, 128)
H200 = H100._replace(key="h200", name="NVIDIA H200 141GB HBM3e", memory_bytes=143771 * MiB,
                     hbm_bandwidth=4.8e12)
A100 = Target("a100", "NVIDIA A100-SXM4-80GB", 81920 * MiB, 312e12, 156e12, 2.039e12,
              300e9, 25e9, 2e-6, 6e-6, 108, 1.41, (8, 0), 167936, 166912, 40 * MiB, 64)

TARGETS = {t.key: t for t in (H100, H200, A100)}


def get_target(gpu: str | Target) -> Target:
  """The `Target` for ``gpu``: a key of `TARGETS` (``"h100"``, ``"h200"``, ``"a100"``;
  case-insensitive) or a `Target` of your own (e.g. ``zj.gpu.H100._replace(memory_bytes=...)``)."""
  if isinstance(gpu, Target):
    return gpu
  key = str(gpu).lower().replace("-", "").replace(" ", "")
  for k, t in TARGETS.items():
    if key in (k, f"{k}sxm", f"{k}sxm5", f"{k}sxm4"):
      return t
  raise ValueError(f"gpu={gpu!r}: zero_jax knows {sorted(TARGETS)}. For another card pass a "
                   f"zero_jax.gpu.Target with its figures (e.g. "
                   f"zero_jax.gpu.H100._replace(name=..., memory_bytes=...)).")


# The network between hosts, Gb/s each way per host, of the systems the targets' default
# ``cross_bandwidth`` describes: DGX/HGX H100 (and H200) have 8 x 400 Gb/s NDR InfiniBand ports,
# one per GPU (3.2 Tb/s per host); DGX A100 has 8 x 200 Gb/s HDR (1.6 Tb/s per host).
#: DGX/HGX H100 and H200: 8 x 400 Gb/s NDR per host, Gb/s (the H100/H200 targets' network).
DGX_H100_GBPS = 3200
#: DGX A100: 8 x 200 Gb/s HDR per host, Gb/s (the A100 target's network).
DGX_A100_GBPS = 1600


def with_network(gpu: str | Target, *, gbps_per_host: float, gpus_per_host: int = 8) -> Target:
  """``gpu``'s `Target` on a cluster whose hosts are linked at ``gbps_per_host`` Gb/s.

  The network between hosts is a property of the cluster, not of the card: the targets'
  defaults are NVIDIA's reference systems, DGX/HGX H100 and H200 with 8 x 400 Gb/s NDR ports
  per host (3.2 Tb/s, `DGX_H100_GBPS`) and DGX A100 with 8 x 200 Gb/s HDR (1.6 Tb/s,
  `DGX_A100_GBPS`). Many clusters have less: one or two 100-400 Gb/s NICs per host. When the
  GPUs of a host all send across hosts at once (every data-parallel collective does), they
  share the host's network, so each GPU's share, ``cross_bandwidth``, is
  ``gbps_per_host / gpus_per_host`` (in bytes/s: ``* 1e9 / 8``).

  Pass the result as ``gpu=`` to `zero_jax.plan` or `zero_jax.compile_only_mesh`, or to
  `zero_jax.gpu.predict.device_from_target`, with the same GPUs per host (``per_host=``).

  Example:
    >>> import zero_jax as zj
    >>> t = zj.gpu.with_network("h100", gbps_per_host=400)   # one 400 Gb/s NIC per host
    >>> t.cross_bandwidth / 1e9                               # GB/s, each GPU's share
    6.25
    >>> zj.gpu.with_network("h100", gbps_per_host=zj.gpu.DGX_H100_GBPS) == zj.gpu.H100
    True

  Args:
    gpu: ``"h100"``, ``"h200"``, ``"a100"`` or a `Target`.
    gbps_per_host: the host's network to other hosts, gigabits per second each way (the sum
      of its NICs' rates: 8 x 400 Gb/s is 3200).
    gpus_per_host: GPUs sharing that network (the ``per_host=`` of the cluster).

  Returns:
    The `Target` with ``cross_bandwidth`` set; its other figures unchanged.

  Raises:
    ValueError: ``gbps_per_host`` is not a positive, finite number, or ``gpus_per_host`` not
      an int >= 1.
  """
  t = get_target(gpu)
  if (isinstance(gbps_per_host, bool) or not isinstance(gbps_per_host, (int, float))
      or not math.isfinite(gbps_per_host) or gbps_per_host <= 0):
    raise ValueError(f"gbps_per_host={gbps_per_host!r}: expected a positive number of gigabits "
                     f"per second between one host and the others, each way (e.g. 400 for one "
                     f"400 Gb/s NIC, {DGX_H100_GBPS} for DGX H100's 8 x 400 Gb/s).")
  if isinstance(gpus_per_host, bool) or not isinstance(gpus_per_host, int) or gpus_per_host < 1:
    raise ValueError(f"gpus_per_host={gpus_per_host!r}: expected an int >= 1, the GPUs of one "
                     f"host that share its network (8 on DGX/HGX systems).")
  share = gbps_per_host * 1e9 / 8 / gpus_per_host
  if gbps_per_host < 10:
    warnings.warn(f"with_network: gbps_per_host={gbps_per_host} is below 10 Gb/s per host; the "
                  f"figure is in gigabits per second (3.2 Tb/s is 3200).", stacklevel=2)
  elif share > t.intra_bandwidth:
    warnings.warn(f"with_network: gbps_per_host={gbps_per_host} gives each of {gpus_per_host} "
                  f"GPUs {share / 1e9:.0f} GB/s across hosts, more than {t.name}'s links within "
                  f"a host ({t.intra_bandwidth / 1e9:.0f} GB/s); the figure is in gigabits per "
                  f"second (3.2 Tb/s is 3200), not bits or bytes.", stacklevel=2)
  return t._replace(cross_bandwidth=share)


def target_config(t: Target) -> str:
  """The ``GpuTargetConfigProto`` text XLA:GPU compiles for, written from ``t``'s figures."""
  major, minor = t.compute_capability
  return "\n".join([
      "gpu_device_info {",
      "  threads_per_block_limit: 1024", "  threads_per_warp: 32",
      "  shared_memory_per_block: 49152",
      f"  shared_memory_per_core: {t.shared_memory_per_sm}",
      "  threads_per_core_limit: 2048", f"  core_count: {t.sm_count}",
      f"  fpus_per_core: {t.fp32_units_per_sm}",
      "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535",
      "  block_dim_limit_z: 65535",
      f"  memory_bandwidth: {int(t.hbm_bandwidth)}", f"  l2_cache_size: {t.l2_bytes}",
      f"  clock_rate_ghz: {t.clock_ghz}", f"  device_memory_size: {t.memory_bytes}",
      f"  shared_memory_per_block_optin: {t.shared_memory_per_block_optin}",
      f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
      "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
      "}",
      'platform_name: "CUDA"',
      "dnn_version_info { major: 9 minor: 8 patch: 0 }",
      f'device_description_str: "{t.name}"',
      ""])


def check_cluster(hosts, per_host) -> None:
  """Raises ValueError unless ``hosts`` and ``per_host`` are ints >= 1."""
  for name, v in (("hosts", hosts), ("per_host", per_host)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name}={v!r}: must be an int >= 1 (hosts=2, per_host=8: two hosts of "
                       f"8 GPUs each).")


def _plugin_error(e: Exception) -> RuntimeError:
  import jax  # pylint: disable=import-outside-toplevel
  return RuntimeError(
      f"compiling for a GPU without one needs JAX's CUDA plugin of jax's own version, two "
      f"wheels: pip install \"jax-cuda12-plugin=={jax.__version__}\" "
      f"\"jax-cuda12-pjrt=={jax.__version__}\" (about 480 MB; no GPU, and none of the "
      f"multi-GB nvidia-* wheels of jax[cuda12], are needed), and JAX_PLATFORMS unset or "
      f"including cpu. It failed with: {type(e).__name__}: {e}")


@functools.lru_cache(maxsize=None)
def compile_only_devices(gpu: str | Target = "h100", *, hosts: int = 1,
                         per_host: int = 8) -> tuple:
  """``hosts * per_host`` compile-only devices of ``gpu``, host by host.

  Devices ``0 .. per_host-1`` have ``process_index`` 0, the next ``per_host`` 1, and so on.
  They compile programs (``step.lower(...).compile()``) but hold no arrays.
  """
  t = get_target(gpu)
  check_cluster(hosts, per_host)
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(t),
                                        topology=f"1x{hosts}x{per_host}")
  except Exception as e:  # the plugin is missing, or too old/new for this jax
    raise _plugin_error(e) from e
  return tuple(sorted(topo.devices, key=lambda d: (d.process_index, d.id)))


def compile_only_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], *,
                      gpu: str | Target = "h100", hosts: int = 1, per_host: int = 8,
                      axis_types=None):
  """A mesh of compile-only GPUs: compile a step for a cluster you do not have.

  Pass it as ``mesh=`` to `zj.make_sharded_train_step`, then
  ``step.lower(step.abstract_state(params), batch).compile()`` gives the program XLA:GPU
  would run there: its ``memory_analysis()`` and its schedule (``as_text()``). The mesh's
  devices are laid out host by host, so a first axis of size ``hosts`` spans the hosts (a
  ``replica_axis`` or ``hpz_axis`` across them) and the last axes stay within one.

  Args:
    axis_shapes: the mesh's shape; its product must be ``hosts * per_host``.
    axis_names: one name per axis.
    gpu: ``"h100"``, ``"h200"``, ``"a100"`` or a `Target`.
    hosts: hosts in the cluster.
    per_host: GPUs per host.
    axis_types: as `jax.make_mesh` (default Explicit for every axis).

  Returns:
    A `jax.sharding.Mesh`.

  Raises:
    RuntimeError: JAX's CUDA plugin is not installed (the message says how to install it).
    ValueError: the shape does not hold ``hosts * per_host`` devices, or an unknown ``gpu``.
  """
  import jax  # pylint: disable=import-outside-toplevel
  shape, names = tuple(axis_shapes), tuple(axis_names)
  check_cluster(hosts, per_host)
  if len(shape) != len(names):
    raise ValueError(f"axis_shapes={shape} and axis_names={names} differ in length.")
  if math.prod(shape) != hosts * per_host:
    raise ValueError(f"axis_shapes={shape} holds {math.prod(shape)} devices, but hosts={hosts} "
                     f"x per_host={per_host} is {hosts * per_host}: make the product match, "
                     f"e.g. ({hosts}, {per_host}) or ({hosts * per_host},).")
  devices = np.array(compile_only_devices(gpu, hosts=hosts, per_host=per_host), dtype=object)
  if axis_types is None:
    axis_types = (jax.sharding.AxisType.Explicit,) * len(shape)
  return jax.sharding.Mesh(devices.reshape(shape), names, axis_types=tuple(axis_types))
