"""Where a leaf of the state lives between steps: device memory or ``pinned_host``.

The facts that the options, the state and the update share about memory kinds, below
`zero_jax.step.spec` in the import graph; `zero_jax.step.offload` streams the update with them.
``spec`` arguments are `zero_jax.step.spec.StepSpec`s and ``tree`` a `zero_jax.step.state.TrainState`
(duck-typed here, so that this module imports neither).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from zero_jax.comm import layout as lay

HOST = "pinned_host"
DEVICE = "device"


# -------------------------------------------------------------- where it lives
def check_backend(mesh) -> None:
  """Raises ValueError if a local device of ``mesh`` has no ``pinned_host`` memory."""
  for d in mesh.devices.flat:
    if d.process_index != jax.process_index():
      continue
    try:
      kinds = sorted(m.kind for m in d.addressable_memories())
    except Exception:  # a backend without memory spaces  # noqa: BLE001
      kinds = []
    if HOST not in kinds and "CompileOnly" in type(d.client).__name__:
      raise ValueError(
          f"offload='optimizer' cannot be compiled on compile-only devices ({d}, e.g. from "
          f"zj.compile_only_mesh): they list no memory kinds, so JAX would drop "
          f"memory_kind={HOST!r} and the program would keep the optimizer state on the "
          f"device. Real GPUs have {HOST!r}. Without one, read the offloaded step's memory "
          f"with zj.memory_report(..., offload='optimizer'), and its host transfers in the "
          f"program lowered for CUDA from a CPU mesh: step.lower(state, batch, "
          f"lowering_platforms=('cuda',)).as_text(); or compile without offload here.")
    if HOST not in kinds:
      raise ValueError(
          f"offload='optimizer' keeps the optimizer state and master copy in "
          f"{HOST!r} memory, but device {d} (platform {d.platform!r}) has only the "
          f"memory kinds {kinds}, so this backend cannot hold arrays in host memory. "
          f"Use offload=None here (stage=3 or more devices also cut the optimizer "
          f"state per device), or run on a backend whose devices list {HOST!r} in "
          f"device.addressable_memories().")


def host_resident(tree: Any) -> Any:
  """``tree`` (a TrainState of specs or arrays) with True where offload keeps a leaf on the host:
  the optimizer state and the master copy."""
  mark = lambda t, v: jax.tree.map(lambda _: v, t)
  return tree.replace(
      step=False, params=mark(tree.params, False), master=mark(tree.master, True),
      opt_state=mark(tree.opt_state, True), loss_scale=mark(tree.loss_scale, False),
      model_state=mark(tree.model_state, False), rng=mark(tree.rng, False))


def memory_kind(spec: Any, host_resident: bool) -> str | None:
  """The memory kind of a leaf between steps: `HOST`, or None (the device's default)."""
  return HOST if host_resident and spec.offload is not None else None


def to_memory(spec: Any, x, layout: lay.Layout, kind: str):
  """``x`` (a storage leaf) moved to memory ``kind``, same sharding (offload only)."""
  if spec.offload is None:
    return x
  return jax.device_put(x, NamedSharding(spec.auto_mesh, layout.spec(spec.data_axes),
                                         memory_kind=kind))


def load(spec: Any, x, layout: lay.Layout):
  """A host storage leaf -> its logical view on the devices."""
  return spec.to_logical(to_memory(spec, x, layout, DEVICE), layout)


def store(spec: Any, x, layout: lay.Layout):
  """A logical view on the devices -> its storage leaf in host memory."""
  return to_memory(spec, spec.to_storage(x, layout), layout, HOST)


def device_bytes(layout: lay.Layout, n: int, dtype) -> int:
  """Bytes of one device's block of a leaf stored with ``layout``."""
  return math.prod(lay.local_storage_shape(layout, n)) * jnp.dtype(dtype).itemsize
