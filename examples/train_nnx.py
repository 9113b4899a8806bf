"""Train a Flax NNX model with zero_jax: a small CNN with BatchNorm and Dropout.

The images are made here (8x8, three classes: horizontal stripes, vertical
stripes, a checkerboard, with random phase, contrast and noise), so nothing is
downloaded. The NNX way, on every device (8 fake CPU devices when the machine
has a single one):

* ``step.init(model)``: the module's ``nnx.Param``s train (``wrt=``); its other
  variables (BatchNorm statistics, the ``nnx.Rngs`` its Dropout draws from)
  are model state the step carries;
* ``loss_fn(model, batch)`` gets a module and mutates it as NNX code does;
  each device draws its own dropout masks, different at every step;
* ``step.get_model(state)`` gives the trained module, evaluated here with
  ``model.eval()`` on held-out images;
* the memory report is computed from ``nnx.eval_shape`` (nothing allocated),
  and a checkpoint restores into a ZeRO-3 step from the abstract module.

    python examples/train_nnx.py                 # ZeRO-2, 150 steps, well under a minute
    python examples/train_nnx.py --stage 3 --precision bf16
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=150,
                 help="training steps (default: %(default)s)")
  p.add_argument("--batch-size", type=int, default=128,
                 help="global batch size, split over the devices (default: %(default)s)")
  p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3),
                 help="ZeRO stage: 1 splits the optimizer state, 2 also the gradients, 3 also "
                      "the parameters (default: %(default)s)")
  p.add_argument("--precision", default="fp32",
                 choices=("fp32", "bf16", "fp16", "fp16_memory_efficient"),
                 help="precision policy of the step: bf16 and fp16 compute in half precision "
                      "with a float32 master copy; fp16_memory_efficient keeps none "
                      "(default: %(default)s)")
  p.add_argument("--lr", type=float, default=3e-3,
                 help="learning rate of AdamW (default: %(default)s)")
  p.add_argument("--devices", type=int, default=8,
                 help="fake CPU devices to use when the machine has only one device "
                      "(default: %(default)s)")
  return p.parse_args(argv)


def images(rng, n):
  """(n, 8, 8, 1) images and their class: 0 horizontal stripes, 1 vertical, 2 checkerboard."""
  import numpy as np
  label = rng.integers(0, 3, n)
  i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
  phase = rng.integers(0, 2, (n, 1, 1))
  pattern = np.where(label[:, None, None] == 0, i + phase,
                     np.where(label[:, None, None] == 1, j + phase, i + j + phase)) % 2
  contrast = rng.uniform(0.5, 1.5, (n, 1, 1))
  x = (2 * pattern - 1) * contrast + rng.normal(0, 0.8, (n, 8, 8))
  return x[..., None].astype(np.float32), label.astype(np.int32)


def main(argv=None):
  args = parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)  # affects only the CPU backend
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  try:
    import zero_jax as zj
  except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    import zero_jax as zj

  class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.conv1 = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)
      self.bn1 = nnx.BatchNorm(16, rngs=rngs)
      self.conv2 = nnx.Conv(16, 16, (3, 3), strides=2, use_bias=False, rngs=rngs)
      self.bn2 = nnx.BatchNorm(16, rngs=rngs)
      self.drop = nnx.Dropout(0.2, rngs=rngs)  # draws from the module's own Rngs
      self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
      x = nnx.relu(self.bn1(self.conv1(x)))
      x = nnx.relu(self.bn2(self.conv2(x)))
      return self.head(self.drop(x.mean(axis=(1, 2))))

  def loss_fn(model, batch):  # model: an nnx.Module, in training mode
    logits = model(batch["x"])  # BatchNorm updates its statistics, Dropout its counter
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  tx = optax.adamw(args.lr)
  step = zj.make_sharded_train_step(loss_fn, tx, mesh=mesh, stage=args.stage, has_aux=True,
                                    precision=args.precision, wrt=nnx.Param)
  state = step.init(CNN(nnx.Rngs(0)))  # in place of nnx.Optimizer(model, tx, wrt=nnx.Param)
  kinds = {type(v).__name__ for v in jax.tree.leaves(
      state.model_state, is_leaf=lambda v: isinstance(v, nnx.Variable))}
  print(f"ZeRO-{args.stage}, {args.precision}, {jax.device_count()} devices; model state: "
        f"{sorted(kinds)}")

  rng = np.random.default_rng(0)
  first = last = None
  for i in range(args.steps):
    x, y = images(rng, args.batch_size)
    state, metrics = step(state, {"x": x, "y": y})
    if i % 25 == 0 or i == args.steps - 1:
      loss, acc = float(metrics["loss"]), float(metrics["aux"]["accuracy"])
      first = loss if first is None else first
      last = loss
      print(f"step {i + 1:4d}  loss {loss:.3f}  train accuracy {acc:.2f}")

  model = step.get_model(state)  # an nnx.Module: trained params, averaged statistics
  model.eval()                   # BatchNorm uses its running averages; no dropout
  x, y = images(np.random.default_rng(1), 512)
  accuracy = float((model(x).argmax(-1) == y).mean())
  print(f"loss {first:.3f} -> {last:.3f}; held-out accuracy {accuracy:.2f} (chance 0.33)")

  abstract = nnx.eval_shape(lambda: CNN(nnx.Rngs(0)))  # shapes only, nothing allocated
  print(zj.memory_report(abstract, tx, n_devices=jax.device_count(), precision=args.precision))

  with tempfile.TemporaryDirectory() as tmp, zj.CheckpointManager(tmp) as mngr:
    mngr.save(state)
    mngr.wait_until_finished()
    step3 = zj.make_sharded_train_step(loss_fn, tx, mesh=mesh, stage=3, has_aux=True,
                                       precision=args.precision)
    restored = mngr.restore(step3, abstract)  # onto ZeRO-3: the abstract module is enough
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)),
                      nnx.state(step3.get_model(restored), nnx.Not(nnx.RngKey)),
                      nnx.state(step.get_model(state), nnx.Not(nnx.RngKey)))
  print(f"restored into a ZeRO-3 step at step {int(restored.step)}: "
        f"{'the same model' if all(jax.tree.leaves(same)) else 'DIFFERENT'}")
  return first, last, accuracy


if __name__ == "__main__":
  first, last, accuracy = main()
  sys.exit(0 if last < first and accuracy > 0.6 else "the model did not learn")
