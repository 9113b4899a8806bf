"""How long `zj.plan` takes, and how much host memory, for GPT-2 small on 2 hosts x 8 H100s.

Two models, each planned in a fresh process of its own: GPT-2 small (``_lm.GPT2_SMALL``: 12
stacked blocks of d=768, vocabulary 50257, context 1024, 124M parameters), the issue's case,
and the 1B model (``_lm.GPT_1B``: 20 blocks of d=2048, context 2048), to show what grows with
the model. Each is given as an init function, never run; the global batch is 8 sequences per
GPU; bf16 with an fp32 master copy and AdamW; ``loss_fn`` takes zj.scan's ``prefetch``. The
default space of `zero_jax.gpu.candidates` is searched (exact communication: no
``quantize="search"``). Needs JAX's CUDA plugin (no GPU) and tqdm (the example's model is
imported).

Reported per model: wall time, the process's CPU time (its threads) and its children's
(ptxas), the machine's load average before and after (the machine may be shared), the peak
resident memory of the process, and its rise from the moment JAX and the compile-only
devices are up (what planning itself adds), against the model's bytes (float32 parameters).

Usage: ``python benchmarks/bench_plan.py [--models small,1b] [--max-compiles 4]
[--workers 2] [--no-write]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB = 2**20


def plan_one(model: str, max_compiles: int, workers: int) -> dict:
  """Plans ``model`` in this process; its figures, and the plan's table."""
  load0 = os.getloadavg()
  import jax  # pylint: disable=import-outside-toplevel
  import optax
  import _lm
  import _peak
  import zero_jax as zj
  zj.compile_only_mesh((2, 8), ("hosts", "data"), gpu="h100", hosts=2)  # the backend, up
  attention, _ = _lm.fused_attention("h100")  # cuDNN's fused kernel, where it compiles here
  cfg = _lm.with_attention({"small": _lm.GPT2_SMALL, "1b": _lm.GPT_1B}[model], attention)
  base = _peak.reset_peak()

  def loss_fn(params, batch, *, prefetch=0, policy=None):  # zj.scan's: the plan searches them
    return _lm.make_gpt_loss(cfg, prefetch, policy)(params, batch)

  cpu0, t0 = time.process_time(), time.perf_counter()
  plan = zj.plan(loss_fn, optax.adamw(3e-4), lambda: _lm.init_gpt(cfg, jax.random.key(0)),
                 _lm.gpt_batch_shape(cfg, 8 * 16), gpu="h100", hosts=2, per_host=8,
                 precision="bf16", stacked=_lm.in_blocks, max_compiles=max_compiles,
                 workers=workers)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return {"name": cfg.name, "layers": cfg.layers, "params": cfg.n_params(),
          "wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0,
          "child_cpu": children.ru_utime + children.ru_stime,
          "lower": plan.seconds["lower"], "compile": plan.seconds["compile"],
          "lowered": len(plan.candidates) + len(plan.ranked_out),
          "peak": _peak.status("VmHWM"), "base": base, "load": [load0[0], os.getloadavg()[0]],
          "jax": jax.__version__, "table": str(plan), "attention": attention}


def in_child(model: str, args) -> dict:
  """`plan_one` in a fresh process (its peak memory is its own)."""
  out = subprocess.run([sys.executable, __file__, "--child", model, "--max-compiles",
                        str(args.max_compiles), "--workers", str(args.workers)],
                       check=True, capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def report(runs: list[dict], workers: int) -> str:
  """The section: a row per model, then the first model's plan."""
  r0 = runs[0]
  lines = [f"## plan: zj.plan for {r0['name']} ({r0['layers']} layers, "
           f"{r0['params'] / 1e6:.0f}M parameters) on 2 hosts x 8 H100", "",
           f"Measured by `python benchmarks/bench_plan.py` on {os.cpu_count()} CPU cores, no GPU "
           f"(compile-only H100s), jax {r0['jax']}, each model planned in a fresh process, "
           f"{workers} compiles at a time, attention {r0['attention']} (`_lm.fused_attention`: "
           f"cuDNN's fused kernel where it compiles here). Peak memory is the process's resident peak (VmHWM); "
           f"\"planning added\" is its rise from the moment Python, JAX and the compile-only "
           f"devices are up. None of the models' parameters are materialised.", "",
           "| model | parameters (float32) | a tenth of them | wall time | lowering | compiles "
           "(summed over threads) | CPU: process / ptxas | peak memory | planning added | "
           "load average before / after |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in runs:
    fp32 = 4 * r["params"]
    lines.append(
        f"| {r['name']} ({r['params'] / 1e6:,.0f}M) | {fp32 / MiB:,.0f} MiB | "
        f"{fp32 / 10 / MiB:,.0f} MiB | **{r['wall']:.0f} s** | {r['lower']:.0f} s "
        f"({r['lowered']} candidates) | {r['compile']:.0f} s | {r['cpu']:.0f} s / "
        f"{r['child_cpu']:.0f} s | {r['peak'] / MiB:,.0f} MiB | **{(r['peak'] - r['base']) / MiB:,.0f}"
        f" MiB** | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
  lines += ["", f"The plan for {r0['name']}:", "", r0["table"]]
  return "\n".join(lines)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--models", default="small,1b")
  p.add_argument("--max-compiles", type=int, default=4)
  p.add_argument("--workers", type=int, default=2)
  p.add_argument("--no-write", action="store_true")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print(json.dumps(plan_one(args.child, args.max_compiles, args.workers)))
    return
  runs = [in_child(m, args) for m in args.models.split(",")]
  text = report(runs, args.workers)
  print(text)
  if not args.no_write:
    import _report  # pylint: disable=import-outside-toplevel
    _report.write_section("plan", text)


if __name__ == "__main__":
  main()
