"""GPU benchmark: tokens/s and MFU at stages 2 and 3, prefetch 0 and 1, with and without XLA's
latency-hiding-scheduler flags.

Writes the ``gpu`` section of BENCHMARKS.md, naming the device. Models (``_lm``): the LM
example's block at its largest preset size (``LM_EXAMPLE``) and a 1B configuration
(``GPT_1B``: 20 blocks of d=2048, bf16 with an fp32 master and AdamW: about 14 GB of state,
which one 80 GB H100 holds), on a 1-D mesh over every device. Each XLA flag set runs in
its own child process (flags are read when the backend starts); in a child, each stage's
prefetch 0 and 1 steps take turns (interleaved rounds), and a step time is the median (IQR)
over rounds. Prefetch 1 is ``zj.scan(..., prefetch=1)``; a ``zero_jax`` without ``zj.scan``
runs prefetch 0 only (``jax.lax.scan`` + ``zj.gather``), and the output says so.

- **tokens/s**: global tokens per step over the median step time.
- **MFU**: the architecture's training flops per token (``_lm.model_flops_per_token``:
  3x the forward matmuls, the recomputed forward pass not counted) times tokens/s, over the
  devices' peak dense bf16 flops (`PEAK_TFLOPS` by device kind, or ``--peak-tflops``).
- **HFU**: the matmul flops the program executes (counted by ``zero_jax.gpu.predict`` from the
  lowered program, recomputation included) over the same peak.
- **predicted**: ``zero_jax.gpu.predict``'s step time for the program on this device kind,
  where the model knows it (H100 SXM), beside the measured one.

Usage: ``python benchmarks/bench_gpu.py [--models lm,1b] [--flags default,lhs]
[--rounds 5] [--no-write]``; ``--smoke``: a tiny model on 4 CPU devices in seconds, printed
(and written to ``--out`` if given), never to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

LHS_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true "
             "--xla_gpu_enable_pipelined_all_gather=true "
             "--xla_gpu_enable_pipelined_reduce_scatter=true "
             "--xla_gpu_enable_pipelined_all_reduce=true "
             "--xla_gpu_enable_while_loop_double_buffering=true")
FLAG_SETS = {"default": "", "lhs": LHS_FLAGS}
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0"  # XLA:CPU compiles twice as fast
FLAG_TEXT = {"default": "XLA defaults", "lhs": "latency-hiding scheduler + pipelined collectives"}
# Dense bf16 peak per device kind (NVIDIA datasheets), first match wins.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="tiny model on 4 CPU devices; no write")
  p.add_argument("--models", default="lm,1b", help="comma-separated: lm, 1b")
  p.add_argument("--flags", default="default,lhs", help="comma-separated: default, lhs")
  p.add_argument("--stages", default=None,
                 help="comma-separated; default 2,3 (--smoke: 2 with the first flag set, 3 "
                      "with the second: every path once, in seconds)")
  p.add_argument("--rounds", type=int, default=None, help="default 5 (--smoke: 2)")
  p.add_argument("--iters", type=int, default=None,
                 help="steps per variant per round; default 3 (--smoke: 1)")
  p.add_argument("--peak-tflops", type=float, default=None, help="override the device's peak")
  p.add_argument("--precision", default=None, help="default: bf16 (fp32 with --smoke)")
  p.add_argument("--no-write", action="store_true", help="print only")
  p.add_argument("--out", default=None, help="also write the section's markdown here")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--json", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


# ------------------------------------------------------------------ child
def peak_flops(kind: str, override: float | None) -> float | None:
  if override:
    return override * 1e12
  return next((t * 1e12 for k, t in PEAK_TFLOPS if k in kind), None)


def models(args) -> list:
  import _lm  # pylint: disable=g-import-not-at-top
  if args.smoke:  # (config, rows per device)
    return [(_lm.GPTConfig("smoke", 64, 32, 2, 2, 16), 2)]
  table = {"lm": (_lm.LM_EXAMPLE, 32), "1b": (_lm.GPT_1B, 4)}
  return [table[m] for m in args.models.split(",")]


def measure_stage(cfg, rows, mesh, stage, args) -> dict:
  """Prefetch 0 and 1 at one stage, interleaved: times, HFU flops, predicted times."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import _lm
  import _timing
  import zero_jax as zj
  from zero_jax.gpu import predict as overlap
  n = mesh.size
  batch = jax.device_put(_lm.gpt_batch(cfg, rows * n, seed=0), NamedSharding(mesh, P("data")))
  params = jax.jit(lambda k: _lm.init_gpt(cfg, k), out_shardings=NamedSharding(mesh, P()))(
      jax.random.key(0))
  steps, states, programs = {}, {}, {}
  out: dict = {"flops": {}, "predicted": {}, "errors": {}}
  for p in ((0, 1) if _lm.has_prefetch() else (0,)):
    name = f"prefetch {p}"
    try:
      step = zj.make_sharded_train_step(_lm.make_gpt_loss(cfg, p), optax.adamw(1e-4),
                                        mesh=mesh, stage=stage, precision=args.precision,
                                        stacked=_lm.in_blocks)
      states[name] = step.init(params)
      programs[p] = overlap.analyze(step.lower(states[name], batch).as_text(dialect="hlo"))
      out["flops"][name] = programs[p].total_flops()
      if "H100" in out_kind(mesh) and "PCIe" not in out_kind(mesh):  # both from prefetch 0's
        out["predicted"][name] = overlap.predict(programs.get(0, programs[p]),
                                                 overlap.H100_SXM).step(p)
      states[name], _ = step(states[name], batch)  # compiles and runs once: an OOM shows here
      jax.block_until_ready(states[name])
      steps[name] = step
    except Exception as e:  # an OOM or a missing feature: recorded in the table
      first = (str(e).splitlines() or [""])[0]
      out["errors"][name] = f"{type(e).__name__}: {first[:200]}"
      states.pop(name, None)
  del params
  if steps:
    t = _timing.interleave(_timing.steppers(steps, states, batch), rounds=args.rounds,
                           iters=args.iters)
    out["times"] = t
  return out


def out_kind(mesh) -> str:
  return mesh.devices.flat[0].device_kind


def child(args) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
  import numpy as np
  from jax.sharding import Mesh
  import _lm
  mesh = Mesh(np.array(jax.devices()), ("data",))
  kind = out_kind(mesh)
  res = {"device": f"{jax.device_count()} x {kind} ({jax.devices()[0].platform})",
         "peak": peak_flops(kind, args.peak_tflops), "n": mesh.size, "rows": [],
         "prefetch": "zj.scan" if _lm.has_prefetch() else "jax.lax.scan + zj.gather only",
         "xla_flags": os.environ.get("XLA_FLAGS", ""), "jax": jax.__version__}
  for cfg, rows in models(args):
    for stage in (int(s) for s in args.stages.split(",")):
      t0 = time.perf_counter()
      r = measure_stage(cfg, rows, mesh, stage, args)
      r.update(model=cfg.name, params=cfg.n_params(), stage=stage,
               tokens=rows * mesh.size * cfg.seq_len,
               model_flops=_lm.model_flops_per_token(cfg), seconds=time.perf_counter() - t0)
      res["rows"].append(r)
      print(f"  {cfg.name}, stage {stage}: {r['seconds']:.0f} s", flush=True)
  return res


# ----------------------------------------------------------------- parent
def run_children(args, argv: list) -> dict:
  script = os.path.abspath(__file__)
  passed = [a for a in argv if a != "--no-write"]
  results = {}
  for i, name in enumerate(args.flags.split(",")):
    stages = args.stages or ("23"[i % 2] if args.smoke else "2,3")
    env = dict(os.environ)
    smoke = SMOKE_XLA_FLAGS if args.smoke else ""
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), smoke, FLAG_SETS[name]) if f)
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "out.json")
      print(f"--- {FLAG_TEXT[name]}: XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
      subprocess.run([sys.executable, script, *passed, "--child", name, "--json", path,
                      "--stages", stages], env=env, check=True)
      with open(path) as f:
        results[name] = json.load(f)
  return results


def _q(xs):
  import numpy as np  # pylint: disable=g-import-not-at-top
  return np.percentile(np.array(xs), [25, 50, 75])


def row_cells(r: dict, name: str, peak, n: int) -> list:
  if name in r["errors"]:
    return [r["errors"][name]] + [""] * 5
  lo, med, hi = _q(r["times"][name])
  tok = r["tokens"] / med
  pct = lambda flops: f"{flops / med / (n * peak):.1%}" if peak else "n/a (peak unknown)"
  pred = r["predicted"].get(name)
  return [f"{med * 1e3:.1f} ({lo * 1e3:.1f}-{hi * 1e3:.1f})", f"{tok:,.0f}",
          pct(r["model_flops"] * r["tokens"]), pct(r["flops"][name] * n),
          f"{pred * 1e3:.1f}" if pred else "-"]


def render(results: dict, seconds: float) -> str:
  first = next(iter(results.values()))
  import _timing  # pylint: disable=g-import-not-at-top
  lines = [f"## gpu: tokens/s and MFU, stages 2 and 3, prefetch 0 and 1, XLA flags", "",
           f"Measured by `python benchmarks/bench_gpu.py` on {first['device']}, jax "
           f"{first['jax']} ({seconds / 60:.1f} min); prefetch: {first['prefetch']}. Step "
           f"time: median (IQR) over interleaved rounds, ms. MFU: model flops (architecture) "
           f"per second over the devices' peak; HFU: executed matmul flops (counted in the "
           f"program, recomputation included) over the same peak; predicted: "
           f"`zero_jax.gpu.predict`'s step time for this program on this device kind.", ""]
  for flag, res in results.items():
    lines += [f"### {FLAG_TEXT[flag]} (`XLA_FLAGS={res['xla_flags'] or '(none)'}`)", ""]
    rows = []
    for r in res["rows"]:
      for name in list(r.get("times", {})) + list(r["errors"]):
        rows.append([r["model"], f"{r['params']:,}", r["stage"], name, r["tokens"],
                     *row_cells(r, name, res["peak"], res["n"])])
      if len(r.get("times", {})) == 2:
        rows.append([r["model"], "", r["stage"], "prefetch 1 / 0", "",
                     _timing.ratio_iqr(r["times"], "prefetch 1", "prefetch 0"), "", "", "", ""])
    lines += [_timing.table(["model", "params", "stage", "schedule", "tokens / step", "ms / step",
                             "tokens/s", "MFU", "HFU", "predicted ms"], rows), ""]
  return "\n".join(lines)


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  args = parse_args(argv)
  for name, full, smoke in (("precision", "bf16", "fp32"), ("rounds", 5, 2), ("iters", 3, 1)):
    if getattr(args, name) is None:
      setattr(args, name, smoke if args.smoke else full)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  if args.child is not None:
    with open(args.json, "w") as f:
      json.dump(child(args), f)
    return
  t0 = time.perf_counter()
  text = render(run_children(args, argv), time.perf_counter() - t0)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  if not (args.smoke or args.no_write):
    from _report import write_section  # pylint: disable=g-import-not-at-top
    write_section("gpu", text)


if __name__ == "__main__":
  main()
