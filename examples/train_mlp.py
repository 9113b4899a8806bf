"""A first zero_jax run: a small Flax classifier on spirals it makes itself.

Trains for a few hundred steps with ZeRO stage 2 on every device (8 fake CPU
devices when the machine has a single one), shows a progress bar, and checks
that the loss falls.

    python examples/train_mlp.py --steps 300 --stage 2
"""

import argparse
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=300,
                 help="training steps (default: %(default)s)")
  p.add_argument("--batch-size", type=int, default=256,
                 help="global batch size, split over the devices (default: %(default)s)")
  p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3),
                 help="ZeRO stage: 1 splits the optimizer state, 2 also the gradients, 3 also "
                      "the parameters (default: %(default)s)")
  p.add_argument("--lr", type=float, default=3e-3,
                 help="learning rate of AdamW (default: %(default)s)")
  p.add_argument("--devices", type=int, default=8,
                 help="fake CPU devices to use when the machine has only one device "
                      "(default: %(default)s)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)  # affects only the CPU backend
  import flax.linen as nn
  import jax.numpy as jnp
  import numpy as np
  import optax
  from tqdm import tqdm

  import zero_jax as zj

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for width in (128, 128):
        x = nn.gelu(nn.Dense(width)(x))
      return nn.Dense(3)(x)

  def spirals(rng, n):
    """Three interleaved spirals: (n, 2) points and their arm (0-2)."""
    arm = rng.integers(0, 3, n)
    t = rng.uniform(0.1, 1.0, n)
    angle = 3.5 * t + arm * 2 * np.pi / 3
    x = np.stack([t * np.cos(angle), t * np.sin(angle)], 1) + rng.normal(0, 0.02, (n, 2))
    return x.astype(np.float32), arm.astype(np.int32)

  model = MLP()

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adamw(args.lr), mesh=mesh,
                                    stage=args.stage, has_aux=True)
  state = step.init(model.init(jax.random.key(0), jnp.zeros((1, 2)))["params"])
  rng = np.random.default_rng(0)
  first = last = None
  with tqdm(range(args.steps), desc=f"ZeRO-{args.stage} on {jax.device_count()} devices",
            mininterval=1.0) as bar:
    for i in bar:
      x, y = spirals(rng, args.batch_size)
      state, metrics = step(state, {"x": x, "y": y})
      if i % 20 == 0 or i == args.steps - 1:
        loss, acc = float(metrics["loss"]), float(metrics["aux"]["accuracy"])
        first = loss if first is None else first
        last = loss
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{acc:.2f}")
  print(f"loss {first:.3f} -> {last:.3f}, accuracy {acc:.2f}")
  return first, last


if __name__ == "__main__":
  first, last = main()
  sys.exit(0 if last < first else "loss did not fall")
