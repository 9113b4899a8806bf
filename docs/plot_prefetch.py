"""Draws docs/prefetch.png: one device's timeline of a stage-3 layer loop, with and without
``zj.scan(..., prefetch=1)``.

Four layers; forward compute takes 1 unit a layer, backward compute 2 (it recomputes the
layer's forward, then differentiates it), an all-gather or a reduce-scatter 0.6. Without
prefetch each iteration waits for its own gather, and the backward for the gradient's
reduce-scatter too; with prefetch the gather of the next layer (forward: i+1, backward: i-1)
and the reduce-scatter of the previous layer's gradient run on the communication stream while
this layer computes. An illustration of the schedule, not a measurement.

    python docs/plot_prefetch.py
"""

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LAYERS, FWD, BWD, COMM = 4, 1.0, 2.0, 0.6
COLOURS = {"gather": "#4C72B0", "compute": "#55A868", "backward": "#8172B3",
           "reduce-scatter": "#DD8452"}


def serial() -> list[tuple[str, str, float, float]]:
  """(lane, label, start, length): gather, then compute (then reduce-scatter), per layer."""
  out, t = [], 0.0
  for i in range(LAYERS):
    out += [("comm", f"G{i}", t, COMM), ("compute", f"F{i}", t + COMM, FWD)]
    t += COMM + FWD
  for i in reversed(range(LAYERS)):
    out += [("comm", f"G{i}", t, COMM), ("compute", f"B{i}", t + COMM, BWD),
            ("comm", f"R{i}", t + COMM + BWD, COMM)]
    t += 2 * COMM + BWD
  return out


def prefetched() -> list[tuple[str, str, float, float]]:
  """Layer i computes while layer i+1 (forward) or i-1 (backward) is gathered and layer
  i+1's gradient is reduce-scattered (backward), one iteration late."""
  out, t = [("comm", "G0", 0.0, COMM)], COMM
  for i in range(LAYERS):
    if i + 1 < LAYERS:
      out.append(("comm", f"G{i + 1}", t, COMM))
    out.append(("compute", f"F{i}", t, FWD))
    t += FWD
  out.append(("comm", f"G{LAYERS - 1}", t, COMM))
  t += COMM
  for i in reversed(range(LAYERS)):
    comm = t
    if i + 1 < LAYERS:
      out.append(("comm", f"R{i + 1}", comm, COMM))
      comm += COMM
    if i > 0:
      out.append(("comm", f"G{i - 1}", comm, COMM))
    out.append(("compute", f"B{i}", t, BWD))
    t += BWD
  out.append(("comm", "R0", t, COMM))
  return out


def colour(label: str) -> str:
  return COLOURS[{"G": "gather", "F": "compute", "B": "backward", "R": "reduce-scatter"}[label[0]]]


def main(path=pathlib.Path(__file__).with_name("prefetch.png")):
  runs = (("prefetch=0 (gather inside each iteration)", serial()),
          ("prefetch=1 (gather one layer ahead, reduce one layer behind)", prefetched()))
  end = max(s + n for _, blocks in runs for _, _, s, n in blocks)
  fig, axes = plt.subplots(2, 1, figsize=(12, 3.6), sharex=True)
  for ax, (title, blocks) in zip(axes, runs):
    for lane, label, start, length in blocks:
      y = 1 if lane == "comm" else 0
      ax.barh(y, length, left=start, height=0.7, color=colour(label), edgecolor="white")
      ax.text(start + length / 2, y, label, ha="center", va="center", color="white", fontsize=8)
    finish = max(s + n for _, _, s, n in blocks)
    ax.axvline(finish, color="black", lw=0.8, ls=":")
    ax.set_yticks([0, 1], ["compute", "communication"])
    ax.set_title(f"{title}: {finish:.1f} units", fontsize=10, loc="left")
    ax.set_xlim(0, end + 0.2)
  axes[-1].set_xlabel("time (layer forward = 1 unit): G gather, F forward, B backward "
                      "(recompute + gradient), R reduce-scatter")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
