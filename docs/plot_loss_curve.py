"""Draws docs/loss_curve.png: plain single-device optax against ZeRO stages 1-3 on 8 devices.

The same MLP, data and AdamW; the one-device reference is ``jax.jit`` + optax on device 0. The
right panel shows how far each ZeRO run's loss is from the reference (float rounding).

    python docs/plot_loss_curve.py
"""

import pathlib

import jax

jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STEPS = 150


def loss_fn(params, batch):
  h = jax.nn.gelu(batch["x"] @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def data(seed=0):
  rng = np.random.default_rng(seed)
  true_w = rng.normal(size=(16, 4)).astype(np.float32)
  for _ in range(STEPS):
    x = rng.normal(size=(128, 16)).astype(np.float32)
    yield {"x": x, "y": np.sin(x @ true_w)}


def init_params():
  rng = np.random.default_rng(1)
  return {"w1": rng.normal(size=(16, 129)).astype(np.float32) / 4,
          "b1": np.zeros(129, np.float32),
          "w2": rng.normal(size=(129, 4)).astype(np.float32) / 11,
          "b2": np.zeros(4, np.float32)}


def reference(tx):
  @jax.jit
  def step(p, o, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss
  p = init_params()
  o, losses = tx.init(p), []
  for b in data():
    p, o, loss = step(p, o, b)
    losses.append(float(loss))
  return np.array(losses)


def zero(tx, stage):
  mesh = jax.make_mesh((8,), ("data",))
  step = zj.make_sharded_train_step(loss_fn, tx, mesh=mesh, stage=stage)
  state, losses = step.init(init_params()), []
  for b in data():
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  return np.array(losses)


def main(path=pathlib.Path(__file__).with_name("loss_curve.png")):
  tx = optax.adamw(3e-3)
  ref = reference(tx)
  runs = {f"ZeRO-{s}, 8 devices": zero(tx, s) for s in (1, 2, 3)}
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
  left.plot(ref, color="black", linewidth=3, alpha=0.35, label="plain optax, 1 device")
  for (name, losses), style in zip(runs.items(), ("-", "--", ":")):
    left.plot(losses, style, linewidth=1.3, label=name)
    diff = np.abs(losses - ref) / ref
    right.semilogy(np.maximum(diff, 1e-9), ".", markersize=4,
                   label=f"{name}: {np.mean(diff == 0):.0%} of steps bit-identical")
  left.set(xlabel="step", ylabel="training loss", title="The same loss curve")
  right.set(xlabel="step", ylabel="|loss - reference| / reference",
            title="Difference from one device (float32 rounding)", ylim=(5e-10, 1e-4))
  right.text(0, 1.3e-9, "bit-identical steps sit on this line", fontsize=8, color="grey")
  for ax in (left, right):
    ax.legend(frameon=False, fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"wrote {path}; largest relative difference "
        f"{max(float(np.max(np.abs(v - ref) / ref)) for v in runs.values()):.1e}")


if __name__ == "__main__":
  main()
