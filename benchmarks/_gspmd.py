"""The JAX peer: FSDP and HSDP written with ``jax.jit`` shardings, as MaxText writes them.

No library: parameters and AdamW state carry `NamedSharding`s that split one weight
dimension (the model width, MaxText's ``embed`` logical axis) over the FSDP axes, the batch
and every activation are constrained to the batch split (MaxText's ``activation_batch``
rules), the stacked blocks run under ``jax.lax.scan`` with each layer under
``jax.checkpoint(policy=...)`` (``scan_layers=True`` and ``remat_policy``), and XLA's SPMD
partitioner inserts the all-gathers and reduce-scatters. HSDP replicates the parameters over
a second (cross-host) axis and splits the batch over both. Compute is bf16 on fp32 weights
(MaxText's ``weight_dtype=float32``, ``dtype=bfloat16``), as ``precision="bf16"`` in zero_jax.

Example (compile-only H100s need JAX's CUDA plugin):
  >>> mesh = compile_only_auto_mesh((8,), ("data",), gpu="h100")        # doctest: +SKIP
  >>> lowered = lower_step(_lm.GPT2_SMALL, mesh, fsdp=("data",), policy=None,
  ...                      rows=64)                                  # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import _lm
import zero_jax as zj

# NVIDIA JAX-Toolbox's GPU performance flags (per compile); the combine thresholds are set
# from the model (at least one layer's bytes) by `nvidia_flags`.
_PIPELINING = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
}


def nvidia_flags(cfg) -> dict:
  """JAX-Toolbox's flags, combine thresholds at two layers' fp32 bytes."""
  layer = 4 * (cfg.n_params() - cfg.vocab * cfg.d_model) // cfg.layers
  return {**_PIPELINING, **{f"xla_gpu_{op}_combine_threshold_bytes": 2 * layer
                            for op in ("all_gather", "reduce_scatter", "all_reduce")}}


def compile_only_auto_mesh(shape, names, *, gpu: str, hosts: int = 1):
  """`zj.compile_only_mesh` with Auto axes (sharding constraints are GSPMD's)."""
  return zj.compile_only_mesh(shape, names, gpu=gpu, hosts=hosts,
                              axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def fsdp_spec(shape: tuple, d_model: int, n: int, fsdp: tuple, stacked: bool) -> P:
  """Split a weight's model-width dimension over ``fsdp`` (else its largest dimension that
  ``n`` divides); a stacked leaf's layer dimension never, vectors (biases, norms) not at all."""
  lead = 1 if stacked else 0
  layer = shape[lead:]
  spec = [None] * len(shape)
  if len(layer) >= 2:
    dims = [i for i, s in enumerate(layer) if s == d_model and s % n == 0]
    dims = dims or sorted((i for i, s in enumerate(layer) if s % n == 0),
                          key=lambda i: -layer[i])[:1]
    if dims:
      spec[lead + dims[-1]] = fsdp if len(fsdp) > 1 else fsdp[0]
  return P(*spec)


def lower_step(cfg, mesh, *, fsdp: tuple, batch_axes: tuple | None = None, policy=None,
               rows: int):
  """The lowered GSPMD training step of ``cfg`` (a `_lm.GPTConfig` or `_lm.LlamaShape`:
  AdamW, bf16 compute on fp32 weights).

  Args:
    mesh: an Auto-axes mesh (`compile_only_auto_mesh`).
    fsdp: the axes the parameters and optimizer state are split over.
    batch_axes: the axes the batch is split over (default ``fsdp``; HSDP: all axes).
    policy: each layer's ``jax.checkpoint`` policy, or None (no remat: XLA keeps what the
      backward pass needs, the gathered weights included).
    rows: global batch rows (sequences).
  """
  batch_axes = fsdp if batch_axes is None else batch_axes
  n = int(np.prod([mesh.shape[a] for a in fsdp]))
  act = NamedSharding(mesh, P(batch_axes))
  constrain = lambda x: jax.lax.with_sharding_constraint(x, act)
  fam = _lm.family(cfg)
  body = fam.block(cfg)

  def layer(h, p):
    h, y = body(constrain(h), p)
    return constrain(h), y

  # prevent_cse=False inside the layer scan, as MaxText sets it with scan_layers (the scan
  # already keeps XLA from merging the recomputation into the forward pass).
  layer = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)

  def blocks_fn(blocks, x):
    return jax.lax.scan(layer, x, blocks)[0]

  loss_fn = fam.loss_with(cfg, blocks_fn, constrain)
  opt = optax.adamw(1e-4)

  def train_step(params, opt_state, batch):
    half = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
    loss, grads = jax.value_and_grad(loss_fn)(half, batch)
    grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return optax.apply_updates(params, updates), opt_state, metrics

  stacked = lambda path: "blocks" in jax.tree_util.keystr(path)
  sharded = lambda path, s: NamedSharding(mesh, fsdp_spec(s.shape, cfg.d_model, n, fsdp,
                                                          stacked(path)))
  abstract = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharded(path, s)), tree)
  params = abstract(jax.eval_shape(lambda k: fam.init(cfg, k), jax.random.key(0)))
  opt_state = abstract(jax.eval_shape(opt.init, params))
  batch = {"tokens": jax.ShapeDtypeStruct((rows, cfg.seq_len + 1), jnp.int32, sharding=act)}
  shard_of = lambda tree: jax.tree.map(lambda s: s.sharding, tree)
  step = jax.jit(train_step, donate_argnums=(0, 1),
                 out_shardings=(shard_of(params), shard_of(opt_state),
                                NamedSharding(mesh, P())))
  return step.lower(params, opt_state, batch)
