"""How long `zj.plan` takes, and how much host memory, for GPT-2 small on 2 hosts x 8 H100s.

The model (``_lm.GPT2_SMALL``: 12 stacked blocks of d=768, vocabulary 50257, context 1024,
124M parameters) is given as an init function, never run; the global batch is 8 sequences per
GPU; bf16 with an fp32 master copy and AdamW; ``loss_fn`` takes zj.scan's ``prefetch``. The
whole space of `zero_jax.gpu.candidates` is searched (quantization included). Needs JAX's CUDA
plugin (no GPU) and tqdm (the example's model is imported).

Reported: wall time, this process's CPU time (its threads) and its children's (ptxas), the
machine's load average before and after (the machine may be shared), the peak resident memory
of the process, and its rise from the moment JAX and the compile-only devices are up (what
planning itself adds), against the model's bytes (float32 parameters).

Usage: ``python benchmarks/bench_plan.py [--layers 12] [--max-compiles 4] [--workers 2]
[--no-write]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--max-compiles", type=int, default=4)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--no-write", action="store_true")
  args = p.parse_args(argv)
  load0 = os.getloadavg()
  import jax  # pylint: disable=import-outside-toplevel
  import optax
  import _lm
  import _peak
  import _report
  import zero_jax as zj
  cfg = _lm.GPT2_SMALL._replace(layers=args.layers)
  zj.compile_only_mesh((2, 8), ("hosts", "data"), gpu="h100", hosts=2)  # the backend, up
  base = _peak.reset_peak()

  def loss_fn(params, batch, *, prefetch=0):
    return _lm.make_gpt_loss(cfg, prefetch)(params, batch)

  cpu0, t0 = time.process_time(), time.perf_counter()
  children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
  plan = zj.plan(loss_fn, optax.adamw(3e-4), lambda: _lm.init_gpt(cfg, jax.random.key(0)),
                 _lm.gpt_batch_shape(cfg, 8 * 16), gpu="h100", hosts=2, per_host=8,
                 precision="bf16", stacked=_lm.in_blocks, max_compiles=args.max_compiles,
                 workers=args.workers)
  wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  child_cpu = (children.ru_utime + children.ru_stime) - (children0.ru_utime + children0.ru_stime)
  peak = _peak.status("VmHWM")
  model_bytes = 4 * cfg.n_params()
  load1 = os.getloadavg()
  mib = lambda b: f"{b / 2**20:,.0f} MiB"
  lines = [
      f"## plan: zj.plan for {cfg.name} ({args.layers} layers, {cfg.n_params() / 1e6:.0f}M "
      f"parameters) on 2 hosts x 8 H100", "",
      f"Measured by `python benchmarks/bench_plan.py` on {os.cpu_count()} CPU cores, no GPU "
      f"(compile-only H100s), jax {jax.__version__}; load average {load0[0]:.1f} before, "
      f"{load1[0]:.1f} after (a shared machine: other jobs ran beside it).", "",
      f"- wall time: **{wall:.0f} s** ({plan.seconds['lower']:.0f} s lowering "
      f"{len(plan.candidates) + len(plan.ranked_out)} candidates, "
      f"{plan.seconds['compile']:.0f} s of compiles summed over {args.workers} threads); CPU "
      f"time {cpu:.0f} s in this process, {child_cpu:.0f} s in its children (ptxas)",
      f"- peak host memory: **{mib(peak)}** resident; planning added {mib(peak - base)} to the "
      f"{mib(base)} of Python, JAX and the compile-only devices; the model's float32 "
      f"parameters are {mib(model_bytes)} (a tenth: {mib(model_bytes / 10)}), none of them "
      f"materialised", "", str(plan)]
  text = "\n".join(lines)
  print(text)
  if not args.no_write:
    _report.write_section("plan", text)


if __name__ == "__main__":
  main()
