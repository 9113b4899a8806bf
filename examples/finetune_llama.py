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
* ZeRO-3 (``stage=3``) fine-tunes it on the bytes of a Python source file, each process
  feeding its own rows of every batch (``--precision bf16``: bf16 parameters, float32
  master copy);
* ``zj.export_safetensors`` writes the result from the shards, in the layout and dtype it
  came in (one file, or as many as the checkpoint had: ``--max-shard-size``;
  ``config.json``, ``generation_config.json`` and the tokenizer's files copied along), ready
  for ``transformers``' ``from_pretrained``.

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
from llama.model import build_model  # noqa: E402

READABLE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # lossless into float32
ATOL = {"fp32": 1e-4, "bf16": 1e-1}
# Copied beside the export when present: the config, and the tokenizer's files as
# transformers' save_pretrained writes them (so that AutoTokenizer loads the export too).
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
          "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")


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
  p.add_argument("--devices", type=int, default=8,
                 help="fake CPU devices to use when the machine has only one device "
                      "(default: %(default)s)")
  args = p.parse_args(argv)
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


def forward_logits(step, model, tokens: np.ndarray) -> np.ndarray:
  """The model's float32 logits for ``tokens``, its parameters split as the step splits
  them (cast to the step's precision) and the result replicated to every process."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P
  graphdef, params, *rest = nnx.split(model, nnx.Param, ...)
  dtype = step.spec.policy.param_dtype
  replicated = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, P())
  ids = jax.make_array_from_callback(tokens.shape, replicated, lambda i: tokens[i])

  @jax.jit
  def forward(params, tokens):
    if dtype is not None:
      params = jax.tree.map(lambda x: x.astype(dtype), params)
    out = nnx.merge(graphdef, params, *rest)(tokens).astype(jnp.float32)
    return jax.lax.with_sharding_constraint(out, replicated)

  return np.asarray(forward(params, ids))


def logits_check(args, step, model, cfg) -> dict:
  """``--logits-out`` / ``--check-logits``: writes or compares, on process 0."""
  import zero_jax as zj
  tokens_path = args.tokens or args.check_logits[0]
  logits = forward_logits(step, model, load_tokens(tokens_path, cfg.vocab_size))
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


def main(argv=None) -> dict:
  args = parse_args(argv)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if os.path.exists(os.path.join(root, "zero_jax", "__init__.py")):
    sys.path.insert(0, root)  # run from a checkout: its zero_jax, installed or not
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
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adamw(args.lr), mesh=mesh, stage=3,
                                    precision=args.precision)

  # The same function step.init would take, traced (nothing allocated): each device reads
  # its block of each tensor; the state keeps those blocks (donate=True: no second copy).
  make_model = lambda: build_model(cfg, nnx.Rngs(0), dtype=step.spec.policy.param_dtype)
  try:
    model = zj.load_safetensors(checkpoint, make_model, step=step, rename=hf_name,
                                cast=codes != {"F32"}, strict=strict)
  except (KeyError, ValueError, TypeError) as e:  # each names the file and the tensor
    raise SystemExit(e.args[0] if e.args else str(e)) from None
  if args.logits_out or args.check_logits:
    return {**logits_check(args, step, model, cfg), "config": cfg, "step": step}
  state = step.init(model, donate=True)
  losses = []
  rows = zj.process_batch_slice(args.batch_size, step)  # this process's rows of each batch
  batches = text_batches(args.batch_size, args.seq_len, cfg.vocab_size)
  for i in range(args.steps):
    state, metrics = step(state, zj.make_global_batch(next(batches)[rows], step))
    losses.append(zj.metrics_to_host(metrics)["loss"])
    if i % 5 == 0 or i == args.steps - 1:
      zj.print_main(f"step {i:4d}  loss {losses[-1]:.4f}")

  files = zj.export_safetensors(step, state, out, rename=hf_name, dtype=dtype, force=True,
                                max_shard_bytes=max_shard_bytes(args.max_shard_size, tensors,
                                                                dtype))
  copied = [f for f in COPIED if os.path.exists(os.path.join(checkpoint, f))]
  if jax.process_index() == 0:
    for f in copied:
      shutil.copy(os.path.join(checkpoint, f), out)
  zj.print_main(f"wrote {', '.join(files + copied)} ({dtype}) to {out}")
  return {"losses": losses, "checkpoint": checkpoint, "out": out, "files": files,
          "step": step, "state": state, "config": cfg}


if __name__ == "__main__":
  main()
