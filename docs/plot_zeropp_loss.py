"""Plots the LM example's training loss with and without ZeRO++ quantization.

Each argument is ``label=metrics.json`` from ``examples/train_lm.py --metrics-json``, e.g.::

  python examples/train_lm.py --stage 3 --metrics-json exact.json
  python examples/train_lm.py --stage 3 --quantize both --metrics-json both.json
  python docs/plot_zeropp_loss.py exact=exact.json "qwZ + qgZ=both.json"

Writes ``docs/zeropp_loss.png`` and prints the final training and held-out losses.
"""

import json
import pathlib
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def smooth(y, k=10):
  return np.convolve(y, np.ones(k) / k, mode="valid")


def main(args):
  runs = dict(a.split("=", 1) for a in args)
  fig, (ax, dx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                               gridspec_kw={"height_ratios": [2, 1]})
  base = None
  for label, path in runs.items():
    m = json.loads(pathlib.Path(path).read_text())
    steps = sorted(int(s) for s in m["losses"])
    loss = np.array([m["losses"][str(s)] for s in steps])
    final = float(np.mean(loss[-20:]))
    if base is None:
      base = (final, m["eval_loss_after"], loss)
    print(f"{label}: train loss (mean of the last 20 steps) {final:.4f} "
          f"({(final / base[0] - 1) * 100:+.2f}%), held-out {m['eval_loss_after']:.4f} "
          f"({(m['eval_loss_after'] / base[1] - 1) * 100:+.2f}%)")
    ax.plot(steps[9:], smooth(loss), label=f"{label} (held-out {m['eval_loss_after']:.3f})")
    dx.plot(steps[9:], 100 * smooth(loss / base[2] - 1), label=label)
  ax.set_ylabel("training loss, nats/byte\n(10-step mean)")
  ax.set_title("examples/train_lm.py, ZeRO-3 on 8 devices: exact vs int8 communication")
  dx.set_xlabel("step")
  dx.set_ylabel("vs the first run, %")
  for a in (ax, dx):
    a.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  out = pathlib.Path(__file__).parent / "zeropp_loss.png"
  fig.savefig(out, dpi=110)
  print("wrote", out)


if __name__ == "__main__":
  main(sys.argv[1:])
