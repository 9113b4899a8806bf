"""Memory on H100s from the program XLA:GPU compiles, next to `zj.memory_report` (no GPU).

Writes the ``gpu-compile`` section of BENCHMARKS.md. For GPT-2 small's shapes and a 1B model
(``_lm.GPT2_SMALL``, ``_lm.GPT_1B``: bf16, AdamW, ``zj.scan(prefetch=1)``, 8192 tokens per
device, cuDNN's fused attention where it compiles here, else the XLA-written attention and a
message: `_lm.fused_attention`) it compiles the training step for compile-only H100s
(`zj.compile_only_mesh`: one host of 8, two hosts of 8) and puts XLA:GPU's
``memory_analysis()`` (arguments, outputs, aliases, temporaries, per device) beside
`zj.memory_report`'s per-device figures: the state between steps (parameters, optimizer
state, master copy) against the arguments less the batch, and the gradients plus the
prefetch buffers against the temporaries (which also hold the activations, which
`memory_report` does not count). Beside them, whether the program fits what `zj.plan`
allows a device and, where it does, the step time predicted by walking its schedule
(`zero_jax.gpu.timeline`, what `zj.plan` ranks by; a prediction, not a measurement). Needs JAX's CUDA plugin.

Usage: ``python benchmarks/bench_gpu_compile.py [--quick] [--no-write]``.
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402

import _lm  # noqa: E402
import _report  # noqa: E402
import zero_jax as zj  # noqa: E402
from zero_jax.gpu import measure as gpu_measure  # noqa: E402
from zero_jax.gpu import plan as gpu_plan  # noqa: E402

TOKENS_PER_DEVICE = 8192
MiB = 1 << 20
# What `zj.plan` allows an H100 by default (JAX's preallocated fraction of its memory).
HBM = gpu_plan.default_hbm(zj.gpu.H100)


def configs() -> dict:
  """``{name: (hosts, mesh shape, mesh axes, step options)}``."""
  two, names = (2, 8), ("hosts", "data")
  return {
      "8, ZeRO-2": (1, (8,), ("data",), {"stage": 2}),
      "8, ZeRO-3": (1, (8,), ("data",), {"stage": 3}),
      "2x8, ZeRO-3 hybrid": (2, two, names, {"stage": 3, "replica_axis": "hosts"}),
      "2x8, ZeRO-3 hpZ": (2, two, names, {"stage": 3, "axis_name": names, "hpz_axis": "data"}),
  }


def build(cfg: _lm.GPTConfig, name: str):
  """(step, abstract state, batch, mesh, options) for one configuration."""
  hosts, shape, axes, options = configs()[name]
  mesh = zj.compile_only_mesh(shape, axes, gpu="h100", hosts=hosts)
  params = jax.eval_shape(lambda k: _lm.init_gpt(cfg, k), jax.random.key(0))
  step = zj.make_sharded_train_step(_lm.make_gpt_loss(cfg, prefetch=1), optax.adamw(1e-4),
                                    mesh=mesh, precision="bf16", stacked=_lm.in_blocks,
                                    **options)
  rows = math.prod(shape) * TOKENS_PER_DEVICE // cfg.seq_len
  return step, params, _lm.gpt_batch_shape(cfg, rows), mesh, options


def compile_gpu(cfg: _lm.GPTConfig, name: str):
  """The compiled step and its inputs' figures (see `build`), compiled as `zj.plan` compiles
  (`zero_jax.gpu.measure.FAST_COMPILE`: the same buffers, less compile time)."""
  step, params, batch, mesh, options = build(cfg, name)
  compiled = step.lower(step.abstract_state(params), batch).compile(
      compiler_options=gpu_measure.FAST_COMPILE)
  return compiled, params, batch, mesh, options


def report_row(cfg: _lm.GPTConfig, params, mesh, options):
  """`zj.memory_report`'s row for this step's stage, on its mesh."""
  axes = {k: v for k, v in options.items() if k in ("axis_name", "replica_axis", "hpz_axis")}
  if "axis_name" not in axes:
    axes["axis_name"] = "data"
  return zj.memory_report(params, optax.adamw(1e-4), mesh=mesh, precision="bf16",
                          stacked=_lm.in_blocks, prefetch=1, stages=(options["stage"],),
                          **axes)[options["stage"]]


def measure(args, attention: str) -> dict:
  models = [_lm.GPT2_SMALL] if args.quick else [_lm.GPT2_SMALL, _lm.GPT_1B]
  device = gpu_measure.device_for(zj.gpu.H100, 8, "bf16")
  out = {}
  for cfg in (_lm.with_attention(c, attention) for c in models):
    for name in configs():
      t0 = time.perf_counter()
      compiled, params, batch, mesh, options = compile_gpu(cfg, name)
      m = compiled.memory_analysis()
      seconds = time.perf_counter() - t0
      row = report_row(cfg, params, mesh, options)
      batch_bytes = math.prod(batch["tokens"].shape) * 4 // math.prod(mesh.devices.shape)
      out[(cfg.name, name)] = {
          "arg": m.argument_size_in_bytes, "out": m.output_size_in_bytes,
          "alias": m.alias_size_in_bytes, "temp": m.temp_size_in_bytes,
          "batch": batch_bytes, "row": row, "seconds": seconds,
          "step": gpu_measure.read(compiled, device).step_s}
      print(f"{cfg.name:12s} {name:20s} compiled in {seconds:.0f} s", flush=True)
  return out


def mib(x: float) -> str:
  return f"{x / MiB:,.1f}"


def render(out: dict, seconds: float, attention: str, why: str) -> str:
  lines = [
      "## gpu compile: memory on H100s, XLA:GPU's plan beside memory_report (compiled, no GPU)",
      "",
      f"`python benchmarks/bench_gpu_compile.py` ({seconds / 60:.1f} min on {os.cpu_count()} "
      f"CPU cores, shared with other jobs; jax {jax.__version__}): each step compiled by "
      f"XLA:GPU for compile-only H100s (`zj.compile_only_mesh`, sm_90a, no GPU present, no "
      f"autotuning; `zj.plan`'s compile options), bf16, AdamW, `zj.scan(prefetch=1)`, "
      f"{TOKENS_PER_DEVICE} tokens per device, attention: {_report.attention_words(attention, why)}. "
      f"MiB per device. *state* is memory_report's parameters + optimizer "
      f"state + master copy, set against XLA's arguments less the batch; *grads + prefetch* "
      f"is its gradient and `zj.scan` buffers, set against XLA's temporaries, which also hold "
      f"the activations kept for the backward pass and the communication buffers "
      f"(memory_report does not count them). *fits*: XLA's peak within what `zj.plan` allows "
      f"an H100 by default ({HBM / 2**30:.1f} GiB: JAX preallocates 75% of its memory). "
      f"*predicted step*: {_report.PREDICTED}; a program that does not fit is not timed.",
      "",
      "| model | H100s, configuration | report: state | XLA: args - batch | diff | XLA: outputs "
      "/ aliased | report: grads + prefetch | XLA: temp | XLA peak | fits | predicted step | "
      "compile s |",
      "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :-: | ---: | ---: |"]
  for (model, name), r in out.items():
    row = r["row"]
    state = row.params + row.optimizer_state + row.master
    args = r["arg"] - r["batch"]
    peak = r["arg"] + r["out"] - r["alias"] + r["temp"]
    fits = peak <= HBM
    step = f"{r['step'] * 1e3:.1f} ms" if fits else "not timed"
    lines.append(
        f"| {model} | {name} | {mib(state)} | {mib(args)} | {(args - state) / state:+.1%} | "
        f"{mib(r['out'])} / {mib(r['alias'])} | {mib(row.gradients + row.prefetch)} | "
        f"{mib(r['temp'])} | {mib(peak)} | {'yes' if fits else 'does not fit'} | {step} | "
        f"{r['seconds']:.0f} |")
  worst = max(abs(r["arg"] - r["batch"] - (r["row"].params + r["row"].optimizer_state
                                            + r["row"].master))
              / (r["row"].params + r["row"].optimizer_state + r["row"].master)
              for r in out.values())
  lines += [
      "",
      f"The state memory_report predicts and the arguments XLA:GPU plans differ by at most "
      f"{worst:.1%} here (the arguments also hold the step counter, the loss-scale state and "
      f"the RNG key). Outputs alias the donated state, so the peak is the arguments plus the "
      f"temporaries. For the temporaries trust XLA's figure: it holds the activations each "
      f"layer keeps for the backward pass (`zj.scan`'s `policy=`; by default what `lax.scan` keeps) and "
      f"XLA's own buffers, which a count from shapes cannot see."]
  return "\n".join(lines)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="GPT-2 small only")
  p.add_argument("--no-write", action="store_true", help="print only")
  args = p.parse_args()
  t0 = time.perf_counter()
  attention, why = _lm.fused_attention("h100")  # cuDNN's fused kernel, where it compiles here
  print(f"attention: {why}", flush=True)
  out = measure(args, attention)
  text = render(out, time.perf_counter() - t0, attention, why)
  print(text)
  if not args.no_write:
    from _report import write_section  # pylint: disable=g-import-not-at-top
    write_section("gpu-compile", text)


if __name__ == "__main__":
  main()
