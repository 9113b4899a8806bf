"""Predicted exposed communication on H100s, with and without prefetch (a model, not a run).

Writes the ``overlap-model`` section of BENCHMARKS.md. For GPT-2 small's shapes and a 1B
model (``_lm.GPT2_SMALL``, ``_lm.GPT_1B``: the LM example's block, bf16, AdamW, 8192 tokens
per device) it lowers the training step on 16 fake CPU devices for 8 H100s in one host and
2 x 8 in two (flat, hybrid ``replica_axis=`` and hpZ), reads each program with
``zero_jax.gpu.predict.analyze`` (per layer: matmul flops and bytes, collectives, their
bytes and device groups) and predicts per-layer compute and communication time and the
step's time with prefetch 0 (serial) and 1 (``zj.scan``: one layer ahead) on
``overlap.H100_SXM``.

Beside the CPU-derived prediction it puts the one read off XLA:GPU's own schedule
(``zero_jax.gpu.predict.predict_scheduled``) of the same step with ``zj.scan(prefetch=1)``,
compiled for compile-only H100s by ``bench_gpu_compile.py`` (run it first: it keeps the
programs' text; where one is missing and JAX's CUDA plugin is installed it is compiled here).

Usage: ``python benchmarks/bench_overlap.py [--quick] [--no-write]
[--compute-efficiency 0.6] [--link-efficiency 0.8]``.
"""

from __future__ import annotations

import argparse
import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 16)  # before the backend starts
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import _lm  # noqa: E402
import zero_jax as zj  # noqa: E402
from zero_jax.gpu import predict as overlap  # noqa: E402

TOKENS_PER_DEVICE = 8192


def gpu_schedule_exposed(model: str, name: str, args) -> float | None:
  """Seconds of communication XLA:GPU's schedule of this step (prefetch 1) leaves exposed on
  H100s, or None where the program is neither kept by bench_gpu_compile.py nor compilable."""
  import bench_gpu_compile as gc  # pylint: disable=import-outside-toplevel
  if name not in gc.configs():
    return None
  path = gc.program_path(model, name)
  if not path.exists():
    try:
      cfg = next(c for c in (_lm.GPT2_SMALL, _lm.GPT_1B) if c.name == model)
      gc.PROGRAMS.mkdir(exist_ok=True)
      path.write_text(gc.compile_gpu(cfg, name)[0].as_text())
    except RuntimeError as e:  # no CUDA plugin
      print(f"{model} {name}: no GPU program ({e})")
      return None
  loops = overlap.predict_scheduled(path.read_text(), overlap.H100_SXM,
                                    compute_efficiency=args.compute_efficiency,
                                    link_efficiency=args.link_efficiency)
  return sum(l.step_exposed for l in loops)


def configs() -> dict:
  """``{name: (mesh shape, step options)}``; a 2-D mesh is (hosts, devices per host)."""
  two = ("replica", "data")
  return {
      "8, ZeRO-2": ((8,), {"stage": 2}),
      "8, ZeRO-3": ((8,), {"stage": 3}),
      "2x8, ZeRO-2 flat": ((2, 8), {"stage": 2, "axis_name": two}),
      "2x8, ZeRO-2 hybrid": ((2, 8), {"stage": 2, "axis_name": "data", "replica_axis": "replica"}),
      "2x8, ZeRO-3 flat": ((2, 8), {"stage": 3, "axis_name": two}),
      "2x8, ZeRO-3 hybrid": ((2, 8), {"stage": 3, "axis_name": "data", "replica_axis": "replica"}),
      "2x8, ZeRO-3 hpZ": ((2, 8), {"stage": 3, "axis_name": two, "hpz_axis": "data"}),
  }


def lowered_text(cfg: _lm.GPTConfig, shape: tuple, options: dict) -> str:
  """The lowered (pre-optimisation) HLO of one training step of ``cfg``."""
  n = int(np.prod(shape))
  names = ("data",) if len(shape) == 1 else ("replica", "data")
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape), names)
  params = jax.eval_shape(lambda k: _lm.init_gpt(cfg, k), jax.random.key(0))
  step = zj.make_sharded_train_step(_lm.make_gpt_loss(cfg, prefetch=0), optax.adamw(1e-4),
                                    mesh=mesh, precision="bf16", stacked=_lm.in_blocks,
                                    **options)
  rows = n * TOKENS_PER_DEVICE // cfg.seq_len
  lowered = step.lower(step.abstract_state(params), _lm.gpt_batch_shape(cfg, rows))
  return lowered.as_text(dialect="hlo")


def layer_loops(pred: overlap.Prediction) -> tuple:
  """(forward, backward) layer loops: the backward one does the most matmul work."""
  loops = sorted((l for l in pred.loops if l.compute > 0), key=lambda l: l.compute)
  return loops[0], loops[-1]


def rest_of_step(pred: overlap.Prediction, layers) -> tuple[float, float]:
  """(compute, communication) seconds outside the two layer loops (e.g. the embedding, the
  head, stage 2's per-leaf gather loops of the update), serial in both schedules."""
  others = [l for l in pred.loops if l not in layers]
  return (pred.serial_compute + sum(l.runs * l.trips * l.compute for l in others),
          pred.serial_comm + sum(l.runs * l.trips * (l.gather + l.reduce) for l in others))


def gather_loops(program: overlap.Loop) -> tuple[int, float]:
  """How many loops only all-gather (stage 2's update gathers), and their ring latency (s)."""
  loops = [l for l in program.loops if not l.dots and l.transfers
           and all(t.op == "all-gather" for t in l.transfers)]
  latency = sum(l.trips * overlap.transfer_time(t._replace(nbytes=0), overlap.H100_SXM)
                for l in loops for t in l.transfers)
  return len(loops), latency


def measure(args) -> dict:
  models = [_lm.GPT2_SMALL] if args.quick else [_lm.GPT2_SMALL, _lm.GPT_1B]
  out = {}
  for cfg in models:
    for name, (shape, options) in configs().items():
      if args.quick and "hybrid" in name:
        continue
      t0 = time.perf_counter()
      program = overlap.analyze(lowered_text(cfg, shape, options))
      pred = overlap.predict(program, overlap.H100_SXM,
                             compute_efficiency=args.compute_efficiency,
                             link_efficiency=args.link_efficiency)
      fwd, bwd = layer_loops(pred)
      n = int(np.prod(shape))
      out[(cfg.name, name)] = {
          "fwd": fwd, "bwd": bwd, "compute": pred.compute, "n": n,
          "rest": rest_of_step(pred, (fwd, bwd)),
          "gather_loops": gather_loops(program),
          "cross_after": [(t.op, overlap.transfer_time(t, overlap.H100_SXM,
                                                       args.link_efficiency))
                          for t in program.transfers
                          if overlap.crosses_hosts(t, overlap.H100_SXM)],
          "step": {p: pred.step(p) for p in (0, 1)},
          "exposed": {p: pred.exposed(p) for p in (0, 1)},
          "gpu_exposed": gpu_schedule_exposed(cfg.name, name, args),
          "tokens_per_s": {p: n * TOKENS_PER_DEVICE / pred.step(p) for p in (0, 1)},
          "mfu": {p: _lm.model_flops_per_token(cfg) * TOKENS_PER_DEVICE / pred.step(p)
                  / overlap.H100_SXM.peak_flops for p in (0, 1)}}
      print(f"{cfg.name:12s} {name:22s} step {pred.step(0) * 1e3:8.1f} -> "
            f"{pred.step(1) * 1e3:8.1f} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
  return out


def ms(x: float) -> str:
  return f"{x * 1e3:.2f}"


def reading(out: dict) -> list:
  """Sentences that read the table (the figures are the table's)."""
  lines = []
  for model in dict.fromkeys(m for m, _ in out):
    one, flat = out[(model, "8, ZeRO-3")], out.get((model, "2x8, ZeRO-3 flat"))
    f = one["fwd"]
    lines.append(
        f"- **{model}, one host:** a layer's forward gather takes {ms(f.gather)} ms against "
        f"{ms(f.compute)} ms of compute, so prefetch hides nearly all of the layers' "
        f"collectives: ZeRO-3's exposed communication {ms(one['exposed'][0])} -> "
        f"{ms(one['exposed'][1])} ms, the step {one['step'][0] / one['step'][1]:.2f}x faster.")
    two = out[(model, "8, ZeRO-2")]
    lines.append(
        f"- **{model}, ZeRO-2:** only the backward reduce-scatter is in the layer loop. After "
        f"the update, the stacked leaves are gathered back one layer at a time in "
        f"{two['gather_loops'][0]} loop (one per stack depth; a layer's leaves together, those "
        f"above the bucket size in collectives of their own), serial in both schedules: of "
        f"the {ms(two['rest'][1])} ms of communication outside the layer loops, "
        f"{ms(two['gather_loops'][1])} ms is that loop's ring latency.")
    if flat:
      lines.append(
          f"- **{model}, two hosts, flat ZeRO-3:** every gather crosses the "
          f"{overlap.H100_SXM.cross.bandwidth / 1e9:.0f} GB/s link ({ms(flat['fwd'].gather)} ms "
          f"a layer forward); prefetch hides what the compute covers: exposed "
          f"{ms(flat['exposed'][0])} -> {ms(flat['exposed'][1])} ms, the step "
          f"{flat['step'][0] / flat['step'][1]:.2f}x faster.")
    hpz = out.get((model, "2x8, ZeRO-3 hpZ"))
    if hpz:
      grads = [t for op, t in hpz["cross_after"] if op != "all-gather"]
      refresh = [t for op, t in hpz["cross_after"] if op == "all-gather"]
      lines.append(
          f"- **{model}, two hosts, hpZ:** the gathers stay in the host; the gradient's "
          f"cross-host hop runs per layer in the backward loop ({ms(hpz['bwd'].cross_host)} ms "
          f"a layer), issued one layer late with prefetch 1. Outside the loops "
          f"{len(grads)} gradient collectives cross the hosts (the unstacked leaves' hop, the "
          f"step's scalars: {ms(sum(grads))} ms) and {len(refresh)} all-gathers refresh the "
          f"secondary copy after the update ({ms(sum(refresh))} ms), serial in both schedules.")
  return lines


def render(out: dict, args, seconds: float) -> str:
  d = overlap.H100_SXM
  lines = [
      "## overlap model: predicted exposed communication on H100s (PREDICTIONS, not measured)",
      "",
      f"**Predictions** of `zero_jax.gpu.predict` (`python benchmarks/bench_overlap.py`, "
      f"{seconds / 60:.1f} min on this CPU), not measurements: no GPU was available to this "
      f"work. Device: {d.name}, {d.peak_flops / 1e12:.0f} TFLOP/s dense bf16 peak, HBM "
      f"{d.hbm_bandwidth / 1e12:.2f} TB/s, NVLink {d.intra.bandwidth / 1e9:.0f} GB/s each way "
      f"(the datasheet's 900 GB/s counts both directions), {d.cross.bandwidth / 1e9:.0f} GB/s "
      f"per GPU between hosts (one 400 Gb/s NDR port per GPU), {d.intra.latency * 1e6:.0f} / "
      f"{d.cross.latency * 1e6:.0f} us per ring step; matmuls at "
      f"{args.compute_efficiency:.0%} of peak (each at its roofline), links at "
      f"{args.link_efficiency:.0%} of their bandwidth; elementwise work not counted. Each "
      f"program is the lowered bf16 training step (AdamW, {TOKENS_PER_DEVICE} tokens per device, "
      f"the LM example's block, layers stacked and gathered one at a time), read by "
      f"`overlap.analyze`; prefetch 0 is the serial schedule (each layer waits for its gather "
      f"and its reduce-scatter: what a step gets when XLA overlaps nothing), prefetch 1 the "
      f"`zj.scan` schedule (gather one layer ahead, reduce-scatter one layer late, one "
      f"collective at a time on the communication stream).",
      "",
      "| model | H100s, configuration | fwd layer: compute / comm ms | bwd layer: compute / "
      "comm (cross-host) ms | rest of step: compute / comm ms | step ms, prefetch 0 | step ms, "
      "prefetch 1 | exposed comm ms, 0 -> 1 | exposed ms, prefetch 1: CPU-derived / "
      "GPU schedule | MFU, 0 -> 1 |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for (model, name), r in out.items():
    f, b = r["fwd"], r["bwd"]
    lines.append(
        f"| {model} | {name} | {ms(f.compute)} / {ms(f.gather + f.reduce)} | {ms(b.compute)} / "
        f"{ms(b.gather + b.reduce)} ({ms(b.cross_host)}) | {ms(r['rest'][0])} / "
        f"{ms(r['rest'][1])} | {ms(r['step'][0])} | "
        f"{ms(r['step'][1])} | {ms(r['exposed'][0])} -> {ms(r['exposed'][1])} | "
        f"{ms(r['exposed'][1])} / {'-' if r['gpu_exposed'] is None else ms(r['gpu_exposed'])} | "
        f"{r['mfu'][0]:.0%} -> {r['mfu'][1]:.0%} |")
  lines += ["", *reading(out)]
  lines += [
      "",
      "MFU here is the architecture's model flops (`_lm.model_flops_per_token`) over the "
      "predicted step time at the 989 TFLOP/s peak, so it is bounded by the assumed matmul "
      "efficiency (no layer is recomputed: `zj.scan` keeps what `lax.scan` keeps). "
      "Communication per layer is the gather (forward), and the re-gather plus the gradient's reduce-scatter and any cross-host "
      "hop (backward); the rest of the step (embedding, head, the update's collectives) "
      "runs serially in both schedules. No GPU run exists yet to put measured rows beside "
      "these: see the `gpu` section.",
      "",
      "*Exposed ms, prefetch 1: CPU-derived / GPU schedule* (both predictions): the first is "
      "the model above, which assumes the `zj.scan` schedule on a program lowered for CPU; "
      "the second reads the program XLA:GPU compiled for these H100s (`bench_gpu_compile.py`, "
      "compile-only devices, bf16, AdamW, prefetch 1) with `predict.predict_scheduled`: each "
      "async collective's ring time less the matmuls XLA:GPU put inside its start..done "
      "window, summed over the step (the embedding, head and update's collectives included, "
      "each against what its own window holds). `-`: no GPU program for that row."]
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="GPT-2 small only, no hybrid rows")
  p.add_argument("--no-write", action="store_true", help="print only")
  p.add_argument("--compute-efficiency", type=float, default=0.6)
  p.add_argument("--link-efficiency", type=float, default=0.8)
  args = p.parse_args()
  t0 = time.perf_counter()
  out = measure(args)
  text = render(out, args, time.perf_counter() - t0)
  print(text)
  if not args.no_write:
    from _report import write_section  # pylint: disable=g-import-not-at-top
    write_section("overlap-model", text)


if __name__ == "__main__":
  main()
