"""Small steps of every kind zero_jax builds, compiled for compile-only H100s (the GPU tier).

`CASES` maps a name to the step's options and its model; `compile_case(name, hosts)` compiles
it for one host of 8 H100s (a mesh of 8, or 2 x 4 / 4 x 2 where the case needs two axes) or
two hosts of 8 (hosts along the first axis) and returns the compiled program.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import zero_jax as zj

D, LAYERS, ROWS = 128, 6, 16  # ROWS per device; the scans' loops run two layers an iteration


def mlp_loss(p, b):
  h = jnp.tanh(b["x"].astype(p["w1"].dtype) @ p["w1"] + p["b1"])
  return jnp.mean(jnp.square(h @ p["w2"]).astype(jnp.float32))


def mlp_params():
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return {"w1": f32(D, 2 * D), "b1": f32(2 * D), "w2": f32(2 * D, D)}


def scan_loss(prefetch):
  def loss(p, b):
    def layer(h, w):
      return jnp.tanh(h @ w["up"]) @ w["down"], None
    h, _ = zj.scan(layer, b["x"], p["layers"], prefetch=prefetch)
    return jnp.mean(jnp.square(h).astype(jnp.float32))
  return loss


def scan_params():
  s = jax.ShapeDtypeStruct((LAYERS, D, D), jnp.float32)
  return {"layers": {"up": s, "down": s}}


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.up(x)))


def nnx_loss(model, b):
  return jnp.mean(jnp.square(model(b["x"])))


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(x)))


def linen_loss(p, b):
  return jnp.mean(jnp.square(LinenModel().apply({"params": p}, b["x"])))


def linen_params():
  return jax.eval_shape(lambda: LinenModel().init(jax.random.key(0), jnp.zeros((1, D))))["params"]


TP = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
MLP = (mlp_loss, mlp_params)
# name: (model: (loss_fn, params), options, mesh: "flat" (data), "replica" (replica, data),
# "hpz" (outer, data), "model" (data, model))
CASES = {
    "stage1": (MLP, {"stage": 1}, "flat"),
    "stage2": (MLP, {"stage": 2}, "flat"),
    "stage3": (MLP, {"stage": 3}, "flat"),
    "bf16": (MLP, {"stage": 3, "precision": "bf16"}, "flat"),
    "fp16_dynamic": (MLP, {"stage": 2, "precision": "fp16", "loss_scale": "dynamic"}, "flat"),
    "accum_local": (MLP, {"stage": 2, "grad_accum_steps": 2, "accumulate": "local"}, "flat"),
    "accum_sharded": (MLP, {"stage": 3, "grad_accum_steps": 2}, "flat"),
    "gather_once": (MLP, {"stage": 3, "grad_accum_steps": 2, "gather_once": True}, "flat"),
    "replica_axis": (MLP, {"stage": 3}, "replica"),
    "param_specs": (MLP, {"stage": 3, "param_specs": TP}, "model"),
    "offload": (MLP, {"stage": 2, "offload": "optimizer"}, "flat"),
    "hpz": (MLP, {"stage": 3}, "hpz"),
    "int8": (MLP, {"stage": 3, "quantize": zj.Quantize(block_size=64)}, "flat"),
    "int4": (MLP, {"stage": 3, "quantize": zj.Quantize(block_size=64, grad_bits=4)}, "flat"),
    "scan_prefetch0": ((scan_loss(0), scan_params), {"stage": 3, "stacked": True}, "flat"),
    "scan_prefetch1": ((scan_loss(1), scan_params), {"stage": 3, "stacked": True}, "flat"),
    "nnx": ((nnx_loss, lambda: nnx.eval_shape(lambda: NNXModel(nnx.Rngs(0)))), {"stage": 3},
            "flat"),
    "linen": ((linen_loss, linen_params), {"stage": 2}, "flat"),
}


def mesh_options(kind: str, hosts: int):
  """The mesh and the step's axis options for one of `CASES`' mesh kinds."""
  if kind == "flat":
    if hosts == 1:
      return zj.compile_only_mesh((8,), ("data",)), {}
    return (zj.compile_only_mesh((2, 8), ("hosts", "data"), hosts=2),
            {"axis_name": ("hosts", "data")})
  first = 2  # the first axis: across the hosts on two hosts, within the one host on one
  rest = 8 * hosts // first
  if kind == "model":
    shape = (8 * hosts // 2, 2)
    return (zj.compile_only_mesh(shape, ("data", "model"), hosts=hosts), {})
  mesh = zj.compile_only_mesh((first, rest), ("outer", "data"), hosts=hosts)
  if kind == "replica":
    return mesh, {"replica_axis": "outer"}
  return mesh, {"axis_name": ("outer", "data"), "hpz_axis": "data"}


def lower_case(name: str, hosts: int):
  (loss_fn, params), options, kind = CASES[name]
  mesh, axes = mesh_options(kind, hosts)
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), mesh=mesh, **axes, **options)
  batch = {"x": jax.ShapeDtypeStruct((ROWS * 8 * hosts, D), jnp.float32)}
  return step, step.lower(step.abstract_state(params()), batch)


def compile_case(name: str, hosts: int):
  return lower_case(name, hosts)[1].compile()
