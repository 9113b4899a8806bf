"""Fine-tune a Llama checkpoint (Hugging Face safetensors) with ZeRO-3, and write it back.

A Llama-architecture decoder in Flax NNX (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP) whose parameters map onto Hugging Face's names through one
``rename`` function (Flax kernels are ``(in, out)``, PyTorch ``Linear`` weights ``(out,
in)``: those are transposed). The model is never whole on a device or on the host:

* ``zj.load_safetensors`` traces the function that builds it (nothing is allocated) and
  reads each device's block of each tensor from the files; ``step.init(..., donate=True)``
  keeps those blocks as the state;
* ZeRO-3 (``stage=3``) fine-tunes it on the bytes of a Python source file;
* ``zj.export_safetensors`` writes the result from the shards, in the layout it came in
  (``config.json`` copied along), ready for ``transformers``' ``from_pretrained``.

Without ``--checkpoint`` a tiny random checkpoint in the Hugging Face layout is written
first (nothing is downloaded). A real one is a directory with ``config.json`` and
``model.safetensors`` (or shards and ``model.safetensors.index.json``); its tokens
would come from its tokenizer, here they are the file's bytes.

    python examples/finetune_llama.py                      # tiny random model, 20 steps
    python examples/finetune_llama.py --checkpoint DIR --out DIR2 --steps 100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import numpy as np


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The fields of a Hugging Face ``LlamaConfig`` this model uses."""
  vocab_size: int = 256
  hidden_size: int = 64
  intermediate_size: int = 128
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0

  @classmethod
  def from_json(cls, path):
    with open(path) as f:
      raw = json.load(f)
    return cls(**{k.name: raw[k.name] for k in dataclasses.fields(cls) if k.name in raw})

  def to_hf(self) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
            "mlp_bias": False, "max_position_embeddings": 2048, **dataclasses.asdict(self)}


def hf_name(name: str):
  """A leaf's default name (``layers.0.self_attn.q_proj.kernel``) -> the Hugging Face tensor
  name, and whether the file holds it transposed (``Linear`` weights are ``(out, in)``)."""
  if name.endswith(".kernel"):
    name, transpose = name[:-len("kernel")] + "weight", True
  elif name.endswith(".embedding"):
    name, transpose = name[:-len("embedding")] + "weight", False
  else:
    transpose = False
  return (name if name.startswith("lm_head.") else "model." + name), transpose


def build_model(cfg: LlamaConfig, rngs):
  """The NNX Llama (classes made here, so that flax is imported only when used)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  dense = lambda i, o: nnx.Linear(i, o, use_bias=False, rngs=rngs)
  head_dim = cfg.hidden_size // cfg.num_attention_heads

  class RMSNorm(nnx.Module):
    def __init__(self, dim):
      self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x):
      h = x.astype(jnp.float32)
      h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + cfg.rms_norm_eps)
      return self.weight[...] * h.astype(x.dtype)

  def rotary(x, positions):  # Hugging Face's rotate_half convention
    inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = positions[:, None].astype(jnp.float32) * inv
    cos, sin = jnp.cos(jnp.concatenate([freqs] * 2, -1)), jnp.sin(jnp.concatenate([freqs] * 2, -1))
    x1, x2 = jnp.split(x, 2, -1)
    return x * cos[:, None] + jnp.concatenate([-x2, x1], -1) * sin[:, None]

  class Attention(nnx.Module):
    def __init__(self):
      kv = cfg.num_key_value_heads * head_dim
      self.q_proj, self.k_proj = dense(cfg.hidden_size, cfg.hidden_size), dense(cfg.hidden_size, kv)
      self.v_proj, self.o_proj = dense(cfg.hidden_size, kv), dense(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, x):
      b, s, _ = x.shape
      pos = jnp.arange(s)
      q = rotary(self.q_proj(x).reshape(b, s, cfg.num_attention_heads, head_dim), pos)
      k = rotary(self.k_proj(x).reshape(b, s, cfg.num_key_value_heads, head_dim), pos)
      v = self.v_proj(x).reshape(b, s, cfg.num_key_value_heads, head_dim)
      rep = cfg.num_attention_heads // cfg.num_key_value_heads  # grouped-query attention
      k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
      scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
      w = jax.nn.softmax(scores.astype(jnp.float32), -1).astype(x.dtype)
      return self.o_proj(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, -1))

  class MLP(nnx.Module):
    def __init__(self):
      h, m = cfg.hidden_size, cfg.intermediate_size
      self.gate_proj, self.up_proj, self.down_proj = dense(h, m), dense(h, m), dense(m, h)

    def __call__(self, x):
      return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))

  class Block(nnx.Module):
    def __init__(self):
      self.input_layernorm, self.self_attn = RMSNorm(cfg.hidden_size), Attention()
      self.post_attention_layernorm, self.mlp = RMSNorm(cfg.hidden_size), MLP()

    def __call__(self, x):
      x = x + self.self_attn(self.input_layernorm(x))
      return x + self.mlp(self.post_attention_layernorm(x))

  class Llama(nnx.Module):
    def __init__(self):
      self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
      self.layers = nnx.List([Block() for _ in range(cfg.num_hidden_layers)])
      self.norm = RMSNorm(cfg.hidden_size)
      self.lm_head = dense(cfg.hidden_size, cfg.vocab_size)

    def __call__(self, tokens):
      x = self.embed_tokens(tokens)
      for layer in self.layers:
        x = layer(x)
      return self.lm_head(self.norm(x))

  return Llama()


def hf_shapes(cfg: LlamaConfig) -> dict:
  """Hugging Face's tensor names and (PyTorch) shapes of a Llama."""
  h, m, kv = cfg.hidden_size, cfg.intermediate_size, \
      cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
  out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
         "lm_head.weight": (cfg.vocab_size, h)}
  for i in range(cfg.num_hidden_layers):
    p = f"model.layers.{i}."
    out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                p + "mlp.down_proj.weight": (h, m)})
  return out


def write_tiny_checkpoint(directory, cfg: LlamaConfig, seed: int = 0) -> dict:
  """A random checkpoint in the Hugging Face layout (what a download would give)."""
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


def text_batches(batch_size: int, seq_len: int, vocab: int, seed: int = 0):
  """Windows of the bytes of a Python source file (``json/decoder.py``), forever."""
  with open(json.decoder.__file__, "rb") as f:
    data = np.frombuffer(f.read(), np.uint8).astype(np.int32)
  data %= vocab
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
    yield np.stack([data[s:s + seq_len + 1] for s in starts])


def loss_fn(model, tokens):
  import optax
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype("float32"), tokens[:, 1:]).mean()


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", help="a Hugging Face Llama directory (default: a tiny "
                                      "random one, written first)")
  p.add_argument("--out", help="where to export (default: a temporary directory; the tiny "
                               "checkpoint is written beside it)")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch-size", type=int, default=16, help="global batch size")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--devices", type=int, default=8,
                 help="fake CPU devices to use when the machine has only one device")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  import jax
  jax.config.update("jax_num_cpu_devices", args.devices)  # affects only the CPU backend
  import optax
  from flax import nnx
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.path.exists(os.path.join(root, "zero_jax", "__init__.py")):
    sys.path.insert(0, root)  # run from a checkout: its zero_jax, installed or not
  import zero_jax as zj

  work = tempfile.mkdtemp(prefix="finetune_llama_") if args.out is None else \
      os.path.dirname(os.path.abspath(args.out))
  checkpoint = args.checkpoint or os.path.join(work, "tiny-llama")
  if args.checkpoint is None:
    write_tiny_checkpoint(checkpoint, LlamaConfig())
  cfg = LlamaConfig.from_json(os.path.join(checkpoint, "config.json"))
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adamw(args.lr), mesh=mesh, stage=3)

  # The same function step.init would take, traced (nothing allocated): each device reads
  # its block of each tensor; the state keeps those blocks (donate=True: no second copy).
  make_model = lambda: build_model(cfg, nnx.Rngs(0))
  model = zj.load_safetensors(checkpoint, make_model, step=step, rename=hf_name)
  state = step.init(model, donate=True)
  losses = []
  batches = text_batches(args.batch_size, args.seq_len, cfg.vocab_size)
  for i in range(args.steps):
    state, metrics = step(state, next(batches))
    losses.append(float(metrics["loss"]))
    if i % 5 == 0 or i == args.steps - 1:
      zj.print_main(f"step {i:4d}  loss {losses[-1]:.4f}")

  out = args.out or os.path.join(work, "finetuned")
  files = zj.export_safetensors(step, state, out, rename=hf_name, force=True)
  if jax.process_index() == 0:
    shutil.copy(os.path.join(checkpoint, "config.json"), out)
  zj.print_main(f"wrote {', '.join(files)} and config.json to {out}")
  return {"losses": losses, "checkpoint": checkpoint, "out": out, "files": files,
          "step": step, "state": state, "config": cfg}


if __name__ == "__main__":
  main()
