"""One candidate on a target: its step built and compiled for compile-only GPUs, then read.

`build_step` makes the `make_sharded_train_step` step of a candidate's options (binding the
loss's ``prefetch`` and ``policy`` keywords); `estimate` predicts a lowered program's step time
(to rank candidates before compiling them: matmuls and communication, plus an offloaded
state's host copies; the lowered program is not fused, so its elementwise work is left out);
`read` takes the GPU-compiled program's memory (XLA's ``memory_analysis()``) and, from its
text, its compute (`zero_jax.gpu.predict`: matmuls and memory-bound kernels), its step time
walked along the schedule XLA:GPU compiled (`zero_jax.gpu.timeline`: the kernels on one
stream, the collectives in flight sharing their links, the stream waiting at each done) and
the bytes each device sends within and across hosts. Times are predictions (on the target's
published figures), never measurements.

Example (on the 8 CPU devices here; `zero_jax.compile_only_mesh` gives the GPU's program):
  >>> import jax, jax.numpy as jnp, optax
  >>> from zero_jax.gpu import measure, targets
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> step = measure.build_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1),
  ...                           {"stage": 2}, mesh, {})
  >>> params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
  >>> lowered = step.lower(step.abstract_state(params), jax.ShapeDtypeStruct((16, 64), jnp.float32))
  >>> r = measure.read(lowered.compile(), measure.device_for(targets.H100, 8, "fp32"))
  >>> r.memory.argument >= 64 * 32 * 4, r.step_s > r.compute_s > 0
  (True, True)
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
from jax.experimental.compilation_cache import compilation_cache

from zero_jax.gpu import links, predict, timeline
from zero_jax.gpu.program import combined
from zero_jax.gpu.targets import Target
from zero_jax.step.compile_options import COMBINE_BYTES
from zero_jax.step.memory import CompiledMemory
from zero_jax.step.train_step import make_sharded_train_step

# Options that only cut the planner's compile time and host memory: LLVM's optimisation of the
# generated kernels, and one LLVM module compiled at a time instead of split over threads (with
# the split, an int4 GPT-2 small program took 925 MiB to compile, without it 350 MiB). Both act
# after XLA has assigned every buffer: the memory analysis is the same (tests/gpu check it).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                "xla_gpu_force_compilation_parallelism": 1}
# Bytes/s each way between a GPU and its host's pinned memory: PCIe Gen5 x16 (H100, H200),
# Gen4 x16 (A100), about 80% of the link's 64 and 32 GB/s as measured copies reach.
HOST_LINK = {"h100": 50e9, "h200": 50e9, "a100": 25e9}


class Reading(NamedTuple):
  """What one compiled program holds and is predicted to take.

  Attributes:
    memory: XLA's memory analysis of the program, per device.
    compute_s: predicted compute time of one step (the program's matmul flops at the target's
      peak, plus its other kernels' bytes over HBM bandwidth).
    step_s: predicted step time: the schedule walked (`zero_jax.gpu.timeline`), compute plus
      the waits for collectives and the kernels' slowdown under them.
    intra_bytes: bytes each device sends per step to devices of its own host.
    cross_bytes: bytes each device sends per step across hosts.
    elementwise_s: the part of ``compute_s`` the memory-bound kernels take.
  """
  memory: CompiledMemory
  compute_s: float
  step_s: float
  intra_bytes: float
  cross_bytes: float
  elementwise_s: float = 0.0


def device_for(target: Target, per_host: int, precision: str) -> predict.Device:
  """The overlap model's `zero_jax.gpu.predict.Device` for ``target``
  (`zero_jax.gpu.predict.device_from_target`: matmul efficiency by shape, NCCL's slowdown):
  bf16/fp16 tensor-core peak for a half-precision policy, TF32's for ``"fp32"``."""
  device = predict.device_from_target(target, per_host)
  return device._replace(peak_flops=target.peak_flops_fp32) if precision == "fp32" else device


def loss_keywords(opts: dict) -> dict:
  """The keywords a candidate binds to the loss: ``prefetch`` (unless None: the loss takes
  none) and ``policy`` (when present: None keeps every activation)."""
  out = {"prefetch": opts["prefetch"]} if opts.get("prefetch") is not None else {}
  if "policy" in opts:
    out["policy"] = opts["policy"]
  return out


def build_step(loss_fn, optimizer, opts: dict, mesh, fixed: dict):
  """The step of one candidate: ``fixed`` and ``opts`` (its `loss_keywords` bound to
  ``loss_fn``) on ``mesh``. Raises what `make_sharded_train_step` raises."""
  bound = loss_keywords(opts)
  fn = functools.partial(loss_fn, **bound) if bound else loss_fn
  kw = {**fixed, **{k: v for k, v in opts.items() if k not in ("prefetch", "policy")}}
  return make_sharded_train_step(fn, optimizer, mesh=mesh, **kw)


def offload_s(host_bytes: float, target: Target) -> float:
  """Seconds per step to copy an offloaded state to the GPU and back over PCIe."""
  return 2 * host_bytes / HOST_LINK.get(target.key, 25e9)


def estimate(lowered, device: predict.Device, prefetch) -> float:
  """Predicted step time of a lowered (not compiled) program: to rank candidates. Its
  collectives are combined as XLA's combiners will combine them under the step's GPU options
  (`zero_jax.gpu.program.combined` up to `zero_jax.step.compile_options.COMBINE_BYTES`: one
  per leaf in the lowered program, one a layer each way in the compiled one); its elementwise
  work is left out (the program is not fused yet)."""
  text = lowered.as_text(dialect="hlo")
  p = predict.predict(combined(predict.analyze(text, elementwise=False), COMBINE_BYTES), device)
  return p.step(prefetch or 0)


def sent_bytes(program: predict.Loop, device: links.Device) -> tuple[float, float]:
  """``(within hosts, across hosts)``: bytes one device sends in one run of ``program``
  (averaged over the devices: of a ring spanning hosts with ``m`` members in each, ``1/m``
  crosses, `zero_jax.gpu.links.cross_host_bytes`)."""
  totals = [0.0, 0.0]

  def visit(loop: predict.Loop, runs: int) -> None:
    for t in loop.transfers:
      sent = links.wire_bytes(t, device)
      cross = links.cross_host_bytes(t, device)
      totals[0] += runs * loop.trips * (sent - cross)
      totals[1] += runs * loop.trips * cross
    for inner in loop.loops:
      visit(inner, runs * loop.trips)

  visit(program, 1)
  return totals[0], totals[1]


@contextlib.contextmanager
def without_persistent_cache():
  """JAX's persistent compilation cache off for the compiles inside, then as it was.

  A program compiled for compile-only devices is written to the cache but cannot be read
  back ("PjRtCompiler must be constructed with a Client"): with ``jax_compilation_cache_dir``
  set, compiling the same candidate again would warn, then compile anyway. JAX decides once
  per process whether it uses the cache, so the decision is reset on the way in and out (the
  next compile after it reopens the user's cache). Compiles in other threads meanwhile skip
  the cache too.
  """
  if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
    yield
    return
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


def memory_of(compiled) -> CompiledMemory:
  """XLA's per-device figures of a compiled program."""
  s = compiled.memory_analysis()
  return CompiledMemory(int(s.argument_size_in_bytes), int(s.output_size_in_bytes),
                        int(s.alias_size_in_bytes), int(s.temp_size_in_bytes),
                        int(s.generated_code_size_in_bytes))


def read(compiled, device: predict.Device) -> Reading:
  """A compiled program's memory, its predicted step time (its schedule walked by
  `zero_jax.gpu.timeline.simulate`, what ``zj.plan`` ranks by) and the bytes it sends."""
  text = compiled.as_text()
  program = predict.analyze(text)
  p = predict.predict(program, device)
  intra, cross = sent_bytes(program, device)
  step = timeline.simulate(text, device).step
  return Reading(memory_of(compiled), p.compute, step, intra, cross, p.elementwise)
