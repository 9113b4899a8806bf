"""The Llama / Qwen2 decoder in Flax NNX, after transformers' ``modeling_llama``.

RMSNorm, rotary embeddings (``default`` and ``llama3`` frequencies), grouped-query
attention with optional biases, SwiGLU MLP, and a head that is its own matrix or the
embedding's transpose (``tie_word_embeddings``). The decoder blocks are stacked (built with
``nnx.vmap``: every block variable has the layers along its first axis, ``layers.mlp.up_proj.
kernel`` is ``(layers, hidden, intermediate)``) and looped over with ``zj.scan``, which inside a
ZeRO-3 step made with ``stacked=`` gathers one layer at a time (the next one while this one
computes: ``prefetch``) and keeps for the backward pass what a ``jax.checkpoint`` policy says
(``remat``); outside a step it is ``jax.lax.scan``. ``stacked=False`` builds the blocks as a
Python list instead (each its own leaves; a ZeRO-3 step then gathers the whole model before the
loss: kept to measure what stacking saves). flax is imported inside `build_model`, so that
reading a config does not start JAX.
"""

from __future__ import annotations

import math

import numpy as np

from llama.config import LlamaConfig, Rope


def inv_freq(rope: Rope, head_dim: int) -> np.ndarray:
  """The rotary frequencies (float32, as transformers computes them)."""
  base = np.float32(rope.theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  inv = (np.float32(1.0) / base).astype(np.float32)
  if rope.rope_type == "default":
    return inv
  # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend between.
  old = rope.original_max_position_embeddings
  low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
  wavelen = 2 * math.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
  smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor -
                                                     rope.low_freq_factor)
  blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, blended, scaled).astype(np.float32)


REMAT = ("none", "dots", "full")


def remat_policy(remat: str):
  """``--remat``'s ``jax.checkpoint`` policy for ``zj.scan`` (None: keep what ``lax.scan``
  keeps): ``dots`` keeps the matmuls' outputs (not the attention's batched ones) and
  recomputes the elementwise work, ``full`` keeps each layer's input and recomputes the layer."""
  import jax
  if remat not in REMAT:
    raise ValueError(f"remat={remat!r}; expected one of {REMAT}.")
  return {"none": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "full": jax.checkpoint_policies.nothing_saveable}[remat]


def build_model(cfg: LlamaConfig, rngs, *, dtype=None, stacked: bool = True, prefetch: int = 1,
                remat: str = "none"):
  """The NNX model of ``cfg``, float32 parameters, computing in ``dtype`` (None: float32).

  Pass the dtype the parameters will have when the loss sees them (``jnp.bfloat16`` for a
  step with ``precision="bf16"``): ``nnx.Embed`` fixes the dtype of its output when it is
  built, and every later layer computes in the dtype of its input and parameters.
  ``stacked``: the blocks built with ``nnx.vmap`` as one module whose variables have the
  layers first, looped over with ``zj.scan(..., prefetch=prefetch, policy=remat_policy(remat))``
  (make the step with ``stacked=nnx.PathContains("layers")``); False: a list of blocks, each
  under ``nnx.remat`` with the same policy (unless ``remat="none"``).
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import zero_jax as zj

  policy = remat_policy(remat)
  dense = lambda i, o, bias, rngs: nnx.Linear(i, o, use_bias=bias, rngs=rngs)
  hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
  frequencies = inv_freq(cfg.rope, hd)

  class RMSNorm(nnx.Module):
    def __init__(self, dim):
      self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
      h = x.astype(jnp.float32)
      h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.rms_norm_eps)
      return self.weight[...] * h.astype(x.dtype)

  def rotary(x, positions):  # transformers' rotate_half convention, cos/sin in float32
    freqs = positions[:, None].astype(jnp.float32) * frequencies
    emb = jnp.concatenate([freqs] * 2, -1)
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, -1)
    return x * cos[:, None] + jnp.concatenate([-x2, x1], -1) * sin[:, None]

  class Attention(nnx.Module):
    def __init__(self, rngs):
      h, bias = cfg.hidden_size, cfg.attention_bias or cfg.qkv_bias
      self.q_proj, self.k_proj = dense(h, nh * hd, bias, rngs), dense(h, nkv * hd, bias, rngs)
      self.v_proj = dense(h, nkv * hd, bias, rngs)
      self.o_proj = dense(nh * hd, h, cfg.attention_bias, rngs)

    def __call__(self, x):
      b, s, _ = x.shape
      pos = jnp.arange(s)
      q = rotary(self.q_proj(x).reshape(b, s, nh, hd), pos)
      k = rotary(self.k_proj(x).reshape(b, s, nkv, hd), pos)
      v = self.v_proj(x).reshape(b, s, nkv, hd)
      k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
      scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
      w = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(x.dtype)
      return self.o_proj(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, nh * hd))

  class MLP(nnx.Module):
    def __init__(self, rngs):
      h, m, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
      self.gate_proj, self.up_proj = dense(h, m, bias, rngs), dense(h, m, bias, rngs)
      self.down_proj = dense(m, h, bias, rngs)

    def __call__(self, x):
      return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.input_layernorm, self.self_attn = RMSNorm(cfg.hidden_size), Attention(rngs)
      self.post_attention_layernorm, self.mlp = RMSNorm(cfg.hidden_size), MLP(rngs)

    def __call__(self, x):
      x = x + self.self_attn(self.input_layernorm(x))
      return x + self.mlp(self.post_attention_layernorm(x))

  class Llama(nnx.Module):
    def __init__(self):
      self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
      if stacked:
        @nnx.split_rngs(splits=cfg.num_hidden_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
          return Block(rngs)
        self.layers = make(rngs)  # every block variable: (num_hidden_layers, ...)
      else:
        self.layers = nnx.List([Block(rngs) for _ in range(cfg.num_hidden_layers)])
      self.norm = RMSNorm(cfg.hidden_size)
      if not cfg.tie_word_embeddings:
        self.lm_head = dense(cfg.hidden_size, cfg.vocab_size, False, rngs)

    def __call__(self, tokens, **scan):
      """Logits ``[batch, seq, vocab]``; ``scan``: ``zj.scan``'s ``prefetch=`` and
      ``policy=`` in place of the model's (for a loss ``zj.plan`` searches)."""
      # zj.take: rows of the table, which a step made with lookup= leaves split (only the
      # looked-up rows move); outside a step, or at stages 1-2, it is table[tokens].
      x = zj.take(self.embed_tokens.embedding, tokens)
      x = x if dtype is None else x.astype(dtype)
      if stacked:  # one layer gathered at a time inside a ZeRO-3 step; lax.scan outside
        x, _ = zj.scan(lambda h, block: (block(h), None), x, self.layers,
                       **{"prefetch": prefetch, "policy": policy, **scan})
      else:
        if scan:
          raise TypeError(f"zj.scan options {sorted(scan)} given to a model built with "
                          f"stacked=False, whose blocks are a list (no zj.scan).")
        block = lambda layer, h: layer(h)
        if remat != "none":  # each block keeps for the backward pass what zj.scan's would
          block = nnx.remat(block, policy=policy)
        for layer in self.layers:
          x = block(layer, x)
      x = self.norm(x)
      if cfg.tie_word_embeddings:  # the head is the whole table: gathered once
        return zj.gather(self.embed_tokens).attend(x)
      return self.lm_head(x)

  return Llama()
