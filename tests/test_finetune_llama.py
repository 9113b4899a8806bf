"""examples/finetune_llama.py: a Hugging Face Llama checkpoint in, ZeRO-3 fine-tuning, out.

The checkpoint is written here (random weights under Hugging Face's names and PyTorch's
shapes); the references are a NumPy Llama written from Hugging Face's definitions (for
the NNX model's forward pass) and plain optax on one device (for the training steps).
"""

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

import zero_jax as zj

PATH = pathlib.Path(__file__).resolve().parent.parent / "examples" / "finetune_llama.py"
_spec = importlib.util.spec_from_file_location("finetune_llama", PATH)
EX = sys.modules["finetune_llama"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)
STEPS, BATCH, SEQ = 3, 8, 16


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp("finetune") / "out"
  return EX.main(["--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
                  "--out", str(out)])


def plain_model(cfg, weights):
  """``(forward(tokens), params)``: the NNX Llama on one device, its parameters set from
  Hugging Face's tensors."""
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: EX.build_model(cfg, nnx.Rngs(0))),
                                     nnx.Param, ...)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = []
  for path, _ in flat:
    name, transpose = EX.hf_name(zj.checkpoint.safetensors_format.default_name(path,
                                                                              variable=True))
    leaves.append(jax.device_put(weights[name].T if transpose else weights[name],
                                 jax.devices()[0]))
  params = jax.tree.unflatten(treedef, leaves)
  return jax.jit(lambda p, tokens: nnx.merge(graphdef, p, rest)(tokens)), params, graphdef, rest


def numpy_llama(cfg, w, tokens):
  """Llama's forward pass in NumPy, after Hugging Face's modeling_llama (float64)."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
  hd = cfg.hidden_size // nh
  norm = lambda x, g: g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
  s = tokens.shape[1]
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, hd, 2) / hd)
  emb = np.concatenate([np.arange(s)[:, None] * inv] * 2, -1)
  cos, sin = np.cos(emb)[None, :, None], np.sin(emb)[None, :, None]
  rope = lambda x: x * cos + np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin
  x = w["model.embed_tokens.weight"][tokens]
  for i in range(cfg.num_hidden_layers):
    p = lambda n: w[f"model.layers.{i}.{n}.weight"]
    h = norm(x, p("input_layernorm"))
    q = rope((h @ p("self_attn.q_proj").T).reshape(*h.shape[:2], nh, hd))
    k = rope((h @ p("self_attn.k_proj").T).reshape(*h.shape[:2], nkv, hd))
    v = (h @ p("self_attn.v_proj").T).reshape(*h.shape[:2], nkv, hd)
    k, v = np.repeat(k, nh // nkv, 2), np.repeat(v, nh // nkv, 2)
    a = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd) + np.triu(np.full((s, s), -np.inf), 1)
    a = np.exp(a - a.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape) @ p("self_attn.o_proj").T
    h = norm(x, p("post_attention_layernorm"))
    gate = h @ p("mlp.gate_proj").T
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
  return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_the_nnx_llama_gives_hugging_faces_logits_and_loads_split(run):
  cfg = run["config"]
  weights = load_file(pathlib.Path(run["checkpoint"]) / "model.safetensors")
  tokens = next(EX.text_batches(2, SEQ, cfg.vocab_size, seed=5))
  ref = numpy_llama(cfg, weights, tokens)
  forward, params, _, _ = plain_model(cfg, weights)
  np.testing.assert_allclose(np.asarray(forward(params, tokens)), ref, rtol=1e-4, atol=1e-4)
  abstract = nnx.eval_shape(lambda: EX.build_model(cfg, nnx.Rngs(0)))
  loaded = zj.load_safetensors(run["checkpoint"], abstract, step=run["step"], rename=EX.hf_name)
  mine = jax.tree.leaves(nnx.state(loaded, nnx.Param))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], mine):
    assert b.sharding.spec != jax.sharding.PartitionSpec(*[None] * b.ndim), path  # split
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(path))


def test_fine_tuning_from_the_checkpoint_matches_plain_optax_on_one_device(run):
  cfg = run["config"]
  _, params, graphdef, rest = plain_model(
      cfg, load_file(pathlib.Path(run["checkpoint"]) / "model.safetensors"))
  opt = optax.adamw(1e-3)

  @jax.jit
  def update(params, opt_state, batch):
    loss, g = jax.value_and_grad(lambda p: EX.loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = opt.init(params), []
  batches = EX.text_batches(BATCH, SEQ, cfg.vocab_size)
  for _ in range(STEPS):
    params, opt_state, loss = update(params, opt_state, next(batches))
    losses.append(float(loss))
  np.testing.assert_allclose(run["losses"], losses, rtol=1e-5)
  assert losses[-1] < losses[0]
  mine = run["step"].get_params(run["state"])
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(mine)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_the_export_is_the_trained_params_under_hugging_faces_names(run):
  out = pathlib.Path(run["out"])
  assert run["files"] == ["model.safetensors"]
  assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
  got = load_file(out / "model.safetensors")
  shapes = EX.hf_shapes(run["config"])
  assert {k: v.shape for k, v in got.items()} == shapes
  params = run["step"].get_params(run["state"])
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name, transpose = EX.hf_name(zj.checkpoint.safetensors_format.default_name(path,
                                                                              variable=True))
    x = np.asarray(x)
    assert got[name].tobytes() == np.ascontiguousarray(x.T if transpose else x).tobytes(), name


def test_hugging_face_transformers_gives_the_same_logits(run):
  """Only where torch and transformers are installed (not required by CI)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg = run["config"]
  hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf())).eval()
  weights = load_file(pathlib.Path(run["out"]) / "model.safetensors")
  hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in weights.items()})
  tokens = next(EX.text_batches(2, SEQ, cfg.vocab_size, seed=5))
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  forward, params, _, _ = plain_model(cfg, weights)
  mine = np.asarray(forward(params, tokens))
  np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-4)
