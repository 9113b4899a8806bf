"""examples/finetune_llama.py: a Hugging Face Llama checkpoint in, ZeRO-3 fine-tuning, out.

Two kinds of checkpoint. tests/data/hf/ holds tiny checkpoints that transformers itself
saved (tools/make_hf_testdata.py: Llama 2, Llama 3.1 rope scaling, tied embeddings,
biases with head_dim, bf16, Qwen2) with transformers' logits on fixed tokens: each loads
through the example with those logits, exports after 0 steps to the same bytes and after
a step to the same names, shapes and dtypes. A random checkpoint written here checks the
fine-tuning against a NumPy Llama (float64, after transformers' modeling_llama) and plain
optax on one device.
"""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

import zero_jax as zj

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import finetune_llama as EX  # noqa: E402
from llama import config as C  # noqa: E402
from llama.hf_files import hf_name, hf_shapes  # noqa: E402
from llama.model import build_model  # noqa: E402

DATA = ROOT / "tests" / "data" / "hf"
VARIANTS = ["llama2", "llama31", "tied", "bias_head_dim", "bf16", "qwen2"]
STEPS, BATCH, SEQ, EVAL_EVERY, SAMPLE = 3, 8, 16, 2, 4
RUN = ["--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ),
       "--eval-every", str(EVAL_EVERY), "--sample", str(SAMPLE)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = tmp_path_factory.mktemp("finetune") / "out"
  return EX.main([*RUN, "--out", str(out)])


def header(path) -> dict:
  with open(path, "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(n))


def plain_model(cfg, weights):
  """``(forward(params, tokens), params, graphdef, rest)``: the NNX model on one device, its
  parameters set from Hugging Face's tensors."""
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))),
                                     nnx.Param, ...)
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = []
  for path, _ in flat:
    leaves.append(jax.device_put(hf_leaf(cfg, weights, path), jax.devices()[0]))
  params = jax.tree.unflatten(treedef, leaves)
  return jax.jit(lambda p, tokens: nnx.merge(graphdef, p, rest)(tokens)), params, graphdef, rest


def per_layer(cfg, path):
  """``([(Hugging Face name, transpose)], stacked)`` of a leaf: one name per layer for the
  stacked blocks' leaves (``model.layers.{i}...``, layers first), else one."""
  name, transpose = hf_name(zj.checkpoint.safetensors_format.default_name(path, variable=True))
  if "{i}" not in name:
    return [(name, transpose)], False
  return [(name.format(i=i), transpose) for i in range(cfg.num_hidden_layers)], True


def hf_leaf(cfg, weights, path) -> np.ndarray:
  """The value of the leaf at ``path`` from Hugging Face's tensors (stacked: per-layer
  tensors stacked along a new first axis, each transposed on its own)."""
  names, stacked = per_layer(cfg, path)
  parts = [weights[n].T if t else weights[n] for n, t in names]
  return np.stack(parts) if stacked else parts[0]


def numpy_llama(cfg, w, tokens):
  """Llama's forward pass in NumPy, after Hugging Face's modeling_llama (float64, default
  rope, no biases, untied)."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  norm = lambda x, g: g * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps)
  s = tokens.shape[1]
  inv = 1.0 / cfg.rope.theta ** (np.arange(0, hd, 2) / hd)
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
    x = x + np.einsum("bhqk,bkhd->bqhd", a, v).reshape(*x.shape[:2], -1) @ p("self_attn.o_proj").T
    h = norm(x, p("post_attention_layernorm"))
    gate = h @ p("mlp.gate_proj").T
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
  return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


# --------------------------------------------------------------- checkpoints transformers wrote
def check(directory, *extra, ref="logits.npy"):
  d = pathlib.Path(directory)
  return EX.main(["--checkpoint", str(d), "--check-logits", str(d / "tokens.npy"),
                  str(d / ref), *extra])


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_checkpoint_transformers_wrote_gives_transformers_logits(variant):
  result = check(DATA / variant)
  assert result["logits"].shape == (2, 12, result["config"].vocab_size)
  assert result["max_abs_diff"] < 1e-4


def test_a_bf16_checkpoint_at_bf16_precision_gives_transformers_bf16_logits():
  result = check(DATA / "bf16", "--precision", "bf16", ref="logits_bfloat16.npy")
  assert result["max_abs_diff"] < EX.ATOL["bf16"]
  # computed in bf16, not in float32 with bf16 weights
  assert result["max_abs_diff"] > 10 * check(DATA / "bf16")["max_abs_diff"]


def test_llama3_rope_scaling_changes_the_logits_beyond_the_tolerance():
  """Without the llama3 frequencies (the default rope at the same theta) the logits are
  off: the llama3 variant's test can fail."""
  cfg = C.LlamaConfig.from_json(DATA / "llama31" / "config.json")
  forward, params, _, _ = plain_model(dataclasses.replace(cfg, rope=C.Rope(cfg.rope.theta)),
                                      load_file(DATA / "llama31" / "model.safetensors"))
  tokens = np.load(DATA / "llama31" / "tokens.npy")
  assert np.abs(np.asarray(forward(params, tokens)) - np.load(DATA / "llama31" / "logits.npy")
                ).max() > 1e-3


def test_the_transformers_4_layout_of_rope_settings_gives_the_same_logits(tmp_path):
  """Llama 3.1's config.json as transformers 4.x wrote it: rope_theta at the top level,
  rope_scaling without it."""
  shutil.copytree(DATA / "llama31", tmp_path / "v4")
  raw = json.loads((tmp_path / "v4" / "config.json").read_text())
  rope = raw.pop("rope_parameters")
  raw["rope_theta"] = rope.pop("rope_theta")
  raw["rope_scaling"] = rope
  (tmp_path / "v4" / "config.json").write_text(json.dumps(raw))
  assert C.LlamaConfig.from_json(tmp_path / "v4" / "config.json") == \
      C.LlamaConfig.from_json(DATA / "llama31" / "config.json")
  assert check(tmp_path / "v4")["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_export_after_0_steps_is_the_file_transformers_wrote_byte_for_byte(variant, tmp_path):
  precision = ["--precision", "bf16"] if variant == "bf16" else []
  EX.main(["--checkpoint", str(DATA / variant), "--steps", "0", "--out", str(tmp_path / "o"),
           *precision])
  assert (tmp_path / "o" / "model.safetensors").read_bytes() == \
      (DATA / variant / "model.safetensors").read_bytes()


ONE_STEP = ["--steps", "1", "--batch-size", "8", "--seq-len", "8"]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
  """``variant -> the example's result after one step from that checkpoint`` (run once)."""
  cache = {}

  def get(variant):
    if variant not in cache:
      out = tmp_path_factory.mktemp(variant) / "out"
      cache[variant] = EX.main(["--checkpoint", str(DATA / variant), *ONE_STEP, "--out",
                                str(out)])
    return cache[variant]
  return get


@pytest.mark.parametrize("variant", ["tied", "bf16"])
def test_an_export_after_a_step_has_the_originals_names_shapes_and_dtypes(variant, one_step):
  result = one_step(variant)
  out = pathlib.Path(result["out"])
  before, after = (header(d / "model.safetensors") for d in (DATA / variant, out))
  strip = lambda h: {k: (e["dtype"], e["shape"]) for k, e in h.items() if k != "__metadata__"}
  assert strip(after) == strip(before)
  assert after["__metadata__"] == before["__metadata__"] == {"format": "pt"}
  for copied in ("config.json", "generation_config.json"):
    assert json.loads((out / copied).read_text()) == \
        json.loads((DATA / variant / copied).read_text())
  old, new = (load_file(d / "model.safetensors") for d in (DATA / variant, out))
  assert not all(np.array_equal(old[k], new[k]) for k in old)  # trained
  assert result["files"] == ["model.safetensors"]


# --------------------------------------------------------------- the logit flags
def test_check_logits_exits_with_status_1_beyond_the_tolerance(tmp_path, capsys):
  ref = np.load(DATA / "llama2" / "logits.npy")
  np.save(tmp_path / "ref.npy", ref + 2e-4)
  with pytest.raises(SystemExit) as e:
    EX.main(["--checkpoint", str(DATA / "llama2"), "--check-logits",
             str(DATA / "llama2" / "tokens.npy"), str(tmp_path / "ref.npy")])
  assert e.value.code == 1
  assert "logits FAILED: largest absolute difference 0.0002" in capsys.readouterr().out
  result = EX.main(["--checkpoint", str(DATA / "llama2"), "--atol", "1e-3", "--check-logits",
                    str(DATA / "llama2" / "tokens.npy"), str(tmp_path / "ref.npy")])
  assert 1e-4 < result["max_abs_diff"] < 1e-3


def test_logits_out_writes_the_float32_logits_of_the_tokens(tmp_path):
  out = tmp_path / "logits.npy"
  result = EX.main(["--checkpoint", str(DATA / "qwen2"), "--tokens",
                    str(DATA / "qwen2" / "tokens.npy"), "--logits-out", str(out)])
  logits = np.load(out)
  assert logits.dtype == np.float32 and logits.shape == (2, 12, 96)
  np.testing.assert_array_equal(logits, result["logits"])
  np.testing.assert_allclose(logits, np.load(DATA / "qwen2" / "logits.npy"), atol=1e-4)


@pytest.mark.parametrize("tokens, message", [
    (np.zeros((2, 3), np.float32), "integer array"), (np.zeros(4, np.int32), r"\[batch, seq\]"),
    (np.full((1, 2), 96, np.int32), r"in \[0, 96\)")])
def test_bad_token_ids_are_refused_naming_what_is_expected(tmp_path, tokens, message):
  np.save(tmp_path / "t.npy", tokens)
  with pytest.raises(SystemExit, match=message):
    EX.main(["--checkpoint", str(DATA / "qwen2"), "--tokens", str(tmp_path / "t.npy"),
             "--logits-out", str(tmp_path / "o.npy")])


# --------------------------------------------------------------- config.json
LLAMA31_V4 = {  # Meta-Llama-3.1-8B's config.json as transformers 4.x wrote it
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192,
                                            "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}


def test_a_transformers_4_llama31_config_is_read_field_by_field():
  cfg = C.from_hf(LLAMA31_V4)
  assert cfg.rope == C.Rope(500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
  assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rms_norm_eps) == (128, 8, 1e-5)
  assert not (cfg.tie_word_embeddings or cfg.attention_bias or cfg.mlp_bias or cfg.qkv_bias)
  assert C.from_hf(C.LlamaConfig().to_hf()) == C.LlamaConfig()
  assert C.from_hf({**LLAMA31_V4, "rope_scaling": None}).rope == C.Rope(500000.0)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not one"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "causal language model"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not impl"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type 'linear' is not impl"),
    ({"rope_theta": None}, "rope_theta"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs.*low_freq_factor"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}, "rope_scaling": None,
      "rope_theta": None}, "rope_type 'dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     "both rope_parameters .* and rope_scaling .* disagree"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not implemented"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"layer_types": ["sliding_attention"] * 32}, "sliding_attention"),
    ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
    ({"rms_norm_eps": None}, "no 'rms_norm_eps'"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' is 'yes'; expected true or false"),
    ({"head_dim": 7}, "head_dim 7 is odd"),
])
def test_a_config_field_this_model_does_not_implement_is_refused_by_name(change, message):
  raw = {k: v for k, v in {**LLAMA31_V4, **change}.items() if v is not None}
  with pytest.raises(C.ConfigError, match=message):
    C.from_hf(raw)


def test_qwen2_reads_as_llama_with_qkv_biases_and_refuses_sliding_windows():
  raw = json.loads((DATA / "qwen2" / "config.json").read_text())
  cfg = C.from_hf(raw)
  assert cfg.qkv_bias and not cfg.attention_bias and cfg.model_type == "qwen2"
  assert "model.layers.0.self_attn.q_proj.bias" in hf_shapes(cfg)
  assert "model.layers.0.self_attn.o_proj.bias" not in hf_shapes(cfg)
  with pytest.raises(C.ConfigError, match="use_sliding_window=True"):
    C.from_hf({**raw, "use_sliding_window": True})


def _damage(directory: pathlib.Path, case: str) -> pathlib.Path:
  """The file of ``directory`` (a copy of a checkpoint) that ``case`` damages, damaged."""
  model, config = directory / "model.safetensors", directory / "config.json"
  src = model.read_bytes()
  n = int.from_bytes(src[:8], "little")
  raw = json.loads(config.read_text())
  damaged = {
      "four_bytes": (model, src[:4]),
      "header_cut": (model, src[:8 + n // 2]),
      "length_past_the_end": (model, (2 * len(src)).to_bytes(8, "little") + src[8:]),
      "length_2_to_the_40": (model, (2**40).to_bytes(8, "little") + src[8:]),
      "not_utf8": (model, src[:8] + b"\xff" + src[9:]),
      "dtype_label": (model, src[:8 + n].replace(b'"F32"', b'"F16"', 1) + src[8 + n:]),
      "config_missing": (config, None),
      "config_not_json": (config, b"{not json"),
      "config_model_type": (config, json.dumps({**raw, "model_type": "gemma"}).encode()),
      "config_no_eps": (config, json.dumps({k: v for k, v in raw.items()
                                            if k != "rms_norm_eps"}).encode()),
  }
  path, data = damaged[case]
  if data is None:
    path.unlink()
  else:
    path.write_bytes(data)
  return path


DAMAGE = {"four_bytes": "fewer than the 8-byte header length",
          "header_cut": "header length says \\d+ bytes, and the file has \\d+ after it",
          "length_past_the_end": "header length says \\d+ bytes, and the file has",
          "length_2_to_the_40": "header length says 1099511627776 bytes",
          "not_utf8": "its header is not JSON \\('utf-8' codec",
          "dtype_label": "tensor '[^']+' has data_offsets \\[\\d+, \\d+\\], which do not hold",
          "config_missing": "does not exist: a Hugging Face checkpoint directory holds",
          "config_not_json": "is not JSON \\(Expecting property name",
          "config_model_type": "model_type 'gemma' is not one this example implements",
          "config_no_eps": "has no 'rms_norm_eps'; a llama config needs it"}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_stops_the_example_with_one_message_naming_the_file(case,
                                                                               tmp_path):
  """Each damaged file (a 4-byte file, a header cut short, a header length past the end or of
  2**40, a header that is not UTF-8, a dtype label that does not fit the bytes, config.json
  missing, not JSON or refused) stops the example with one message naming that file, and
  names it once (no "config.json: config.json:")."""
  shutil.copytree(DATA / "llama2", tmp_path / "c")
  path = _damage(tmp_path / "c", case)
  with pytest.raises(SystemExit) as info:
    EX.main(["--checkpoint", str(tmp_path / "c"), "--steps", "0", "--out", str(tmp_path / "o")])
  message = str(info.value.code)
  assert re.match(rf"{re.escape(str(path))}:? .*{DAMAGE[case]}", message), message
  assert "\n" not in message and message.count(str(path)) == 1
  assert "config.json: config.json" not in message
  assert not (tmp_path / "o").exists()


def test_a_damaged_file_prints_its_message_without_a_traceback(tmp_path):
  shutil.copytree(DATA / "llama2", tmp_path / "c")
  path = _damage(tmp_path / "c", "length_2_to_the_40")
  proc = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_llama.py"),
                         "--checkpoint", str(tmp_path / "c"), "--steps", "0"],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.startswith(f"{path} is not a complete safetensors file: its header length "
                                f"says 1099511627776 bytes"), proc.stderr


def test_a_tied_checkpoint_that_also_stores_lm_head_loads_as_transformers_loads_it(tmp_path,
                                                                                   capsys):
  """transformers ignores the lm_head.weight a tied checkpoint stores (the head is the
  embedding): so does the example, saying so; the logits are transformers', and the export
  is the tied file transformers wrote."""
  from safetensors.numpy import save_file
  shutil.copytree(DATA / "tied", tmp_path / "c")
  weights = load_file(DATA / "tied" / "model.safetensors")
  assert "lm_head.weight" not in weights
  save_file({**weights, "lm_head.weight": np.ones_like(weights["model.embed_tokens.weight"])},
            str(tmp_path / "c" / "model.safetensors"), metadata={"format": "pt"})
  result = check(tmp_path / "c", ref=DATA / "tied" / "logits.npy")
  assert result["max_abs_diff"] < 1e-4
  assert "lm_head.weight is not read: tie_word_embeddings" in capsys.readouterr().out
  EX.main(["--checkpoint", str(tmp_path / "c"), "--steps", "0", "--out", str(tmp_path / "o")])
  assert (tmp_path / "o" / "model.safetensors").read_bytes() == \
      (DATA / "tied" / "model.safetensors").read_bytes()
  # Another unexpected tensor beside it is still refused, by name.
  save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"],
             "model.extra": np.ones(3, np.float32)}, str(tmp_path / "c" / "model.safetensors"))
  with pytest.raises(SystemExit, match=r"holds 2 tensor\(s\) that no leaf of `like` reads: "
                                       r"'lm_head.weight', 'model.extra'"):
    EX.main(["--checkpoint", str(tmp_path / "c"), "--steps", "0"])


def _shard(src: pathlib.Path, dst: pathlib.Path, n: int) -> dict:
  """A copy of the checkpoint ``src`` with its tensors in ``n`` files and an index, as
  transformers writes a large model; returns the tensors."""
  from safetensors.numpy import save_file
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
  weights = load_file(src / "model.safetensors")
  names = sorted(weights)
  files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  weight_map = {k: files[i * n // len(names)] for i, k in enumerate(names)}
  for f in files:
    save_file({k: weights[k] for k in names if weight_map[k] == f}, str(dst / f),
              metadata={"format": "pt"})
  (dst / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
       "weight_map": weight_map}))
  return weights


def test_a_sharded_checkpoint_is_exported_sharded_unless_told_otherwise(tmp_path):
  """A checkpoint in 3 files and an index comes out in as many files of at most its largest
  file's size, with an index, holding the same tensors (0 steps: the same bytes);
  --max-shard-size 1GB writes one file; --max-shard-size 4KB more files (none bigger than
  4KB but for a tensor larger than that, alone in its file: 96 x 32 float32)."""
  weights = _shard(DATA / "llama2", tmp_path / "c", 3)
  data_bytes = lambda path: sum(v.nbytes for v in load_file(path).values())
  biggest = max(data_bytes(tmp_path / "c" / f) for f in os.listdir(tmp_path / "c")
                if f.endswith(".safetensors"))
  for flags, files in (([], 3), (["--max-shard-size", "1GB"], 1),
                       (["--max-shard-size", "4KB"], None)):
    out = tmp_path / f"o{len(flags)}{files}"
    result = EX.main(["--checkpoint", str(tmp_path / "c"), "--steps", "0", "--out", str(out),
                      *flags])
    written = [f for f in result["files"] if f.endswith(".safetensors")]
    if files == 1:
      assert result["files"] == ["model.safetensors"]
    else:
      assert result["files"][-1] == "model.safetensors.index.json"
      assert len(written) == files if files else len(written) > 3
      assert all(data_bytes(out / f) <= (biggest if files else 12288) for f in written)
    got = {}
    for f in written:
      got.update(load_file(out / f))
    assert sorted(got) == sorted(weights)
    for k, v in weights.items():
      assert got[k].tobytes() == v.tobytes(), k
  with pytest.raises(SystemExit):
    EX.parse_args(["--max-shard-size", "lots"])
  assert EX.parse_size("5GB") == 5 * 10**9 and EX.parse_size("2GiB") == 2 << 30


def test_an_unreadable_config_stops_the_example_with_its_message(tmp_path):
  shutil.copytree(DATA / "qwen2", tmp_path / "c")
  raw = json.loads((tmp_path / "c" / "config.json").read_text())
  (tmp_path / "c" / "config.json").write_text(json.dumps({**raw, "model_type": "gemma"}))
  with pytest.raises(SystemExit, match="config.json: model_type 'gemma'"):
    EX.main(["--checkpoint", str(tmp_path / "c"), "--steps", "0"])


# --------------------------------------------------------------- fine-tuning a random checkpoint
def test_the_nnx_llama_gives_hugging_faces_logits_and_loads_split(run):
  cfg = run["config"]
  weights = load_file(pathlib.Path(run["checkpoint"]) / "model.safetensors")
  tokens = next(EX.text_batches(2, SEQ, cfg.vocab_size, seed=5))
  ref = numpy_llama(cfg, weights, tokens)
  forward, params, _, _ = plain_model(cfg, weights)
  np.testing.assert_allclose(np.asarray(forward(params, tokens)), ref, rtol=1e-4, atol=1e-4)
  abstract = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
  loaded = zj.load_safetensors(run["checkpoint"], abstract, step=run["step"], rename=hf_name)
  mine = jax.tree.leaves(nnx.state(loaded, nnx.Param))
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], mine):
    assert b.sharding.spec != jax.sharding.PartitionSpec(*[None] * b.ndim), path  # split
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=str(path))


@pytest.fixture(scope="module")
def reference(run):
  """The run of ``run`` with plain optax on one device: ``(forward, [params after k steps],
  [losses], graphdef, rest)``."""
  cfg = run["config"]
  forward, params, graphdef, rest = plain_model(
      cfg, load_file(pathlib.Path(run["checkpoint"]) / "model.safetensors"))
  opt = optax.adamw(1e-3)

  @jax.jit
  def update(params, opt_state, batch):
    loss, g = jax.value_and_grad(lambda p: EX.loss_fn(nnx.merge(graphdef, p, rest), batch))(params)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses, trajectory = opt.init(params), [], [params]
  batches = EX.text_batches(BATCH, SEQ, cfg.vocab_size)
  for _ in range(STEPS):
    params, opt_state, loss = update(params, opt_state, next(batches))
    losses.append(float(loss))
    trajectory.append(params)
  return forward, trajectory, losses, graphdef, rest


def test_fine_tuning_from_the_checkpoint_matches_plain_optax_on_one_device(run, reference):
  _, trajectory, losses, _, _ = reference
  np.testing.assert_allclose(run["losses"], losses, rtol=1e-5)
  assert losses[-1] < losses[0]
  mine = run["step"].get_params(run["state"])
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(trajectory[-1])[0],
                          jax.tree.leaves(mine)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


def test_the_held_out_loss_is_step_evaluate_of_the_parameters_of_that_step(run, reference):
  """``--eval-every 2`` over 3 steps: the held-out loss before training, after step 2 and
  after the last, each the single-device loss of the plain run's parameters of that step on
  the same held-out batches (never trained on: another file's bytes). Tolerance: the loss
  is a float32 mean of 2 x 8 x 16 = 256 positive cross-entropies, whose sum in any order is
  within (n - 1) u = 255 * 2**-24 = 1.5e-5 of the exact one, relatively; the parameters
  after k steps agree to the training test's tolerance, which moves a loss near 2-6 by less
  than that (the training losses, a function of the same parameters, agree to 1e-5)."""
  _, trajectory, _, graphdef, rest = reference
  cfg = run["config"]
  held = EX.text_batches(BATCH, SEQ, cfg.vocab_size, seed=1, source=EX.HELD_OUT)
  held = [next(held) for _ in range(2)]
  assert sorted(run["eval_losses"]) == [0, EVAL_EVERY, STEPS]
  loss = jax.jit(lambda p, b: EX.loss_fn(nnx.merge(graphdef, p, rest), b))
  for k, got in run["eval_losses"].items():
    want = np.mean([float(loss(trajectory[k], b)) for b in held])
    np.testing.assert_allclose(got, want, rtol=2e-5, err_msg=f"step {k}")
  assert run["eval_losses"][STEPS] < run["eval_losses"][0]  # it learns what generalizes


def test_sample_is_the_greedy_continuation_of_the_trained_model(run, reference):
  """``--sample 4``: the tokens that the plain model (the reference's final parameters)
  picks greedily after the first 16 held-out tokens. Where the two best logits of a position
  are further apart than twice the logits' difference (below 1e-4, the logit checks'
  tolerance), argmax is the same in both: the test asserts the margin too."""
  forward, trajectory, _, _, _ = reference
  cfg = run["config"]
  window = list(EX.text_tokens(cfg.vocab_size, EX.HELD_OUT)[:EX.PROMPT])
  assert len(run["sampled"]) == SAMPLE
  for token in run["sampled"]:
    logits = np.asarray(forward(trajectory[-1], np.asarray([window])))[0, -1]
    top2 = np.sort(logits)[-2:]
    assert top2[1] - top2[0] > 2e-4
    assert token == int(np.argmax(logits))
    window.append(token)


def test_remat_and_prefetch_train_to_the_same_numbers(run, tmp_path, monkeypatch):
  """--remat full recomputes each layer and --prefetch 0 gathers it in its own iteration:
  they reach zj.scan, and give the same losses (a recomputed value is the value kept; the
  gradients are reduced over the same devices, in another iteration of the loop)."""
  seen, scan = [], zj.scan

  def recording_scan(*args, **kw):
    seen.append((kw["prefetch"], kw["policy"]))
    return scan(*args, **kw)
  monkeypatch.setattr(zj, "scan", recording_scan)
  other = EX.main([*RUN, "--remat", "full", "--prefetch", "0", "--eval-every", "0",
                   "--sample", "0", "--out", str(tmp_path / "o")])
  assert seen and set(seen) == {(0, jax.checkpoint_policies.nothing_saveable)}
  np.testing.assert_allclose(other["losses"], run["losses"], rtol=1e-6)
  assert other["eval_losses"] == {} and other["sampled"] == []


def test_the_header_names_the_model_devices_stage_and_options(capsys):
  check(DATA / "qwen2", "--remat", "dots")
  out = capsys.readouterr().out
  cfg = C.LlamaConfig.from_json(DATA / "qwen2" / "config.json")
  assert re.search(rf"^model: qwen2, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                   rf"intermediate {cfg.intermediate_size}, .* vocab 96, .*; [\d,]+ parameters$",
                   out, re.M), out
  assert f"checkpoint: {DATA / 'qwen2'} (F32, 1 file)" in out
  assert re.search(r"^devices: 8 x cpu \(cpu\), 1 process; ZeRO-3, precision fp32, layers "
                   r"stacked \(zj.scan: prefetch 1, remat dots\); global batch 16 x 64 tokens$",
                   out, re.M), out


def test_the_export_is_the_trained_params_under_hugging_faces_names(run):
  out = pathlib.Path(run["out"])
  assert run["files"] == ["model.safetensors"]
  assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
  got = load_file(out / "model.safetensors")
  assert {k: v.shape for k, v in got.items()} == hf_shapes(run["config"])
  params = run["step"].get_params(run["state"])
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    names, stacked = per_layer(run["config"], path)
    x = np.asarray(x)
    layers = list(x) if stacked else [x]  # a stacked leaf: one tensor per layer
    for (name, transpose), y in zip(names, layers, strict=True):
      assert got[name].tobytes() == np.ascontiguousarray(y.T if transpose else y).tobytes(), name


# --------------------------------------------------------------- several processes
def test_two_processes_train_as_one_and_export_the_bytes_one_process_exports(tmp_path,
                                                                              one_step):
  """2 processes x 4 devices under zj.launch_local, each feeding its own rows of every
  batch, make the step 1 process x 8 devices makes (the same loss; parameters equal up to
  the order of the gradient sums), and export the bytes 1 process exports of the same
  parameters."""
  two = tmp_path / "two"
  rc = zj.launch_local([sys.executable, str(ROOT / "examples" / "finetune_llama.py"),
                        "--checkpoint", str(DATA / "tied"), *ONE_STEP, "--out", str(two)],
                       num_processes=2, devices_per_process=4, log_dir=str(tmp_path / "logs"))
  logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").iterdir()))
  assert rc == 0, logs
  one = one_step("tied")
  assert f"step    0  loss {one['losses'][0]:.4f}" in logs
  a, b = (load_file(pathlib.Path(d) / "model.safetensors") for d in (one["out"], two))
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
  EX.main(["--checkpoint", str(two), "--steps", "0", "--out", str(tmp_path / "again")])
  assert (tmp_path / "again" / "model.safetensors").read_bytes() == \
      (two / "model.safetensors").read_bytes()


def test_several_processes_need_a_shared_out_directory(tmp_path):
  rc = zj.launch_local([sys.executable, str(ROOT / "examples" / "finetune_llama.py"),
                        "--steps", "0"], num_processes=2, devices_per_process=1,
                       log_dir=str(tmp_path))
  assert rc != 0
  assert "pass --out" in (tmp_path / "process_0.log").read_text()


def test_the_example_runs_as_a_user_runs_it(tmp_path):
  proc = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_llama.py"),
                         "--checkpoint", str(DATA / "bf16"), "--check-logits",
                         str(DATA / "bf16" / "tokens.npy"), str(DATA / "bf16" / "logits.npy")],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "logits ok: largest absolute difference" in proc.stdout
