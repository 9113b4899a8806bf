"""Hugging Face's side of the model: tensor names and shapes, the tensors of a checkpoint's
files, and a tiny random checkpoint in the same layout (what a download would give)."""

from __future__ import annotations

import json
import os

import numpy as np

from llama.config import LlamaConfig


def hf_name(name: str):
  """A leaf's default name -> the Hugging Face tensor name, and whether the file holds it
  transposed (``Linear`` weights are ``(out, in)``).

  A stacked block's leaf (``layers.self_attn.q_proj.kernel``, the layers first) maps to the
  per-layer names ``model.layers.{i}.self_attn.q_proj.weight``: ``zj.load_safetensors`` and
  ``zj.export_safetensors`` read and write one tensor per layer (each transposed on its own).
  A list's block (``layers.0.self_attn.q_proj.kernel``) maps to its layer's name."""
  head, _, rest = name.partition(".")
  if head == "layers" and not rest.split(".", 1)[0].isdigit():
    name = "layers.{i}." + rest
  if name.endswith(".kernel"):
    name, transpose = name[:-len("kernel")] + "weight", True
  elif name.endswith(".embedding"):
    name, transpose = name[:-len("embedding")] + "weight", False
  else:
    transpose = False
  return (name if name.startswith("lm_head.") else "model." + name), transpose


def hf_shapes(cfg: LlamaConfig) -> dict:
  """Hugging Face's tensor names and (PyTorch) shapes of the model of ``cfg``."""
  h, m, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
  out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
  if not cfg.tie_word_embeddings:
    out["lm_head.weight"] = (cfg.vocab_size, h)
  qkv_bias, o_bias = cfg.attention_bias or cfg.qkv_bias, cfg.attention_bias
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    linear = {"self_attn.q_proj": (q, h, qkv_bias), "self_attn.k_proj": (kv, h, qkv_bias),
              "self_attn.v_proj": (kv, h, qkv_bias), "self_attn.o_proj": (h, q, o_bias),
              "mlp.gate_proj": (m, h, cfg.mlp_bias), "mlp.up_proj": (m, h, cfg.mlp_bias),
              "mlp.down_proj": (h, m, cfg.mlp_bias)}
    out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    for name, (o, i_, bias) in linear.items():
      out[p + name + ".weight"] = (o, i_)
      if bias:
        out[p + name + ".bias"] = (o,)
  return out


def checkpoint_tensors(directory: str) -> dict:
  """``{name: (safetensors dtype name, shape, file)}`` of a checkpoint directory's tensors,
  from its files' headers: the files ``zj.load_safetensors`` reads (``model.safetensors``,
  else the index's), each header read and checked by zero_jax's own parser (a damaged or
  truncated file is a ``ValueError`` naming it; so is an index naming a file outside its
  folder: through ``..``, an absolute path, or a link leading out)."""
  from zero_jax.checkpoint import safetensors_files
  from zero_jax.checkpoint import safetensors_format as fmt
  out = {}
  for path in safetensors_files.find_files(directory).files:
    for name, e in fmt.header_of(path).items():
      out[name] = (e.code, e.shape, path)
  return out


def write_tiny_checkpoint(directory, cfg: LlamaConfig, seed: int = 0) -> dict:
  """A random float32 checkpoint of ``cfg`` in the Hugging Face layout."""
  from safetensors.numpy import save_file
  rng = np.random.default_rng(seed)
  weights = {k: (1.0 + 0.1 * rng.normal(size=s) if k.endswith("norm.weight") else
                 rng.normal(size=s) / np.sqrt(s[-1])).astype(np.float32)
             for k, s in hf_shapes(cfg).items()}
  os.makedirs(directory, exist_ok=True)
  save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(cfg.to_hf(), f, indent=2)
  return weights
