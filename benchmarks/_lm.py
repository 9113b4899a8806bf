"""Transformer language models shared by the GPU, overlap and speed benchmarks.

Two families, neither of which sets up devices (import it after choosing them):

- **GPT-like** (`GPTConfig`): the LM example's block (``examples/train_lm.py``: pre-LayerNorm,
  fused QKV, GELU MLP of width 4d), stacked over layers and run with ``zj.scan(...,
  prefetch=p)`` when ``zero_jax`` has it, else with today's schedule (``jax.lax.scan`` over a
  ``jax.checkpoint`` body that calls ``zj.gather``: prefetch 0). Tied embeddings, learned
  positions, any vocabulary. `model_flops_per_token` counts its matmuls from the architecture.
- **lm1b-like** (`LM1B`): Flax's ``examples/lm1b`` decoder in miniature, written as lm1b writes
  it (a Python loop over ``layers_i``, parameters boxed with ``nn.with_logical_partitioning``,
  sinusoidal positions, a padding mask) with a masked token loss returned as a
  ``zj.WeightedLoss``; batches are padded sequences of random length.

Example:
  >>> cfg = GPTConfig("t", vocab=64, d_model=32, layers=2, heads=2, seq_len=16)
  >>> params = init_gpt(cfg, jax.random.key(0))
  >>> loss = make_gpt_loss(cfg, prefetch=0)(params, gpt_batch(cfg, 4, seed=0))
"""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, ".."))
sys.path.insert(0, os.path.join(_HERE, "..", "examples"))
import zero_jax as zj  # noqa: E402
import train_lm  # noqa: E402


# ---------------------------------------------------------------- GPT-like
class GPTConfig(NamedTuple):
  """Shapes of a GPT-like model (the LM example's block)."""
  name: str
  vocab: int
  d_model: int
  layers: int
  heads: int
  seq_len: int
  attention: str = "written"  # `train_lm.causal_attention`'s implementation

  def n_params(self) -> int:
    d = self.d_model
    per_layer = 12 * d * d + 13 * d  # qkv, proj, up, down (+ biases) and two LayerNorms
    return self.vocab * d + self.seq_len * d + self.layers * per_layer + 2 * d


# The LM example at its largest preset size, GPT-2 small's shapes, and about 1B parameters
# (20 blocks of d=2048: 1.007e9 in the blocks) that train on one 80 GB H100 in bf16 with Adam.
LM_EXAMPLE = GPTConfig("LM example (large)", train_lm.VOCAB, *train_lm.SIZES["large"], 512)
GPT2_SMALL = GPTConfig("GPT-2 small", 50257, 768, 12, 12, 1024)
GPT_1B = GPTConfig("1B", 50257, 2048, 20, 16, 2048)


def in_embedding(path, _) -> bool:
  """``lookup=``: the untied embedding table, read by rows (`zero_jax.take`)."""
  return jax.tree_util.keystr(path) == "['embed']"


def in_blocks(path, _) -> bool:
  """``stacked=``: the blocks' parameters, layers first."""
  return jax.tree_util.keystr(path).startswith("['blocks']")


def _block(cfg: GPTConfig):
  return train_lm.Block(cfg.d_model, cfg.heads, cfg.attention)


def init_gpt(cfg: GPTConfig, key, dtype=jnp.float32) -> dict:
  """Parameters: ``embed``, ``pos``, ``blocks`` (stacked, layers first) and ``ln_f``."""
  k_embed, k_pos, k_blocks = jax.random.split(key, 3)
  x = jnp.zeros((1, 4, cfg.d_model))
  keys = jax.random.split(k_blocks, cfg.layers)
  plain = cfg._replace(attention="written")  # the same parameters; runs on float32 here
  blocks = jax.vmap(lambda k: _block(plain).init(k, x, None)["params"])(keys)
  ln_f = nn.LayerNorm().init(k_pos, x)["params"]
  params = {"embed": 0.02 * jax.random.normal(k_embed, (cfg.vocab, cfg.d_model)),
            "pos": 0.02 * jax.random.normal(k_pos, (cfg.seq_len, cfg.d_model)),
            "blocks": blocks, "ln_f": ln_f}
  return jax.tree.map(lambda a: a.astype(dtype), params)


def has_prefetch() -> bool:
  """Whether this ``zero_jax`` has ``zj.scan`` (explicit prefetch)."""
  return hasattr(zj, "scan")


def block_fn(cfg: GPTConfig):
  """``body(h, layer_params) -> (h, None)``: one block, as a scan body."""
  block = _block(cfg)

  def body(h, p):
    return block.apply({"params": p}, h, None)[0], None
  return body


def scan_blocks(cfg: GPTConfig, blocks, x, prefetch: int, policy=None):
  """The blocks over ``x``: ``zj.scan(..., prefetch=, policy=)`` if there is one, else
  today's schedule (``policy`` must then be None)."""
  body = block_fn(cfg)
  if has_prefetch():
    kw = {} if policy is None else {"policy": policy}  # (a zero_jax from before policy=)
    h, _ = zj.scan(body, x, blocks, prefetch=prefetch, **kw)
  else:
    if prefetch:
      raise ValueError(f"prefetch={prefetch} needs zero_jax.scan, which this zero_jax lacks")
    h, _ = jax.lax.scan(jax.checkpoint(lambda h, p: body(h, zj.gather(p))), x, blocks)
  return h


def gpt_loss_with(cfg: GPTConfig, blocks_fn, constrain=lambda x: x):
  """``loss_fn(params, batch)``: next-token cross entropy, mean over the tokens, with the
  blocks run by ``blocks_fn(blocks, x)`` and the activations passed through ``constrain``."""
  def loss_fn(params, batch):
    tokens = batch["tokens"]
    x = constrain(params["embed"][tokens[:, :-1]] + params["pos"][:tokens.shape[1] - 1])
    x = constrain(blocks_fn(params["blocks"], x))
    x = nn.LayerNorm().apply({"params": params["ln_f"]}, x)
    logits = constrain((x @ params["embed"].T).astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss_fn


def make_gpt_loss(cfg: GPTConfig, prefetch: int, policy=None):
  """``loss_fn(params, batch)`` of ``cfg``, its blocks under ``zj.scan(prefetch=, policy=)``."""
  return gpt_loss_with(cfg, lambda blocks, x: scan_blocks(cfg, blocks, x, prefetch, policy))


def gpt_batch(cfg: GPTConfig, rows: int, seed: int) -> dict:
  r = np.random.default_rng(seed)
  return {"tokens": r.integers(0, cfg.vocab, size=(rows, cfg.seq_len + 1)).astype(np.int32)}


def gpt_batch_shape(cfg: GPTConfig, rows: int) -> dict:
  return {"tokens": jax.ShapeDtypeStruct((rows, cfg.seq_len + 1), jnp.int32)}


def model_flops_per_token(cfg: GPTConfig) -> float:
  """Training flops per token from the architecture: 3x the forward matmuls.

  Forward, per token: ``24 d^2`` per block (QKV 6d^2, projection 2d^2, MLP 16d^2), ``4 T d``
  per block for attention (``QK^T`` and ``AV`` over the whole context, as the PaLM paper's
  MFU counts it) and ``2 d V`` for the logits; the backward pass is twice the forward. The
  recomputed forward pass of a remat'd block is not model work, so it is not counted (MFU,
  not hardware flops utilisation).
  """
  d, t = cfg.d_model, cfg.seq_len
  return 3.0 * (cfg.layers * (24 * d * d + 4 * t * d) + 2 * d * cfg.vocab)


def fused_attention(gpu: str = "h100") -> tuple[str, str]:
  """``(implementation, why)``: ``"cudnn"`` where cuDNN's fused attention compiles for
  compile-only ``gpu``s here (JAX's CUDA plugin and the ``nvidia-cudnn-cu12`` wheel), else
  ``"written"`` and the compiler's reason, for the benchmark to print beside its rows."""
  mesh = zj.compile_only_mesh((1,), ("data",), gpu=gpu, per_host=1)
  q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16,
                           sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  try:
    jax.jit(lambda q: train_lm.causal_attention(q, q, q, "cudnn")).lower(q).compile()
  except Exception as e:  # pylint: disable=broad-except  (the reason is printed)
    return "written", f"cuDNN attention does not compile here ({str(e).splitlines()[0][:200]})"
  return "cudnn", "cuDNN fused attention"


def with_attention(cfg, implementation: str):
  """``cfg`` (a `GPTConfig` or `LlamaShape`) with its blocks' attention implementation."""
  return cfg._replace(attention=implementation)


# ---------------------------------------------------------------- Llama-like
class LlamaShape(NamedTuple):
  """Shapes of a Llama-like decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP,
  untied head), its blocks stacked over layers."""
  name: str
  vocab: int
  d_model: int
  layers: int
  heads: int
  kv_heads: int
  mlp: int
  seq_len: int
  attention: str = "written"  # `train_lm.causal_attention`'s implementation

  def n_params(self) -> int:
    d, hd = self.d_model, self.d_model // self.heads
    per_layer = 2 * d + d * hd * (2 * self.heads + 2 * self.kv_heads) + 3 * d * self.mlp
    return 2 * self.vocab * d + d + self.layers * per_layer


# Meta's Llama 3 8B (config.json of Meta-Llama-3-8B), at a context of 2048 tokens.
LLAMA3_8B = LlamaShape("Llama-3-8B", 128256, 4096, 32, 32, 8, 14336, 2048)


def init_llama(cfg: LlamaShape, key, dtype=jnp.float32) -> dict:
  """Parameters: ``embed``, ``blocks`` (stacked, layers first), ``norm``, ``head``."""
  d, hd, n = cfg.d_model, cfg.d_model // cfg.heads, cfg.layers
  shapes = {"attn_norm": (n, d), "wq": (n, d, cfg.heads * hd), "wk": (n, d, cfg.kv_heads * hd),
            "wv": (n, d, cfg.kv_heads * hd), "wo": (n, cfg.heads * hd, d), "mlp_norm": (n, d),
            "gate": (n, d, cfg.mlp), "up": (n, d, cfg.mlp), "down": (n, cfg.mlp, d)}
  keys = iter(jax.random.split(key, len(shapes) + 2))
  blocks = {k: (jnp.ones(s) if k.endswith("norm") else 0.02 * jax.random.normal(next(keys), s))
            for k, s in shapes.items()}
  params = {"embed": 0.02 * jax.random.normal(next(keys), (cfg.vocab, d)), "blocks": blocks,
            "norm": jnp.ones((d,)), "head": 0.02 * jax.random.normal(next(keys), (d, cfg.vocab))}
  return jax.tree.map(lambda a: a.astype(dtype), params)


def _rms(x, w):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-5)).astype(x.dtype) * w


def _rope(x, theta: float = 500000.0):
  """Rotary positions (rotate-half convention) on ``x`` of shape (b, t, heads, head_dim)."""
  t, hd = x.shape[1], x.shape[-1]
  freq = theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]
  cos, sin = (jnp.concatenate([f(angle)] * 2, -1)[None, :, None, :] for f in (jnp.cos, jnp.sin))
  half = jnp.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
  return (x.astype(jnp.float32) * cos + half.astype(jnp.float32) * sin).astype(x.dtype)


def llama_block(cfg: LlamaShape):
  """``body(h, p) -> (h, None)``: one block on one layer's parameters."""
  hd, group = cfg.d_model // cfg.heads, cfg.heads // cfg.kv_heads

  def body(x, p):
    b, t, _ = x.shape
    h = _rms(x, p["attn_norm"])
    q = _rope((h @ p["wq"]).reshape(b, t, cfg.kv_heads, group, hd).reshape(b, t, -1, hd))
    k = _rope((h @ p["wk"]).reshape(b, t, cfg.kv_heads, hd))
    v = (h @ p["wv"]).reshape(b, t, cfg.kv_heads, hd)
    y = train_lm.causal_attention(q, k, v, cfg.attention).reshape(b, t, cfg.heads * hd)
    x = x + y @ p["wo"]
    h = _rms(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"], None
  return body


def llama_loss_with(cfg: LlamaShape, blocks_fn, constrain=lambda x: x):
  """``loss_fn(params, batch)``: next-token cross entropy, mean over the tokens, with the
  blocks run by ``blocks_fn(blocks, x)`` and the activations passed through ``constrain``."""
  def loss_fn(params, batch):
    tokens = batch["tokens"]
    x = constrain(zj.take(params["embed"], tokens[:, :-1]))  # table[ids]; split at stage 3
    x = constrain(blocks_fn(params["blocks"], x))
    logits = constrain((_rms(x, params["norm"]) @ params["head"]).astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss_fn


def make_llama_loss(cfg: LlamaShape, prefetch: int, policy=None):
  """``loss_fn(params, batch)`` of ``cfg``, its blocks under ``zj.scan(prefetch=, policy=)``."""
  def blocks_fn(blocks, x):
    return zj.scan(llama_block(cfg), x, blocks, prefetch=prefetch, policy=policy)[0]
  return llama_loss_with(cfg, blocks_fn)


class Family(NamedTuple):
  """What the benchmarks need of a model family: its ``init(cfg, key)``, ``block(cfg)`` (a
  scan body), ``loss_with(cfg, blocks_fn, constrain)`` and ``make_loss(cfg, prefetch,
  policy)``."""
  init: object
  block: object
  loss_with: object
  make_loss: object


def family(cfg) -> Family:
  """The `Family` of a config (`GPTConfig` or `LlamaShape`)."""
  if isinstance(cfg, LlamaShape):
    return Family(init_llama, llama_block, llama_loss_with, make_llama_loss)
  return Family(init_gpt, block_fn, gpt_loss_with, make_gpt_loss)


# ---------------------------------------------------------------- lm1b-like
class LM1BConfig(NamedTuple):
  vocab: int
  d_model: int
  heads: int
  mlp: int
  layers: int
  seq_len: int


def _sinusoid(length: int, d: int) -> np.ndarray:
  pos = np.arange(length)[:, None]
  div = np.exp(np.arange(0, d, 2) * (-math.log(10000.0) / d))
  pe = np.zeros((length, d), np.float32)
  pe[:, 0::2], pe[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
  return pe


class _LM1BBlock(nn.Module):
  cfg: LM1BConfig

  @nn.compact
  def __call__(self, x, mask):
    cfg, box = self.cfg, nn.with_logical_partitioning
    init = nn.initializers.xavier_uniform()
    norm = lambda: nn.LayerNorm(scale_init=box(nn.initializers.ones, ("embed",)),
                                bias_init=box(nn.initializers.zeros, ("embed",)))
    y = nn.MultiHeadDotProductAttention(
        num_heads=cfg.heads, qkv_features=cfg.d_model, use_bias=False,
        kernel_init=box(init, ("embed", "heads", "kv")),
        out_kernel_init=box(init, ("heads", "kv", "embed")))(norm()(x), mask=mask)
    x = x + y
    z = nn.Dense(cfg.mlp, kernel_init=box(init, ("embed", "mlp")),
                 bias_init=box(nn.initializers.zeros, ("mlp",)))(norm()(x))
    z = nn.Dense(cfg.d_model, kernel_init=box(init, ("mlp", "embed")),
                 bias_init=box(nn.initializers.zeros, ("embed",)))(nn.relu(z))
    return x + z


class LM1B(nn.Module):
  """lm1b's decoder: shared embedding, sinusoidal positions, causal + padding mask."""
  cfg: LM1BConfig

  @nn.compact
  def __call__(self, inputs):
    cfg, box = self.cfg, nn.with_logical_partitioning
    embed = nn.Embed(cfg.vocab, cfg.d_model,
                     embedding_init=box(nn.initializers.normal(1.0), ("vocab", "embed")))
    x = embed(inputs) + _sinusoid(cfg.seq_len, cfg.d_model)[:inputs.shape[1]]
    mask = nn.combine_masks(nn.make_attention_mask(inputs > 0, inputs > 0),
                            nn.make_causal_mask(inputs))
    for i in range(cfg.layers):
      x = _LM1BBlock(cfg, name=f"layers_{i}")(x, mask)
    x = nn.LayerNorm(scale_init=box(nn.initializers.ones, ("embed",)),
                     bias_init=box(nn.initializers.zeros, ("embed",)), name="final_norm")(x)
    return embed.attend(x.astype(jnp.float32))


def lm1b_params(cfg: LM1BConfig, seed: int = 0) -> dict:
  """Host (numpy) parameters, boxes removed (the step takes either)."""
  tokens = jnp.ones((1, cfg.seq_len), jnp.int32)
  params = jax.jit(LM1B(cfg).init)(jax.random.key(seed), tokens)["params"]
  return jax.tree.map(np.asarray, nn.unbox(params))


def make_lm1b_loss(cfg: LM1BConfig):
  """Masked next-token cross entropy as a ``zj.WeightedLoss`` (sum over real tokens, count)."""
  model = LM1B(cfg)

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    weights = (batch["targets"] > 0).astype(jnp.float32)
    return zj.WeightedLoss((ce * weights).sum(), weights.sum())
  return loss_fn


def lm1b_batch(cfg: LM1BConfig, rows: int, seed: int) -> dict:
  """Padded sequences: lengths uniform in [seq_len/4, seq_len], token 0 is padding."""
  r = np.random.default_rng(seed)
  lengths = r.integers(cfg.seq_len // 4, cfg.seq_len + 1, size=rows)
  seq = r.integers(1, cfg.vocab, size=(rows, cfg.seq_len + 1)).astype(np.int32)
  seq[np.arange(cfg.seq_len + 1)[None, :] > lengths[:, None]] = 0
  return {"inputs": seq[:, :-1], "targets": seq[:, 1:]}
