"""Fine-tune a Llama or Qwen2 checkpoint (Hugging Face safetensors) with ZeRO-3, and write it back.

The model (examples/llama/: config, NNX model, Hugging Face names) maps onto
Hugging Face's tensor names through one ``rename`` function (Flax kernels are ``(in,
out)``, PyTorch ``Linear`` weights ``(out, in)``: those are transposed). Every
``config.json`` field that changes the math is read, or refused by name: rope settings in
transformers 4.x (``rope_theta``, ``rope_scaling``) and 5.x (``rope_parameters``) form,
``rope_type`` ``default`` and ``llama3``, tied embeddings, attention and MLP biases,
``head_dim``, grouped-query attention, and ``model_type`` ``llama`` or ``qwen2``. The model is
never whole on a device or on the host:

* ``zj.load_safetensors`` traces the function that builds it (nothing is allocated) and
  reads each device's block of each tensor from the files (a bf16 or fp16 file converted
  to float32 on the way); ``step.init(..., donate=True)`` keeps those blocks as the state;
* its decoder blocks are stacked (``nnx.vmap``: every block variable has the layers first)
  and read straight into that layout from the checkpoint's per-layer tensors (``rename``
  returns ``model.layers.{i}.mlp.up_proj.weight``); the step is made with ``stacked=``, and
  ``zj.scan`` gathers one layer at a time, the next one while this one computes
  (``--prefetch``), keeping for the backward pass what ``--remat`` says; the embedding is
  marked ``lookup=`` and read with ``zj.take``: it stays split too, and only the rows the batch
  reads move;
* ZeRO-3 (``stage=3``) fine-tunes it on the bytes of a Python source file, each process
  feeding its own rows of every batch (``--precision bf16``: bf16 parameters, float32
  master copy); ``step.evaluate`` reports the loss on held-out bytes every
  ``--eval-every`` steps and ``step.apply`` samples a greedy continuation (``--sample``), both
  on the split state, one layer gathered at a time;
* ``zj.export_safetensors`` writes the result from the shards, in the layout and dtype it
  came in (one file, or as many as the checkpoint had: ``--max-shard-size``;
  ``config.json``, ``generation_config.json`` and the tokenizer's files copied along), ready
  for ``transformers``' ``from_pretrained``, under the checkpoint's own per-layer names.

Without ``--checkpoint`` a tiny random checkpoint in the Hugging Face layout is written
first (nothing is downloaded). A real one is a directory with ``config.json`` and
``model.safetensors`` (or shards and ``model.safetensors.index.json``); its tokens
would come from its tokenizer, here they are the file's bytes.

    python examples/finetune_llama.py                      # tiny random model, 20 steps
    python examples/finetune_llama.py --checkpoint DIR --out DIR2 --steps 100
    python examples/launch_local.py -n 2 -d 4 examples/finetune_llama.py --out DIR2

A conversion check (then exit, no fine-tuning): ``--tokens T.npy --logits-out O.npy``
writes the loaded model's float32 logits ``[batch, seq, vocab]`` for the token ids in
``T.npy`` (``[batch, seq]`` integers); ``--check-logits T.npy REF.npy`` compares them with
a reference (e.g. transformers' logits) and exits with status 1 when the largest absolute
difference passes ``--atol`` (default 1e-4 at ``--precision fp32``, 0.1 at bf16).

Before renting GPUs: ``--plan --config DIR_OR_CONFIG_JSON --gpu h100 --per-host 8`` compiles
the step for compile-only GPUs (JAX's CUDA plugin, no GPU and no weights needed) and prints
``zj.plan``'s table: which options fit and which runs fastest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/llama
from llama.config import ConfigError, LlamaConfig  # noqa: E402
from llama.hf_files import checkpoint_tensors, hf_name, hf_shapes, write_tiny_checkpoint  # noqa: E402
from llama.model import REMAT, build_model  # noqa: E402

READABLE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # lossless into float32
ATOL = {"fp32": 1e-4, "bf16": 1e-1}
# Copied beside the export when present: the config, and the tokenizer's files as
# transformers' save_pretrained writes them (so that AutoTokenizer loads the export too).
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
          "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


def text_tokens(vocab: int, source: str | None = None) -> np.ndarray:
  """The bytes of a Python source file (``json/decoder.py``; held out: ``json/encoder.py``)
  as token ids below ``vocab``."""
  with open(source or json.decoder.__file__, "rb") as f:
    data = np.frombuffer(f.read(), np.uint8).astype(np.int32)
  return data % vocab


HELD_OUT = json.encoder.__file__  # never trained on


def text_batches(batch_size: int, seq_len: int, vocab: int, seed: int = 0,
                 source: str | None = None):
  """Windows of ``seq_len + 1`` tokens of `text_tokens`, forever."""
  data = text_tokens(vocab, source)
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
    yield np.stack([data[s:s + seq_len + 1] for s in starts])


def loss_fn(model, tokens, **scan):
  """Next-token cross-entropy; ``scan``: ``zj.scan``'s ``prefetch=`` and ``policy=`` in
  place of the model's (what ``zj.plan`` searches)."""
  import optax
  logits = model(tokens[:, :-1], **scan)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype("float32"), tokens[:, 1:]).mean()


def logits_fn(model, tokens):
  """``step.apply``'s function for ``--check-logits``: float32 logits ``[batch, seq, vocab]``."""
  import jax.numpy as jnp
  return model(tokens).astype(jnp.float32)


def next_token_fn(model, window, length):
  """``step.apply``'s function for ``--sample``: the greedy next token after the first
  ``length`` tokens of ``window`` ``[1, n]`` (the rest is padding the causal mask ignores)."""
  import jax.numpy as jnp
  return jnp.argmax(model(window)[0, length - 1]).astype(jnp.int32)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--checkpoint", help="a Hugging Face Llama or Qwen2 directory: config.json "
                                      "and model.safetensors, or shards and their index "
                                      "(default: a tiny random one, written first)")
  p.add_argument("--out", help="where to export, not the checkpoint's own directory (default: "
                               "a temporary directory; the tiny checkpoint is written beside "
                               "it). Required with several processes: a directory they share")
  p.add_argument("--steps", type=int, default=20,
                 help="fine-tuning steps; 0 loads and exports only (default: %(default)s)")
  p.add_argument("--batch-size", type=int, default=16,
                 help="global batch size, in sequences (default: %(default)s)")
  p.add_argument("--seq-len", type=int, default=64,
                 help="tokens per sequence (default: %(default)s)")
  p.add_argument("--lr", type=float, default=1e-3,
                 help="learning rate of AdamW (default: %(default)s)")
  p.add_argument("--precision", choices=sorted(ATOL), default="fp32",
                 help="fp32, or bf16: bf16 parameters and a float32 master copy "
                      "(default: %(default)s)")
  p.add_argument("--export-dtype", choices=["checkpoint", "float32", "bfloat16", "float16"],
                 default="checkpoint", help="dtype of the exported tensors; checkpoint: the "
                                            "checkpoint's own (default: %(default)s)")
  p.add_argument("--max-shard-size", default="checkpoint",
                 help="split the export into files of at most this size, as transformers' "
                      "max_shard_size (5GB, 500MB, 2GiB, or bytes); checkpoint: as the "
                      "checkpoint is split, one file for one file (default: %(default)s)")
  p.add_argument("--tokens", help="token ids [batch, seq] (.npy) for --logits-out")
  p.add_argument("--logits-out", help="write the loaded model's float32 logits for --tokens "
                                      "here (.npy), then exit")
  p.add_argument("--check-logits", nargs=2, metavar=("TOKENS", "REF"),
                 help="compare the loaded model's logits for TOKENS with REF (.npy files), "
                      "then exit; status 1 beyond --atol")
  p.add_argument("--atol", type=float, help="largest absolute logit difference --check-logits "
                                            "accepts (default: 1e-4 at fp32, 0.1 at bf16)")
  p.add_argument("--prefetch", type=int, choices=[0, 1], default=1,
                 help="zj.scan's prefetch: 1 gathers the next layer while this one computes "
                      "(and reduces a layer's gradient one layer later), 0 one layer at a time "
                      "(default: %(default)s)")
  p.add_argument("--remat", choices=REMAT, default="none",
                 help="what each layer keeps for the backward pass (zj.scan's policy): none "
                      "keeps what lax.scan keeps, dots the matmuls' outputs "
                      "(jax.checkpoint_policies.dots_with_no_batch_dims_saveable), full only "
                      "the layer's input (nothing_saveable) (default: %(default)s)")
  p.add_argument("--eval-every", type=int, default=10,
                 help="report the loss on held-out bytes (step.evaluate, no update) before "
                      "training, every this many steps and after the last; 0: never "
                      "(default: %(default)s)")
  p.add_argument("--eval-batches", type=int, default=2,
                 help="held-out batches of --batch-size x --seq-len per evaluation "
                      "(default: %(default)s)")
  p.add_argument("--sample", type=int, default=8, metavar="N",
                 help="after fine-tuning, print N tokens greedily continuing the first 16 "
                      "held-out tokens (step.apply, on the split state); 0: none "
                      "(default: %(default)s)")
  p.add_argument("--devices", type=int, default=8,
                 help="fake CPU devices to use when the machine has only one device "
                      "(default: %(default)s)")
  p.add_argument("--plan", action="store_true",
                 help="print zj.plan's table for this model on --hosts x --per-host --gpu "
                      "GPUs (compile-only: JAX's CUDA plugin, no GPU, no weights), then exit")
  p.add_argument("--config", help="with --plan: a config.json, or a directory holding one "
                                  "(default: --checkpoint's, or the tiny model's)")
  p.add_argument("--gpu", default="h100", help="with --plan: the GPU to plan for "
                                               "(h100, h200, a100; default: %(default)s)")
  p.add_argument("--hosts", type=int, default=1, help="with --plan: hosts (default: %(default)s)")
  p.add_argument("--per-host", type=int, default=8,
                 help="with --plan: GPUs per host (default: %(default)s)")
  p.add_argument("--max-compiles", type=int, default=2,
                 help="with --plan: how many candidates to compile, the fastest predicted "
                      "(default: %(default)s)")
  args = p.parse_args(argv)
  for flag in ("eval_every", "eval_batches", "sample"):
    if getattr(args, flag) < 0:
      p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give 0 or more.")
  if args.config and not args.plan:
    p.error("--config is for --plan (training reads --checkpoint's config.json).")
  if args.logits_out and not args.tokens or args.tokens and not args.logits_out:
    p.error("--tokens and --logits-out go together")
  if args.max_shard_size != "checkpoint" and parse_size(args.max_shard_size) is None:
    p.error(f"--max-shard-size {args.max_shard_size}: give a size such as 5GB, 500MB or "
            f"2GiB, a number of bytes, or checkpoint")
  return args


SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int | None:
  """Bytes of a size as transformers writes it (``5GB``: 5 * 10**9; ``2GiB``: 2 * 2**30), or
  None when ``text`` is not one."""
  text = text.strip().upper()
  number = text.rstrip("KMGTIB")
  try:
    value = float(number) * SIZE_UNITS[text[len(number):].strip()]
  except (KeyError, ValueError):
    return None
  return int(value) if value >= 1 else None


def max_shard_bytes(choice: str, tensors: dict, dtype) -> int:
  """The export's ``max_shard_bytes``: ``choice``'s size, or for ``checkpoint`` the largest of
  the checkpoint's files (its tensors in the export's dtype): as many files as it has (one
  for one), give or take the order the tensors are written in."""
  size = parse_size(choice)
  if size is not None:
    return size
  per_file: dict = {}
  for _, shape, path in tensors.values():
    per_file[path] = per_file.get(path, 0) + int(np.prod(shape)) * np.dtype(dtype).itemsize
  return max(per_file.values()) if len(per_file) > 1 else sum(per_file.values()) + 1


def export_dtype(choice: str, codes: set[str]):
  """The dtype to export in: ``choice``, or the checkpoint's one floating dtype."""
  if choice != "checkpoint":
    return choice
  if len(codes) != 1:
    raise SystemExit(f"the checkpoint's tensors have several dtypes ({sorted(codes)}); pass "
                     f"--export-dtype float32, bfloat16 or float16.")
  return READABLE[next(iter(codes))]


def load_tokens(path: str, vocab: int) -> np.ndarray:
  tokens = np.load(path)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise SystemExit(f"{path}: token ids must be a [batch, seq] integer array, got "
                     f"{tokens.dtype} {tokens.shape}.")
  if tokens.size and not 0 <= tokens.min() <= tokens.max() < vocab:
    raise SystemExit(f"{path}: token ids must lie in [0, {vocab}) (vocab_size), got "
                     f"[{tokens.min()}, {tokens.max()}].")
  return tokens.astype(np.int32)


def replicated_ids(mesh, tokens: np.ndarray):
  """``tokens`` as one array every device holds whole (every process passes the same)."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P
  return jax.make_array_from_callback(tokens.shape, NamedSharding(mesh, P()),
                                      lambda i: tokens[i])


def to_host(x) -> np.ndarray:
  """A result of ``step.apply`` on every process's host, whole."""
  from jax.experimental import multihost_utils
  return np.asarray(x if x.is_fully_addressable else
                    multihost_utils.process_allgather(x, tiled=True))


def logits_check(args, step, state, mesh, cfg) -> dict:
  """``--logits-out`` / ``--check-logits``: the logits ``step.apply`` computes on the split
  state (one layer gathered at a time, in the step's precision); writes or compares, on
  process 0."""
  import zero_jax as zj
  tokens_path = args.tokens or args.check_logits[0]
  tokens = load_tokens(tokens_path, cfg.vocab_size)
  logits = to_host(step.apply(state, logits_fn, replicated_ids(mesh, tokens)))
  out: dict = {"logits": logits}
  if args.logits_out and zj.is_main_process():
    np.save(args.logits_out, logits)
    zj.print_main(f"wrote logits {logits.shape} float32 to {args.logits_out}")
  if args.check_logits:
    ref = np.load(args.check_logits[1])
    if ref.shape != logits.shape:
      raise SystemExit(f"{args.check_logits[1]} has shape {ref.shape}; the logits for "
                       f"{tokens_path} have {logits.shape} ([batch, seq, vocab]).")
    atol = ATOL[args.precision] if args.atol is None else args.atol
    diff = float(np.max(np.abs(logits - ref.astype(np.float32)))) if ref.size else 0.0
    out["max_abs_diff"] = diff
    verdict = "ok" if diff <= atol else "FAILED"
    zj.print_main(f"logits {verdict}: largest absolute difference {diff:.3g} "
                  f"(tolerance {atol:g}) over {logits.size} values")
    if diff > atol:
      raise SystemExit(1)
  return out


def held_out_loss(step, state, batches) -> float:
  """The mean of ``step.evaluate``'s loss over ``batches`` (no gradient, no update)."""
  import zero_jax as zj
  return float(np.mean([zj.metrics_to_host(step.evaluate(state, b))["loss"] for b in batches]))


PROMPT = 16  # held-out tokens --sample continues


def sample(step, state, mesh, prompt: np.ndarray, n: int) -> list[int]:
  """``n`` tokens greedily continuing ``prompt``, each from one ``step.apply`` over a window
  of ``len(prompt) + n`` tokens (compiled once: the length is an argument)."""
  window = np.zeros((1, len(prompt) + n), np.int32)
  window[0, :len(prompt)] = prompt
  for k in range(len(prompt), len(prompt) + n):
    window[0, k] = int(to_host(step.apply(state, next_token_fn, replicated_ids(mesh, window),
                                          replicated_ids(mesh, np.asarray(k, np.int32)))))
  return window[0, len(prompt):].tolist()


def start_jax(devices: int):
  """Joins a multi-process job when `zj.launch_local` (or a cluster) started this process;
  otherwise asks the CPU backend for ``devices`` devices."""
  import jax
  from zero_jax.processes import distributed
  if os.environ.get(distributed.ENV_NUM_PROCESSES) or os.environ.get("SLURM_JOB_ID"):
    import zero_jax as zj
    zj.initialize_distributed()
  else:
    jax.config.update("jax_num_cpu_devices", devices)  # affects only the CPU backend
  return jax


def checkpoint_dir(args, jax) -> tuple[str, str]:
  """``(checkpoint, out)``: the tiny one written first (by process 0) when none is given."""
  from jax.experimental import multihost_utils
  if args.out is None and jax.process_count() > 1:
    raise SystemExit("with several processes, pass --out: a directory they all share.")
  work = tempfile.mkdtemp(prefix="finetune_llama_") if args.out is None else \
      os.path.dirname(os.path.abspath(args.out))
  checkpoint = args.checkpoint or os.path.join(work, "tiny-llama")
  exports = not (args.logits_out or args.check_logits)
  if exports and args.out and os.path.realpath(args.out) == os.path.realpath(checkpoint):
    raise SystemExit(f"--out {args.out} is the checkpoint's own directory: the export would "
                     f"replace the checkpoint it reads (and its config). Pass another --out.")
  if args.checkpoint is None:
    if jax.process_index() == 0:
      write_tiny_checkpoint(checkpoint, LlamaConfig())
    multihost_utils.sync_global_devices("finetune_llama: tiny checkpoint written")
  return checkpoint, args.out or os.path.join(work, "finetuned")


def ignored_tensors(cfg: LlamaConfig, names) -> list[str]:
  """The tensors of a checkpoint that transformers' ``from_pretrained`` ignores, and so does
  this example: ``lm_head.weight`` of a tied checkpoint (the head is the embedding), and the
  ``rotary_emb.inv_freq`` buffers older checkpoints store (computed from the config)."""
  return sorted(n for n in names if n.endswith("rotary_emb.inv_freq") or
                cfg.tie_word_embeddings and n == "lm_head.weight")


def check_shapes(cfg: LlamaConfig, tensors: dict) -> None:
  """Exits naming the first tensor whose shape is not the one ``config.json`` gives it
  (checked before dtypes: a tensor of the wrong shape is the fault, whatever its dtype)."""
  for name, shape in hf_shapes(cfg).items():
    if name in tensors and tuple(tensors[name][1]) != tuple(shape):
      code, found, path = tensors[name]
      raise SystemExit(f"{path}: tensor {name!r} has shape {list(found)} ({code}); config.json "
                       f"(hidden_size {cfg.hidden_size}, {cfg.num_attention_heads} heads of "
                       f"{cfg.head_dim}, {cfg.num_key_value_heads} key/value heads, "
                       f"intermediate_size {cfg.intermediate_size}, vocab_size "
                       f"{cfg.vocab_size}) needs {list(shape)}. The config and the weights are "
                       f"from different models: download the checkpoint again.")


def read_checkpoint(checkpoint: str) -> tuple[LlamaConfig, dict, bool]:
  """``(config, its tensors, strict)`` of a checkpoint directory; exits with one message
  naming the file for a config.json or a .safetensors file it cannot read. ``strict`` is
  False only when every tensor the model does not read is one transformers ignores too
  (`ignored_tensors`): those are left unread, saying so."""
  try:
    cfg = LlamaConfig.from_json(os.path.join(checkpoint, "config.json"))
    tensors = checkpoint_tensors(checkpoint)
  except (ConfigError, OSError, ValueError) as e:
    raise SystemExit(str(e)) from None
  check_shapes(cfg, tensors)
  extra = set(tensors) - set(hf_shapes(cfg))
  ignored = ignored_tensors(cfg, extra)
  if not extra or set(ignored) != extra:
    return cfg, tensors, True
  import zero_jax as zj
  if "lm_head.weight" in ignored:
    zj.print_main(f"{checkpoint}: lm_head.weight is not read: tie_word_embeddings makes the "
                  f"head the embedding (transformers ignores it too); the export leaves it out.")
  freqs = [n for n in ignored if n != "lm_head.weight"]
  if freqs:
    zj.print_main(f"{checkpoint}: {len(freqs)} rotary_emb.inv_freq tensor(s) are not read: the "
                  f"rotary frequencies come from config.json (transformers ignores them too); "
                  f"the export leaves them out.")
  return cfg, tensors, False


def n_params(cfg: LlamaConfig) -> int:
  return sum(int(np.prod(shape)) for shape in hf_shapes(cfg).values())


def header(args, cfg: LlamaConfig, checkpoint: str, tensors: dict, jax) -> str:
  """What runs, as train_lm.py prints it: the model, the checkpoint, the devices and the
  step's options."""
  devices = jax.devices()
  files = len({path for _, _, path in tensors.values()})
  codes = ", ".join(sorted({code for code, _, _ in tensors.values()}))
  head = "tied to the embedding" if cfg.tie_word_embeddings else "its own matrix"
  return "\n".join([
      f"model: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
      f"intermediate {cfg.intermediate_size}, {cfg.num_attention_heads} heads "
      f"({cfg.num_key_value_heads} key/value) of {cfg.head_dim}, vocab {cfg.vocab_size}, "
      f"rope {cfg.rope.rope_type} (theta {cfg.rope.theta:g}), head {head}; "
      f"{n_params(cfg):,} parameters",
      f"checkpoint: {checkpoint} ({codes}, {files} file{'s' * (files != 1)})",
      f"devices: {len(devices)} x {devices[0].platform} ({devices[0].device_kind}), "
      f"{jax.process_count()} process{'es' * (jax.process_count() != 1)}; ZeRO-3, "
      f"precision {args.precision}, layers stacked (zj.scan: prefetch {args.prefetch}, "
      f"remat {args.remat}); global batch {args.batch_size} x {args.seq_len} tokens"])


def plan_config(args) -> LlamaConfig:
  """``--plan``'s config: ``--config`` (a config.json or its directory), else
  ``--checkpoint``'s, else the tiny model's."""
  path = args.config or args.checkpoint
  if path is None:
    return LlamaConfig()
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  try:
    return LlamaConfig.from_json(path)
  except ConfigError as e:
    raise SystemExit(str(e)) from None


def split_options() -> dict:
  """The stage-3 step's options for this model: ``stacked=``, the blocks' variables (layers
  first) stay split between steps and the loss's ``zj.scan`` gathers one layer at a time;
  ``lookup=``, the embedding table stays split and ``zj.take`` moves only the rows the batch
  reads (a tied head gathers it once). The rest (final norm, untied head) is gathered whole
  before the loss."""
  from flax import nnx
  return {"stacked": nnx.PathContains("layers"), "lookup": nnx.PathContains("embed_tokens")}


def plan_main(args) -> dict:
  """``--plan``: which options fit and run fastest on the GPUs named, by compiling the
  stage-3 step for compile-only GPUs (no weights are read; ``zj.plan`` searches ``zj.scan``'s
  ``prefetch`` and ``policy``, a flag written on the command line is fixed)."""
  import functools
  import logging
  import jax
  import optax
  from flax import nnx
  import zero_jax as zj
  cfg = plan_config(args)
  fixed = {"stage": 3, "precision": args.precision, **split_options()}
  written = lambda flag: any(a == flag or a.startswith(flag + "=") for a in args.argv)
  given = {}
  if written("--prefetch"):
    given["prefetch"] = args.prefetch
  if written("--remat"):
    from llama.model import remat_policy
    given["policy"] = remat_policy(args.remat)
  dtype = None if args.precision == "fp32" else jax.numpy.bfloat16
  init = lambda: build_model(cfg, nnx.Rngs(0), dtype=dtype)
  batch = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jax.numpy.int32)
  print(f"plan: {cfg.model_type}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{n_params(cfg):,} parameters; {args.hosts} x {args.per_host} {args.gpu}; global batch "
        f"{args.batch_size} x {args.seq_len} tokens; ZeRO-3, precision {args.precision}")
  log = logging.getLogger("zero_jax.plan")  # progress, on stderr, once
  log.setLevel(logging.INFO)
  log.addHandler(logging.StreamHandler())
  log.propagate = False
  try:
    plan = zj.plan(functools.partial(loss_fn, **given) if given else loss_fn,
                   optax.adamw(args.lr), init, batch, gpu=args.gpu, hosts=args.hosts,
                   per_host=args.per_host, max_compiles=args.max_compiles, **fixed)
  except (RuntimeError, ValueError, TypeError) as e:  # no CUDA plugin, a bad --gpu, ...
    raise SystemExit(f"--plan: {e}") from None
  print(plan)
  return {"plan": plan, "config": cfg}


def main(argv=None) -> dict:
  args = parse_args(argv)
  args.argv = sys.argv[1:] if argv is None else list(argv)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.path.exists(os.path.join(root, "zero_jax", "__init__.py")):
    sys.path.insert(0, root)  # run from a checkout: its zero_jax, installed or not
  if args.plan:
    return plan_main(args)
  jax = start_jax(args.devices)
  import optax
  from flax import nnx
  import zero_jax as zj

  checkpoint, out = checkpoint_dir(args, jax)
  cfg, tensors, strict = read_checkpoint(checkpoint)
  codes = {tensors[name][0] for name in hf_shapes(cfg) if name in tensors}
  if not codes <= set(READABLE):
    raise SystemExit(f"{checkpoint}: tensors of dtype {sorted(codes - set(READABLE))}; this "
                     f"example reads {sorted(READABLE)} (converted to float32 losslessly).")
  dtype = jax.numpy.dtype(export_dtype(args.export_dtype, codes))
  zj.print_main(header(args, cfg, checkpoint, tensors, jax))
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adamw(args.lr), mesh=mesh, stage=3,
                                    precision=args.precision, **split_options())

  # The same function step.init would take, traced (nothing allocated): each device reads
  # its block of each tensor (the per-layer tensors model.layers.{i}.* straight into the
  # stacked leaves); the state keeps those blocks (donate=True: no second copy).
  make_model = lambda: build_model(cfg, nnx.Rngs(0), dtype=step.spec.policy.param_dtype,
                                   prefetch=args.prefetch, remat=args.remat)
  try:
    model = zj.load_safetensors(checkpoint, make_model, step=step, rename=hf_name,
                                cast=codes != {"F32"}, strict=strict)
  except (KeyError, ValueError, TypeError) as e:  # each names the file and the tensor
    raise SystemExit(e.args[0] if e.args else str(e)) from None
  state = step.init(model, donate=True)
  del model
  if args.logits_out or args.check_logits:
    return {**logits_check(args, step, state, mesh, cfg), "config": cfg, "step": step,
            "state": state}
  rows = zj.process_batch_slice(args.batch_size, step)  # this process's rows of each batch
  held = text_batches(args.batch_size, args.seq_len, cfg.vocab_size, seed=1, source=HELD_OUT)
  held = [zj.make_global_batch(next(held)[rows], step) for _ in range(args.eval_batches)]
  eval_losses: dict[int, float] = {}

  def evaluate(i):
    if args.eval_every and held:
      eval_losses[i] = held_out_loss(step, state, held)
      zj.print_main(f"step {i:4d}  held-out loss {eval_losses[i]:.4f}")

  evaluate(0)
  losses = []
  batches = text_batches(args.batch_size, args.seq_len, cfg.vocab_size)
  for i in range(args.steps):
    state, metrics = step(state, zj.make_global_batch(next(batches)[rows], step))
    losses.append(zj.metrics_to_host(metrics)["loss"])
    if i % 5 == 0 or i == args.steps - 1:
      zj.print_main(f"step {i:4d}  loss {losses[-1]:.4f}")
    if args.eval_every and ((i + 1) % args.eval_every == 0 or i == args.steps - 1):
      evaluate(i + 1)

  sampled = []
  if args.sample:
    prompt = text_tokens(cfg.vocab_size, HELD_OUT)[:PROMPT]
    sampled = sample(step, state, mesh, prompt, args.sample)
    zj.print_main(f"greedy continuation of the held-out tokens {prompt.tolist()}: {sampled}")
    if cfg.vocab_size == 256:  # the tokens are the bytes themselves (the tiny model's vocab)
      zj.print_main(f"as text: {bytes(prompt.tolist())!r} -> {bytes(sampled)!r}")

  files = zj.export_safetensors(step, state, out, rename=hf_name, dtype=dtype, force=True,
                                max_shard_bytes=max_shard_bytes(args.max_shard_size, tensors,
                                                                dtype))
  copied = [f for f in COPIED if os.path.exists(os.path.join(checkpoint, f))]
  if jax.process_index() == 0:
    for f in copied:
      shutil.copy(os.path.join(checkpoint, f), out)
  zj.print_main(f"wrote {', '.join(files + copied)} ({dtype}) to {out}")
  return {"losses": losses, "eval_losses": eval_losses, "sampled": sampled,
          "checkpoint": checkpoint, "out": out, "files": files, "step": step, "state": state,
          "config": cfg}


if __name__ == "__main__":
  main()
