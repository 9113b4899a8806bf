"""Draws docs/stages.png: what each of 8 devices holds under DP and ZeRO stages 1-3.

Mixed-precision Adam, Ψ parameters: 2Ψ bytes of bf16 parameters, 2Ψ of gradients and 12Ψ of
optimizer state and fp32 master copy (DeepSpeed's accounting). A part split over the devices is
drawn at 1/N of its height, in the colour of the device's own slice.

    python docs/plot_stages.py
"""

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

N = 8
PARTS = (("parameters (bf16)", 2.0, "#4C72B0"), ("gradients (bf16)", 2.0, "#DD8452"),
         ("optimizer state + fp32 master", 12.0, "#55A868"))
SPLIT_FROM = {"parameters (bf16)": 3, "gradients (bf16)": 2, "optimizer state + fp32 master": 1}
STAGES = ("DP (no ZeRO)", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def per_device(stage: int) -> list[tuple[str, float, str, bool]]:
  """(part, bytes per parameter on one device, colour, split?) for one stage."""
  out = []
  for name, size, colour in PARTS:
    split = stage >= SPLIT_FROM[name]
    out.append((name, size / N if split else size, colour, split))
  return out


def main(path=pathlib.Path(__file__).with_name("stages.png")):
  fig, axes = plt.subplots(1, 4, figsize=(13, 4.2), sharey=True)
  for stage, ax in enumerate(axes):
    parts = per_device(stage)
    for d in range(N):
      bottom = 0.0
      for _, height, colour, split in parts:
        ax.bar(d, height, bottom=bottom, color=colour, edgecolor="white", linewidth=0.6,
               hatch="////" if split else None, alpha=0.8 if split else 1.0)
        bottom += height
    if stage:
      ax.axhline(16, color="grey", linestyle="--", linewidth=0.8)
      ax.text(N - 0.5, 16.2, "DP", color="grey", ha="right", va="bottom", fontsize=9)
    total = sum(p[1] for p in parts)
    ax.set_title(f"{STAGES[stage]}\n{total:g} bytes/param per device", fontsize=11)
    ax.set_xticks(range(N), [str(d) for d in range(N)], fontsize=8)
    ax.set_xlabel("device")
    ax.spines[["top", "right"]].set_visible(False)
  axes[0].set_ylabel("bytes per parameter, on each device")
  handles = [Patch(color=c, label=n) for n, _, c in PARTS]
  handles.append(Patch(facecolor="white", edgecolor="grey", hatch="////",
                       label=f"split: each device holds its own 1/{N}"))
  fig.legend(handles=handles, loc="lower center", ncol=4, frameon=False, fontsize=10)
  fig.suptitle("What each of 8 devices holds: mixed-precision Adam (DP 16 bytes per parameter)",
               fontsize=12)
  fig.tight_layout(rect=(0, 0.08, 1, 0.95))
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
