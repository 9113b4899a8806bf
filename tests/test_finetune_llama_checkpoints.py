"""examples/finetune_llama.py on checkpoints as older transformers versions wrote them.

The files are written here with ``safetensors.numpy`` from tests/data/hf's checkpoints (which
transformers itself saved), the way the older versions laid them out.
"""

import pathlib
import re
import shutil
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import finetune_llama as EX  # noqa: E402

DATA = ROOT / "tests" / "data" / "hf"


def inv_freq(head_dim: int, theta: float = 10000.0) -> np.ndarray:
  return (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)


@pytest.mark.parametrize("variant", ["llama2", "tied"])
def test_rotary_inv_freq_tensors_of_older_checkpoints_are_left_unread_as_transformers_does(
    variant, tmp_path, capsys):
  """transformers before 4.31 stored each layer's ``rotary_emb.inv_freq`` buffer, and
  ``from_pretrained`` ignores it (the frequencies come from config.json): so does the example,
  saying so; the logits are transformers', and the export is the file transformers writes
  now. A tied checkpoint that also stores ``lm_head.weight`` is read the same way."""
  c = tmp_path / "c"
  shutil.copytree(DATA / variant, c)
  weights = load_file(DATA / variant / "model.safetensors")
  old = {**weights, **{f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq(8)
                       for i in range(2)}}
  if variant == "tied":
    old["lm_head.weight"] = weights["model.embed_tokens.weight"]
  save_file(old, str(c / "model.safetensors"), metadata={"format": "pt"})
  result = EX.main(["--checkpoint", str(c), "--check-logits", str(c / "tokens.npy"),
                    str(c / "logits.npy")])
  assert result["max_abs_diff"] < 1e-4
  out = capsys.readouterr().out
  assert "2 rotary_emb.inv_freq tensor(s) are not read: the rotary frequencies come from " \
         "config.json (transformers ignores them too)" in out
  assert ("lm_head.weight is not read" in out) == (variant == "tied")
  EX.main(["--checkpoint", str(c), "--steps", "0", "--out", str(tmp_path / "o")])
  assert (tmp_path / "o" / "model.safetensors").read_bytes() == \
      (DATA / variant / "model.safetensors").read_bytes()


def test_an_unknown_tensor_beside_inv_freq_is_still_refused_by_name(tmp_path):
  c = tmp_path / "c"
  shutil.copytree(DATA / "llama2", c)
  weights = load_file(DATA / "llama2" / "model.safetensors")
  save_file({**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq(8),
             "model.extra": np.ones(3, np.float32)}, str(c / "model.safetensors"))
  with pytest.raises(SystemExit, match=r"holds 2 tensor\(s\) that no leaf of `like` reads: "
                                       r"'model.extra', 'model.layers.0.self_attn.rotary_emb"
                                       r".inv_freq'"):
    EX.main(["--checkpoint", str(c), "--steps", "0"])


def test_the_tokenizers_files_are_copied_beside_the_export(tmp_path):
  """A Hub checkpoint comes with its tokenizer's files (what transformers' save_pretrained
  of a tokenizer writes: tokenizer.json, tokenizer_config.json, chat_template.jinja, and for
  older or slow tokenizers special_tokens_map.json, tokenizer.model, vocab.json, merges.txt):
  the export holds them too, so AutoTokenizer.from_pretrained loads it as the model does."""
  c = tmp_path / "c"
  shutil.copytree(DATA / "llama2", c)
  files = {"tokenizer.json": b'{"version": "1.0", "model": {"type": "WordLevel"}}',
           "tokenizer_config.json": b'{"tokenizer_class": "TokenizersBackend"}',
           "chat_template.jinja": b"{% for m in messages %}{{ m['content'] }}{% endfor %}",
           "special_tokens_map.json": b'{"unk_token": "<unk>"}', "tokenizer.model": b"\x0a\x01",
           "vocab.json": b'{"<unk>": 0}', "merges.txt": b"#version: 0.2\n"}
  for name, data in files.items():
    (c / name).write_bytes(data)
  (c / "pytorch_model.bin").write_bytes(b"stale weights")  # never copied
  result = EX.main(["--checkpoint", str(c), "--steps", "0", "--out", str(tmp_path / "o")])
  for name, data in files.items():
    assert (tmp_path / "o" / name).read_bytes() == data, name
  assert not (tmp_path / "o" / "pytorch_model.bin").exists()
  assert result["files"] == ["model.safetensors"]


def test_a_llama_2_config_without_rope_theta_reads_with_transformers_default_base(tmp_path):
  """Llama 2's own config.json (transformers 4.31) states no rope_theta (transformers 4.33
  added it), and transformers reads it with its default base, 10000: so does the example,
  with transformers' logits; a rope_theta written as null is still refused."""
  import json
  c = tmp_path / "c"
  shutil.copytree(DATA / "llama2", c)
  raw = json.loads((c / "config.json").read_text())
  assert raw["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
  old = {k: v for k, v in raw.items() if k not in ("rope_parameters", "dtype")}
  old.update(rope_scaling=None, torch_dtype="float32", transformers_version="4.31.0.dev0")
  (c / "config.json").write_text(json.dumps(old))
  result = EX.main(["--checkpoint", str(c), "--check-logits", str(c / "tokens.npy"),
                    str(c / "logits.npy")])
  assert result["max_abs_diff"] < 1e-4 and result["config"].rope.theta == 10000.0
  (c / "config.json").write_text(json.dumps({**old, "rope_theta": None}))
  with pytest.raises(SystemExit, match="config.json has no 'rope_theta'"):
    EX.main(["--checkpoint", str(c), "--steps", "0"])


def test_out_in_the_checkpoints_own_directory_is_refused_before_anything_is_read(tmp_path):
  """--out DIR with --checkpoint DIR exported over the checkpoint (14 shards replaced by 9)
  and then died copying config.json onto itself (shutil.SameFileError, a traceback). Now
  refused up front, the checkpoint untouched; the logit flags, which write no export, run."""
  c = tmp_path / "c"
  shutil.copytree(DATA / "llama2", c)
  before = {f.name: f.read_bytes() for f in c.iterdir()}
  for out in (c, tmp_path / "." / "c"):
    with pytest.raises(SystemExit, match=r"--out \S+ is the checkpoint's own directory: the "
                                         r"export would replace the checkpoint it reads"):
      EX.main(["--checkpoint", str(c), "--out", str(out), "--steps", "0"])
  assert {f.name: f.read_bytes() for f in c.iterdir()} == before
  result = EX.main(["--checkpoint", str(c), "--out", str(c), "--check-logits",
                    str(c / "tokens.npy"), str(c / "logits.npy")])
  assert result["max_abs_diff"] < 1e-4


def test_a_tensor_of_the_wrong_shape_is_named_before_any_talk_of_dtypes(tmp_path):
  """A bf16 checkpoint whose q_proj has the wrong shape, and float32 (as a tool without bf16
  would write it): the message names the tensor, the shape found and the shape config.json
  gives it, not the mix of dtypes that follows from it."""
  import ml_dtypes  # noqa: F401  (safetensors.numpy reads bf16 through it)
  shutil.copytree(DATA / "bf16", tmp_path / "c")
  weights = load_file(DATA / "bf16" / "model.safetensors")
  name = "model.layers.1.self_attn.q_proj.weight"
  good = weights[name].shape
  weights[name] = np.zeros((good[0], good[1] - 1), np.float32)
  save_file(weights, str(tmp_path / "c" / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(SystemExit) as e:
    EX.main(["--checkpoint", str(tmp_path / "c"), "--steps", "0", "--out", str(tmp_path / "o")])
  message = str(e.value.code)
  assert message.startswith(f"{tmp_path / 'c' / 'model.safetensors'}: tensor {name!r} has shape "
                            f"[{good[0]}, {good[1] - 1}] (F32); config.json "), message
  assert f"needs {list(good)}" in message and "dtype" not in message
  assert not (tmp_path / "o").exists()


def _index_to(tmp_path, entry: str) -> pathlib.Path:
  """tests/data/hf/llama2 as an index and one shard, the index naming the shard ``entry``."""
  import json
  c = tmp_path / "c"
  shutil.copytree(DATA / "llama2", c, ignore=shutil.ignore_patterns("model.safetensors"))
  names = load_file(DATA / "llama2" / "model.safetensors")
  (c / "model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {k: entry for k in names}}))
  return c


@pytest.mark.parametrize("case", ["dotdot", "absolute", "link"])
def test_an_index_naming_a_file_outside_its_folder_is_refused_naming_the_entry(case, tmp_path):
  """The shard is a valid copy of the checkpoint each time, so without the check each case
  loads and trains: ``../other/...``, an absolute path, and a link inside the folder that
  leads out of it are refused, naming the index, the tensor and the entry."""
  other = tmp_path / "other"
  other.mkdir()
  shutil.copy(DATA / "llama2" / "model.safetensors", other / "model-x.safetensors")
  entry = {"dotdot": "../other/model-x.safetensors",
           "absolute": str(other / "model-x.safetensors"),
           "link": "model-00001-of-00001.safetensors"}[case]
  c = _index_to(tmp_path, entry)
  if case == "link":
    (c / entry).symlink_to(other / "model-x.safetensors")
  why = {"dotdot": "a path through '..'", "absolute": "an absolute path",
         "link": "which is a symbolic link"}[case]
  with pytest.raises(SystemExit, match=rf"model.safetensors.index.json places tensor "
                                       rf"'[^']+' in '{re.escape(entry)}', {why}"):
    EX.main(["--checkpoint", str(c), "--steps", "0", "--out", str(tmp_path / "o")])
  assert not (tmp_path / "o").exists()
  # The same shard inside the folder loads.
  inside = _index_to(tmp_path / "ok", "model-00001-of-00001.safetensors")
  shutil.copy(other / "model-x.safetensors", inside / "model-00001-of-00001.safetensors")
  EX.main(["--checkpoint", str(inside), "--steps", "0", "--eval-every", "0", "--sample", "0",
           "--out", str(tmp_path / "o2")])


def test_plan_without_the_cuda_plugin_says_what_to_install():
  """--plan for Llama-3-8B's config.json (no weights): without JAX's CUDA plugin (this test's
  Python) the example stops with one message naming the plugin."""
  try:
    import jax_plugins.xla_cuda12  # noqa: F401
    pytest.skip("JAX's CUDA plugin is installed: --plan would compile Llama-3-8B")
  except ImportError:
    pass
  config = ROOT / "tests" / "data" / "hf_configs" / "llama3_8b"
  with pytest.raises(SystemExit) as e:
    EX.main(["--plan", "--config", str(config)])
  assert str(e.value.code).startswith("--plan: compiling for a GPU without one needs JAX's CUDA "
                                      "plugin"), e.value.code
  assert 'pip install "jax-cuda12-plugin==' in str(e.value.code)
