"""Writes tests/data/hf/: tiny checkpoints saved by Hugging Face transformers itself, with
transformers' logits on fixed tokens (the reference tests/test_finetune_llama.py loads each
through examples/finetune_llama.py against).

Not run in CI (it needs torch and transformers, which the project does not depend on):

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers
    /tmp/hf/bin/python tools/make_hf_testdata.py            # rewrites tests/data/hf/

Each variant is a directory as ``save_pretrained`` writes it (``config.json``,
``model.safetensors``, ``generation_config.json``) plus ``tokens.npy`` (int32 ``[2, 12]``)
and ``logits.npy`` (float32 ``[2, 12, vocab]``, the model run in float32 by transformers);
a bf16 checkpoint also gets ``logits_bfloat16.npy`` (the model run in bfloat16).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil

import numpy as np
import torch
import transformers

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "hf"
SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# name: (config class, its arguments, dtype of the saved tensors)
VARIANTS = {
    # Llama 2: multi-head attention, rope_theta 10000, rms_norm_eps 1e-5, untied head.
    "llama2": (transformers.LlamaConfig, dict(SMALL, num_key_value_heads=4, rms_norm_eps=1e-5,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 10000.0}),
               torch.float32),
    # Llama 3.1: grouped-query attention, llama3 rope scaling (theta 500000).
    "llama31": (transformers.LlamaConfig, dict(SMALL, num_key_value_heads=2,
                                               rope_parameters=LLAMA3_ROPE), torch.float32),
    # Llama 3.2 1B/3B: the head tied to the embedding (no lm_head.weight in the file).
    "tied": (transformers.LlamaConfig, dict(SMALL, num_key_value_heads=2, tie_word_embeddings=True,
                                            rope_parameters=LLAMA3_ROPE), torch.float32),
    # Biases in attention and MLP, head_dim other than hidden_size / heads.
    "bias_head_dim": (transformers.LlamaConfig, dict(SMALL, num_key_value_heads=2, head_dim=16,
                                                     attention_bias=True, mlp_bias=True),
                      torch.float32),
    # Most Hub checkpoints: bfloat16 tensors.
    "bf16": (transformers.LlamaConfig, dict(SMALL, num_key_value_heads=2,
                                            rope_parameters=LLAMA3_ROPE), torch.bfloat16),
    # Qwen2: the Llama layout with q/k/v biases.
    "qwen2": (transformers.Qwen2Config, dict(SMALL, num_key_value_heads=2), torch.float32),
}
MODELS = {transformers.LlamaConfig: transformers.LlamaForCausalLM,
          transformers.Qwen2Config: transformers.Qwen2ForCausalLM}


def randomize(model, seed: int) -> None:
  """Weights of the size a trained model has (transformers' init is nearly zero, which would
  make every logit nearly equal): N(0, 1/fan_in) matrices, norms near 1, small biases."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=g)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * noise)
      elif name.endswith(".bias"):
        p.copy_(0.1 * noise)
      else:
        p.copy_(noise / p.shape[-1] ** 0.5)


def make(name: str, seed: int) -> None:
  config_cls, kwargs, dtype = VARIANTS[name]
  torch.manual_seed(seed)
  model = MODELS[config_cls](config_cls(**kwargs)).eval()
  randomize(model, seed)
  model = model.to(dtype)
  out = OUT / name
  shutil.rmtree(out, ignore_errors=True)
  model.save_pretrained(out)
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, kwargs["vocab_size"], (2, 12)).astype(np.int32)
  ids = torch.from_numpy(tokens.astype(np.int64))
  np.save(out / "tokens.npy", tokens)
  if dtype != torch.float32:  # also as transformers runs it in the checkpoint's dtype
    with torch.no_grad():
      logits = model(ids).logits.float().numpy()
    np.save(out / f"logits_{str(dtype).split('.')[-1]}.npy", logits)
  with torch.no_grad():  # the reference: the saved tensors, run in float32
    logits = model.float()(ids).logits.numpy()
  np.save(out / "logits.npy", logits.astype(np.float32))
  files = sorted(p.name for p in out.iterdir())
  print(f"{name}: {files}, {sum(p.stat().st_size for p in out.iterdir())} bytes, "
        f"transformers {transformers.__version__}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("variants", nargs="*", default=sorted(VARIANTS))
  args = p.parse_args()
  torch.set_num_threads(1)
  for i, name in enumerate(sorted(VARIANTS)):
    if name in args.variants:
      make(name, seed=i)
  with open(OUT / "README.md", "w") as f:
    f.write(f"Written by tools/make_hf_testdata.py with transformers {transformers.__version__} "
            f"and torch {torch.__version__.split('+')[0]}; do not edit by hand.\n")


if __name__ == "__main__":
  main()
