"""One process of the two-process safetensors test (started by tests/test_safetensors.py).

Importable without side effects: the test process builds the same steps and states from
here for its one-process export.

  python tests/safetensors_worker.py OUT_DIR   # exports each variant into OUT_DIR/<variant>
                                               # (one made by an init function across both
                                               # processes, one with stacked leaves under
                                               # per-layer names), then loads stage 3's
                                               # exports and exports them again
"""

import os
import sys

import numpy as np

SHAPES = {"emb": (32, 24), "odd": (5, 9), "bias": (9,), "kernel": (24, 40), "scale": ()}
LAYER_SHAPES = {"stack": (3, 16, 12), "norm": (3, 16)}  # the "stage3_layers" variant's too
LAYERS = "stage3_layers"
VARIANTS = {"stage3_bf16": dict(stage=3, precision="bf16"),  # master split, padded blocks
            "stage2_fp32": dict(stage=2),                     # replicated over both processes
            "stage3_function": dict(stage=3),  # step.init(init_fn): each process its blocks
            LAYERS: dict(stage=3, precision="bf16",  # stacked leaves, one tensor per layer
                         stacked=lambda path, _: str(path[0].key) in LAYER_SHAPES)}


def params(variant=None):
  rng = np.random.default_rng(3)
  shapes = {**SHAPES, **LAYER_SHAPES} if variant == LAYERS else SHAPES
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def init_fn():
  """The params drawn under jit, each device its own block (the "stage3_function" variant)."""
  import jax  # pylint: disable=g-import-not-at-top
  keys = jax.random.split(jax.random.key(5), len(SHAPES))
  return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items())}


def rename(name):
  return name, name == "kernel"  # a transposed leaf split along its columns


def layer_rename(name):
  """The Hub's per-layer names for the stacked leaves (the stack transposed per layer)."""
  return {"stack": ("model.layers.{i}.w", True), "norm": "model.layers.{i}.norm"}.get(
      name, rename(name))


def rename_for(variant):
  return layer_rename if variant == LAYERS else rename


def make_step(variant):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  loss = lambda p, b: sum(jnp.sum(x) for x in jax.tree.leaves(p)) * jnp.mean(b)
  return zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh, **VARIANTS[variant])


def export(variant, directory):
  """The variant's state exported in 3 files (small max_shard_bytes): what both runs write."""
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  from zero_jax.step import init as init_lib  # pylint: disable=g-import-not-at-top
  step = make_step(variant)
  if variant != "stage3_function":
    state = step.init(params(variant))
  else:  # made as a big model is, one jit per leaf (a small one is made inside init's jit)
    saved = init_lib.MIN_GROUP_BYTES, init_lib.INIT_GROUPS
    init_lib.MIN_GROUP_BYTES, init_lib.INIT_GROUPS = 0, 10**6
    try:
      state = step.init(init_fn)
    finally:
      init_lib.MIN_GROUP_BYTES, init_lib.INIT_GROUPS = saved
  return zj.export_safetensors(step, state, directory, rename=rename_for(variant),
                               max_shard_bytes=4000, chunk_bytes=256)


def main(out_dir):
  import jax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  zj.initialize_distributed()
  for variant in VARIANTS:
    export(variant, os.path.join(out_dir, variant))
  for variant, out in (("stage3_bf16", "reloaded"), (LAYERS, "layers_reloaded")):
    step = make_step(variant)  # read back by both processes, each its own blocks
    like = {k: jax.ShapeDtypeStruct(np.shape(x), np.float32)
            for k, x in params(variant).items()}
    loaded = zj.load_safetensors(os.path.join(out_dir, variant), like, step=step,
                                 rename=rename_for(variant))
    zj.export_safetensors(step, step.init(loaded), os.path.join(out_dir, out),
                          rename=rename_for(variant), max_shard_bytes=4000)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main(sys.argv[1])
