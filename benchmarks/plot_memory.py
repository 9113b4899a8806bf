"""Per-device memory of GPT-2 small under plain data parallelism and ZeRO 1-3.

Draws ``docs/memory.png`` (the README's picture) and writes the table into
BENCHMARKS.md (section ``memory``). Everything comes from `zj.memory_report`
on abstract shapes (``jax.ShapeDtypeStruct``), so nothing is allocated and the
script takes a second: the figures are the exact per-device bytes of the
step's state, padding included, for AdamW in bf16 mixed precision (bf16
parameters and gradients, float32 master copy and moments), the setting of the
ZeRO paper's 16 bytes per parameter.

  python benchmarks/plot_memory.py [--out docs/memory.png] [--precision bf16]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import optax

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import zero_jax as zj  # noqa: E402
from zero_jax.step import memory as zj_memory  # noqa: E402
from _report import write_section  # noqa: E402

GiB = 2.0 ** 30
STAGES = (0, 1, 2, 3)
COLORS = {0: "#7f7f7f", 1: "#1f77b4", 2: "#2ca02c", 3: "#d62728"}
PARTS = (("params", "parameters", "#4c72b0"), ("gradients", "gradients", "#dd8452"),
         ("optimizer_state", "optimizer state", "#55a868"), ("master", "fp32 master", "#c44e52"))


def gpt2_shapes(vocab=50257, n_ctx=1024, d=768, layers=12) -> dict:
  """GPT-2's parameter tree (124,439,808 parameters at the defaults), as shape structs."""
  f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  ln = lambda: {"scale": f(d), "bias": f(d)}
  block = lambda: {
      "ln_1": ln(), "attn": {"c_attn": {"kernel": f(d, 3 * d), "bias": f(3 * d)},
                             "c_proj": {"kernel": f(d, d), "bias": f(d)}},
      "ln_2": ln(), "mlp": {"c_fc": {"kernel": f(d, 4 * d), "bias": f(4 * d)},
                            "c_proj": {"kernel": f(4 * d, d), "bias": f(d)}}}
  return {"wte": f(vocab, d), "wpe": f(n_ctx, d),
          **{f"h_{i}": block() for i in range(layers)}, "ln_f": ln()}


def reports(params, optimizer, devices, precision):
  return {n: zj.memory_report(params, optimizer, n_devices=n, precision=precision)
          for n in devices}


def table(reps, n_params, precision) -> str:
  head = "| devices | " + " | ".join(zj_memory.STAGE_NAMES[s] for s in STAGES) + " |"
  lines = [f"Per-device memory of params + gradients + optimizer state + master copy, "
           f"GPT-2 small ({n_params / 1e6:.1f}M parameters), AdamW, precision {precision}; "
           f"from `zj.memory_report` (exact layouts, padding included; activations not "
           f"counted).", "", head, "|---:|" + "---:|" * len(STAGES)]
  for n, rep in reps.items():
    lines.append(f"| {n} | " + " | ".join(zj_memory.format_bytes(rep[s].total)
                                         for s in STAGES) + " |")
  return "\n".join(lines)


def plot(reps, n_params, precision, out: pathlib.Path, bar_devices: int):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  fig, (ax_bar, ax_line) = plt.subplots(1, 2, figsize=(11, 4.2),
                                        gridspec_kw={"width_ratios": [1, 1.25]})
  # Left: what each device holds at bar_devices devices, part by part.
  rep = reps[bar_devices]
  names = [zj_memory.STAGE_NAMES[s].replace(" (replicated)", "\n(replicated)") for s in STAGES]
  bottom = [0.0] * len(STAGES)
  for field, label, color in PARTS:
    vals = [getattr(rep[s], field) / GiB for s in STAGES]
    ax_bar.bar(names, vals, bottom=bottom, color=color, label=label, width=0.65)
    bottom = [b + v for b, v in zip(bottom, vals)]
  for i, b in enumerate(bottom):
    ax_bar.text(i, b, f"{b:.2f}", ha="center", va="bottom", fontsize=9)
  ax_bar.set_ylabel("GiB per device")
  ax_bar.set_title(f"What one of {bar_devices} devices holds")
  ax_bar.legend(frameon=False, fontsize=9)
  ax_bar.spines[["top", "right"]].set_visible(False)

  # Right: total per device against the number of devices.
  ns = list(reps)
  for s in STAGES:
    ax_line.plot(ns, [reps[n][s].total / GiB for n in ns], marker="o", ms=4, color=COLORS[s],
                 label=zj_memory.STAGE_NAMES[s])
  ax_line.set_xscale("log", base=2)
  ax_line.set_yscale("log", base=2)
  ax_line.yaxis.set_major_formatter(
      matplotlib.ticker.FuncFormatter(lambda v, _: zj_memory.format_bytes(v * GiB)))
  ax_line.set_xticks(ns, [str(n) for n in ns])
  ax_line.set_xlabel("devices on the data axis")
  ax_line.set_ylabel("per device (log scale)")
  ax_line.set_title("Per-device total against the number of devices")
  ax_line.grid(True, which="major", alpha=0.3)
  ax_line.legend(frameon=False, fontsize=9)
  ax_line.spines[["top", "right"]].set_visible(False)

  fig.suptitle(f"GPT-2 small ({n_params / 1e6:.1f}M parameters), AdamW, {precision} mixed "
               f"precision: model and optimizer memory per device (zj.memory_report)",
               fontsize=11)
  fig.tight_layout()
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=str(ROOT / "docs" / "memory.png"))
  p.add_argument("--precision", default="bf16")
  p.add_argument("--bar-devices", type=int, default=8)
  p.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
  args = p.parse_args(argv)
  params = gpt2_shapes()
  n_params = sum(x.size for x in jax.tree.leaves(params))
  devices = [1, 2, 4, 8, 16, 32, 64, 128, 256]
  reps = reports(params, optax.adamw(3e-4), devices, args.precision)
  md = table(reps, n_params, args.precision)
  print(md)
  print()
  print(reps[args.bar_devices])
  plot(reps, n_params, args.precision, pathlib.Path(args.out), args.bar_devices)
  print(f"\nwrote {args.out}")
  if not args.no_write:
    write_section("memory", "## Memory per device (GPT-2 small)\n\n" + md +
                  f"\n\n![per-device memory](docs/memory.png)\n\nGenerated by "
                  f"`python benchmarks/plot_memory.py`.")


if __name__ == "__main__":
  main()
