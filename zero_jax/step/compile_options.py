"""What the step asks of XLA when it compiles, chosen from its mesh's devices.

`zero_jax.scan`'s backward layer loop has two to four collectives in flight (the next
layer's re-gather, and one gradient hop each: within the host, across hosts with hpZ or a
replica axis, across the replicas with both), and each must span a layer's matmuls. XLA:GPU
keeps one async collective in flight by default (`for_step` raises the limit to what the step
has), and on Ampere (A100) its latency-hiding scheduler is off by default, so every in-loop
reduce-scatter waited with no compute in its window (``GPU_OPTIONS`` turns it on; Hopper has
it on already). A layer's leaves travel in collectives of their own, which the combine
thresholds (``GPU_OPTIONS``) let XLA join into one per direction, each started as early as
it can be. Each collective more in flight holds its buffers longer: the docs' speed guide
gives the temporary memory this costs. The options go to the step's own ``jax.jit``. JAX
takes compiler options only from the outermost jit: a step called inside a
user's ``jax.jit`` or ``lax.scan`` compiles with that jit's options, so `jit` makes a user's
jit with the step's options, and the step warns once when it is traced inside any other jit
on GPUs.
"""

from __future__ import annotations

import functools
import threading
import warnings

import jax

LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
# Every compile (XLA:CPU accepts and ignores them); the limit is the step's own (`for_step`).
COMPILER_OPTIONS: dict = {}
# `zero_jax.scan` moves a layer's leaves split along their first dimension as collectives of
# their own (no joined buffer to copy them into and out of:
# `zero_jax.comm.collectives.Comm.pack`). XLA:GPU's combiners join a layer's into one variadic
# collective per direction when the layer fits their thresholds (all-gathers count what they
# return, reduce-scatters what they keep). XLA's default, 30 MiB, splits a Llama-3-8B layer
# (416 MiB gathered in bf16) into six all-gathers, more than the step keeps in flight; 512 MiB
# holds one such layer and no two. A larger layer is moved in several collectives.
COMBINE_BYTES = 512 << 20
# GPU meshes only. Each collective starts as soon as its operands exist: XLA's default cost
# model judged one matmul enough to hide a layer's gather and started it before the layer's
# last matmul, which left most of it exposed in the second layer of each iteration of the
# loops `zero_jax.layers.loops` unrolls by two (GPT-2 small, 1B: one matmul in those windows,
# every one of the layer's with this option). Measured on compile-only H100s: BENCHMARKS.md,
# "peer (cudnn attention)".
GPU_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True,
               "xla_gpu_experimental_collective_start_as_early_as_possible": True,
               **{f"xla_gpu_{op}_combine_threshold_bytes": COMBINE_BYTES
                  for op in ("all_gather", "reduce_scatter", "all_reduce")}}

_outer = threading.local()  # set while `jit` traces a user's function


def on_gpus(mesh) -> bool:
  """Whether ``mesh``'s devices are GPUs (real or compile-only)."""
  return all(d.platform in ("gpu", "cuda", "rocm") for d in mesh.devices.flat)


def in_flight(comm) -> int:
  """Collectives `zero_jax.scan`'s backward loop keeps in flight: the re-gather and one per
  gradient hop (`zero_jax.layers.stacked.hops`)."""
  across = bool(comm.outer_axes) + bool(comm.replica_axes)
  return 2 + across


def for_step(mesh, comm) -> dict:
  """The options the step's own jit passes to XLA on ``mesh``, for its ``comm`` record."""
  return {LIMIT: in_flight(comm), **COMPILER_OPTIONS, **(GPU_OPTIONS if on_gpus(mesh) else {})}


def jit(options: dict, fn, **jit_kwargs):
  """``jax.jit(fn, **jit_kwargs)`` compiling with ``options`` (the user's own
  ``compiler_options`` win), and tracing ``fn`` so that a step inside it does not warn."""
  mine = {**options, **(jit_kwargs.pop("compiler_options", None) or {})}

  @functools.wraps(fn)
  def traced(*args, **kwargs):
    depth = getattr(_outer, "depth", 0)
    _outer.depth = depth + 1
    try:
      return fn(*args, **kwargs)
    finally:
      _outer.depth = depth

  return jax.jit(traced, compiler_options=mine, **jit_kwargs)


def warn_if_nested(mesh, options: dict, warned: list) -> None:
  """Warns once per step (``warned``, a one-item list) when the step is traced inside a
  jit other than `jit`'s on GPUs: that jit's options, not the step's, compile it."""
  if warned[0] or getattr(_outer, "depth", 0) or not on_gpus(mesh):
    return
  warned[0] = True
  warnings.warn(
      f"zero_jax: the step is traced inside another jax.jit (or lax.scan) on GPUs, so that "
      f"jit's compiler options compile it, not the step's own {options}: without them "
      f"XLA:GPU keeps one collective in flight (and on A100s schedules none behind compute), "
      f"and zj.scan's in-loop collectives wait exposed. Make the outer jit with "
      f"step.jit(fn, ...) (jax.jit with the step's options), or pass "
      f"compiler_options=step.compiler_options to your jax.jit and silence this warning.",
      RuntimeWarning, stacklevel=4)
