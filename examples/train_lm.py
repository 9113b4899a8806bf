"""Train a small byte-level transformer language model with ZeRO (zero_jax).

The text is the source code of Python's own standard library, which every
machine that runs this script has; the tokenizer is the bytes themselves
(256 values plus an end-of-file token: vocabulary 257, nothing to download).
One file in twenty is held out to measure the loss on text the model never
trained on.

  python examples/train_lm.py                  # ZeRO-2 on all devices; 8 CPU devices on a CPU-only machine
  python examples/train_lm.py --stage 3 --precision bf16 --size medium
  python examples/train_lm.py --steps 600 --resume   # continue from the latest checkpoint
  python examples/launch_local.py -n 2 -d 4 examples/train_lm.py --size tiny   # 2 processes
  python examples/train_lm.py --help

What it shows, in order: the model and the devices; a progress bar with the
loss and tokens/s; the held-out loss before and after; the per-device memory
of parameters, gradients, optimizer state and master copy for plain data
parallelism and ZeRO stages 1-3 (`zj.memory_report`, from shapes only) next
to what this run's state really holds and XLA's own figure for the compiled
step; a little text sampled from the model; a checkpoint to resume from
(`zj.CheckpointManager`).

The data order depends only on ``--seed`` and the step number, so a run
resumed from a checkpoint takes the same steps as one that was never
interrupted. The flags that change what a checkpoint holds (``--size``,
``--seq-len``, ``--precision``) are written next to it (``run.json``):
``--resume`` takes them from there, and a new run refuses a directory that
holds another run's checkpoints unless given ``--overwrite``.

SIGTERM (a preemption notice: SLURM's time limit, a Kubernetes eviction) to any
process makes every process save the same step and exit 0, printing the step
and the command that resumes it, on any number of processes and devices.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import pathlib
import shlex
import shutil
import sys
import sysconfig
import time

EOF = 256          # token that separates files
VOCAB = 257        # 256 bytes + EOF: an uneven size, like GPT-2's 50257

RUN_FLAGS = ("size", "seq_len", "precision")  # change what a checkpoint holds
RUN_FILE = "run.json"                         # their values, next to the checkpoints
SCHEDULE_KEY = "schedule_steps"               # also there: the --steps the run started with

REMAT = ("none", "dots", "full")  # --remat: zj.scan's policy= (`remat_policy`)
ATTENTION = ("written", "xla", "cudnn")  # --attention: `causal_attention`'s implementations
SIZES = {          # d_model, layers, heads
    "tiny": (64, 2, 2),
    "small": (128, 4, 4),
    "medium": (256, 6, 8),
    "large": (512, 8, 8),
}


# ------------------------------------------------------------------ arguments
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, except empty ones (None, False)."""

  def _get_help_string(self, action):
    if action.default in (None, False):
      return action.help
    return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      description="Train a byte-level transformer LM on Python's standard library with "
                  "zero_jax (ZeRO sharded data parallelism).",
      formatter_class=_HelpFormatter)
  p.add_argument("--stage", type=int, default=2, choices=(1, 2, 3),
                 help="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also params")
  p.add_argument("--precision", default="fp32",
                 choices=("fp32", "bf16", "fp16", "fp16_memory_efficient"),
                 help="precision policy of the step")
  p.add_argument("--size", default="small", choices=tuple(SIZES),
                 help="model size: " + ", ".join(f"{k}=d{d}/L{l}/H{h}"
                                                 for k, (d, l, h) in SIZES.items()))
  p.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
  p.add_argument("--steps", type=int, default=300, help="train until this step number")
  p.add_argument("--batch-size", type=int, default=32,
                 help="global batch (sequences), split over the devices")
  p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
  p.add_argument("--devices", type=int, default=None,
                 help="number of devices (default: all; on a CPU-only machine 8 CPU devices)")
  p.add_argument("--platform", default=None, choices=("cpu", "gpu", "tpu"),
                 help="force a JAX platform (e.g. cpu to use fake CPU devices on a GPU box)")
  p.add_argument("--distributed", action="store_true",
                 help="join a multi-process job (zj.initialize_distributed: SLURM, Open MPI, "
                      "...); implied when started by examples/launch_local.py")
  p.add_argument("--hosts", type=int, default=1,
                 help="split the devices into this many 'hosts': a (hosts, n/hosts) mesh of "
                      "('replica', 'data'), the state split over both")
  p.add_argument("--hpz", action="store_true",
                 help="ZeRO++ hpZ (stage 3, --hosts > 1): gather parameters within a host")
  p.add_argument("--quantize", default="none",
                 choices=("none", "weights", "grads", "both", "search"),
                 help="ZeRO++ int8 communication: qwZ (weights), qgZ (grads) or both; with "
                      "--plan, 'search' lets the planner try them (lossy)")
  p.add_argument("--prefetch", type=int, default=None, choices=(0, 1),
                 help="loop over the blocks with zj.scan: 1 gathers the next block while this "
                      "one computes (stage 3) and reduces each gradient one block later "
                      "(default: none, the blocks loop with nn.scan and recompute each block "
                      "in the backward pass)")
  p.add_argument("--remat", default="full", choices=REMAT,
                 help="with --prefetch, what each block keeps for the backward pass "
                      "(zj.scan's policy=): none keeps every activation, dots the weight "
                      "matmuls' outputs, full only the block's input (recomputing the block)")
  p.add_argument("--attention", default="auto", choices=("auto",) + ATTENTION,
                 help="attention implementation: written out (jnp), jax.nn.dot_product_attention's "
                      "xla or cudnn (fused; NVIDIA GPUs, bf16/fp16, needs nvidia-cudnn-cu12); auto: "
                      "cudnn on GPUs in bf16/fp16, else written (default: auto)")
  p.add_argument("--seed", type=int, default=0, help="seed of the init and the data order (default: %(default)s)")
  p.add_argument("--ckpt-dir", default=os.path.join("checkpoints", "train_lm"),
                 help="checkpoint directory (relative: under the current directory)")
  p.add_argument("--save-every", type=int, default=100,
                 help="save a checkpoint every this many steps (and at the end); 0: only at the end")
  p.add_argument("--resume", nargs="?", const=-1, type=int, default=None, metavar="STEP",
                 help="continue from the latest checkpoint in --ckpt-dir (or from STEP), "
                      "with the --size, --seq-len and --precision it was written with")
  p.add_argument("--overwrite", action="store_true",
                 help="delete the checkpoints already in --ckpt-dir (a new run refuses a "
                      "directory holding another run's checkpoints without it)")
  p.add_argument("--eval-batches", type=int, default=8, help="held-out batches for eval loss")
  p.add_argument("--sample-bytes", type=int, default=300, help="bytes of text to sample")
  p.add_argument("--prompt", default="def ", help="start of the sampled text")
  p.add_argument("--log-every", type=int, default=10, help="update the progress bar every N steps")
  p.add_argument("--metrics-json", default=None,
                 help="write losses, eval loss, tokens/s and a parameter checksum here")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--plan", action="store_true",
                 help="print zj.plan's table for this model on --hosts x --per-host --gpu "
                      "GPUs (compiled for them here, no GPU needed: JAX's CUDA plugin is) "
                      "and exit; --stage, --quantize, --prefetch, --remat and --hpz, when "
                      "given, are fixed, the rest searched")
  p.add_argument("--gpu", default="h100", choices=("h100", "h200", "a100"),
                 help="with --plan: the GPU to plan for")
  p.add_argument("--per-host", type=int, default=8, help="with --plan: GPUs per host")
  p.add_argument("--max-compiles", type=int, default=4,
                 help="with --plan: how many candidates to compile (the fastest predicted)")
  return p


def given_flags(argv=None) -> set[str]:
  """The options written on the command line (the others keep their defaults)."""
  p = build_parser()
  for action in p._actions:
    action.default = argparse.SUPPRESS
  return set(vars(p.parse_args(argv)))


def parse_args(argv=None) -> argparse.Namespace:
  p = build_parser()
  args = p.parse_args(argv)
  if args.batch_size < 1 or args.steps < 1 or args.seq_len < 2:
    p.error("--batch-size and --steps must be positive and --seq-len at least 2")
  if args.quantize == "search" and not args.plan:
    p.error("--quantize search is for --plan (the planner tries ZeRO++'s choices); to train "
            "with one, give none, weights, grads or both")
  args.given = given_flags(argv)
  return args


if __name__ == "__main__":
  parse_args()  # --help and a mistyped flag answer here, before JAX is imported (seconds)

import jax  # noqa: E402  (after the flags are read: see above)

try:
  import zero_jax as zj
except ImportError:  # running from a checkout without `pip install -e .`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
  import zero_jax as zj

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402


def setup_devices(args) -> list:
  """Picks the devices; must run before anything starts JAX's backend."""
  if args.platform:
    jax.config.update("jax_platforms", args.platform)
  if args.distributed or os.environ.get("ZERO_JAX_COORDINATOR_ADDRESS"):
    zj.initialize_distributed()  # each process's CPU device count comes from launch_local
    if args.devices not in (None, jax.device_count()):
      sys.exit(f"--devices {args.devices}: a multi-process run uses all "
               f"{jax.device_count()} devices of its processes.")
  else:
    # Only the CPU backend reads this: a CPU-only machine gets --devices (or 8)
    # fake devices; a GPU or TPU machine keeps its own.
    jax.config.update("jax_num_cpu_devices", args.devices or 8)
  zj.watch_preemption()  # from here on, SIGTERM makes every process save and stop
  devices = jax.devices()
  if args.devices:
    if args.devices > len(devices):
      sys.exit(f"--devices {args.devices}: only {len(devices)} {devices[0].platform} devices here.")
    devices = devices[:args.devices]
  return devices


# ---------------------------------------------------------------- checkpoints
def flags_text(values: dict) -> str:
  return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in values.items())


def run_flags(args) -> dict:
  return {k: getattr(args, k) for k in RUN_FLAGS}


def saved_steps(ckpt_dir: str) -> list[int]:
  names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
  return sorted(int(n) for n in names if n.isdigit())


def read_run_flags(ckpt_dir: str) -> dict | None:
  """The flags recorded with the checkpoints in ``ckpt_dir`` (None: none recorded)."""
  path = os.path.join(ckpt_dir, RUN_FILE)
  if not os.path.isfile(path):
    return None
  with open(path) as fh:
    return {k: v for k, v in json.load(fh).items() if k in RUN_FLAGS}


def schedule_steps(args, ckpt_dir: str) -> int:
  """The length of the learning-rate schedule: on --resume, the --steps the run started
  with (recorded in run.json), whatever --steps says now; else --steps."""
  path = os.path.join(ckpt_dir, RUN_FILE)
  if args.resume is not None and os.path.isfile(path):
    with open(path) as fh:
      return int(json.load(fh).get(SCHEDULE_KEY, args.steps))
  return args.steps


def lr_schedule(lr: float, steps: int):
  """Warmup over a tenth of ``steps``, cosine decay to lr/10 at ``steps``, then lr/10."""
  return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=max(1, steps // 10),
                                            decay_steps=steps, end_value=lr / 10)


def make_optimizer(lr: float, steps: int):
  """AdamW on `lr_schedule`."""
  return optax.adamw(lr_schedule(lr, steps), b2=0.99, weight_decay=0.01)


def quantize_option(flag: str):
  """``--quantize``'s `zj.Quantize` (None for ``none``)."""
  return None if flag == "none" else zj.Quantize(weights=flag in ("weights", "both"),
                                                 grads=flag in ("grads", "both"))


def resume_with_recorded_flags(args, ckpt_dir: str, recorded: dict) -> None:
  """Takes the checkpoints' flags; exits naming any the command line contradicts."""
  clash = {k: getattr(args, k) for k in RUN_FLAGS
           if k in args.given and getattr(args, k) != recorded[k]}
  if clash:
    sys.exit(f"--resume: the checkpoints in {ckpt_dir} were written with "
             f"{flags_text(recorded)}, but this run asks for {flags_text(clash)}. Leave "
             f"those flags out to resume with the checkpoints' own, or start a new run "
             f"in another --ckpt-dir.")
  taken = {k: v for k, v in recorded.items() if getattr(args, k) != v}
  for k, v in taken.items():
    setattr(args, k, v)
  if taken:
    print(f"--resume: using {flags_text(taken)}, as recorded in {ckpt_dir}/{RUN_FILE}")


def prepare_ckpt_dir(args, ckpt_dir: str, default_dir: bool) -> None:
  """On --resume, the recorded flags; on a new run, an empty directory, or an exit.

  A new run deletes earlier checkpoints only with --overwrite, or in the
  default directory when they were written with the same flags; it says so.
  """
  recorded = read_run_flags(ckpt_dir)
  if args.resume is not None:
    if recorded is not None:
      resume_with_recorded_flags(args, ckpt_dir, recorded)
    return
  steps = saved_steps(ckpt_dir)
  if not steps:
    return
  if not (args.overwrite or (default_dir and recorded == run_flags(args))):
    what = f"with {flags_text(recorded)}" if recorded else "(flags not recorded)"
    sys.exit(f"--ckpt-dir {ckpt_dir} holds the checkpoints (steps {steps}) of another run "
             f"{what}; pass --resume to continue that run, --overwrite to delete them, "
             f"or choose an empty --ckpt-dir.")
  zj.print_main(f"deleting the checkpoints (steps {steps}) of an earlier run in {ckpt_dir}; "
                f"--resume would have continued it")
  if zj.is_main_process():
    for s in steps:
      shutil.rmtree(os.path.join(ckpt_dir, str(s)))


def record_run_flags(args, ckpt_dir: str) -> None:
  if not zj.is_main_process():
    return
  os.makedirs(ckpt_dir, exist_ok=True)
  with open(os.path.join(ckpt_dir, RUN_FILE), "w") as fh:
    json.dump({**run_flags(args), SCHEDULE_KEY: args.steps}, fh)


# ----------------------------------------------------------------------- data
def stdlib_files() -> list[pathlib.Path]:
  """The standard library's .py files (no tests, no site-packages), sorted."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  if not root.is_dir():
    root = pathlib.Path(os.__file__).parent
  skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
  return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def load_corpus() -> tuple[np.ndarray, np.ndarray]:
  """(train, held_out) token arrays: file bytes joined by EOF; every 20th file held out."""
  train: list[np.ndarray] = []
  held: list[np.ndarray] = []
  for i, path in enumerate(stdlib_files()):
    try:
      data = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32)
    except OSError:
      continue
    (held if i % 20 == 0 else train).extend([data, np.array([EOF], np.int32)])
  if not train or not held:
    sys.exit("could not find the Python standard library's source files.")
  return np.concatenate(train), np.concatenate(held)


def get_batch(data: np.ndarray, index: int, batch_size: int, seq_len: int, seed: int) -> dict:
  """Batch ``index``: random windows of ``seq_len + 1`` tokens, a function of (seed, index)."""
  rng = np.random.default_rng([seed, index])
  starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
  return {"tokens": np.stack([data[s:s + seq_len + 1] for s in starts])}


# ---------------------------------------------------------------------- model
def causal_attention(q, k, v, implementation: str = "written"):
  """Causal self-attention of ``q`` ``[b, t, heads, d]`` over ``k``, ``v`` ``[b, t, kv_heads, d]``.

  ``"written"``: the scores, mask and float32 softmax written out as jnp operations (runs
  anywhere); ``"xla"`` or ``"cudnn"``: ``jax.nn.dot_product_attention`` with that
  implementation (``"cudnn"``: cuDNN's fused flash attention on NVIDIA GPUs, bf16/fp16 only,
  which needs the ``nvidia-cudnn-cu12`` wheel; the mask is built inside the kernel).
  """
  if implementation != "written":
    if implementation not in ATTENTION:
      raise ValueError(f"attention implementation {implementation!r}: expected one of "
                       f"{ATTENTION}")
    if implementation == "cudnn":
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
  b, t, heads, d = q.shape
  causal = jnp.tril(jnp.ones((t, t), bool))
  if k.shape[2] == heads:
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    scores = jnp.where(causal, scores / math.sqrt(d), -1e9)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # softmax in float32
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)
  q = q.reshape(b, t, k.shape[2], heads // k.shape[2], d)  # grouped-query attention
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) / math.sqrt(d)
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(v.dtype)
  return jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(b, t, heads, d)


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention (`causal_attention`) and an MLP."""
  d_model: int
  heads: int
  attention: str = "written"

  @nn.compact
  def __call__(self, x, _):
    b, t, d = x.shape
    h = nn.LayerNorm(name="ln1")(x)
    q, k, v = jnp.split(nn.Dense(3 * d, name="qkv")(h), 3, axis=-1)
    split = lambda a: a.reshape(b, t, self.heads, d // self.heads)
    y = causal_attention(split(q), split(k), split(v), self.attention).reshape(b, t, d)
    x = x + nn.Dense(d, name="proj")(y)
    h = nn.LayerNorm(name="ln2")(x)
    return x + nn.Dense(d, name="down")(nn.gelu(nn.Dense(4 * d, name="up")(h))), None


class ByteLM(nn.Module):
  """Decoder-only transformer over bytes, with tied input/output embeddings.

  The blocks' parameters are stacked (``params["blocks"]``, layers first) and
  scanned over; each block gathers its own slice with ``zj.gather`` (the
  identity outside a stage-3 step), so ZeRO-3 holds one gathered block at a
  time. Each block is recomputed in the backward pass (``nn.remat``): at
  stage 3 that is what gathers it again instead of keeping it, and at every
  stage it keeps only the blocks' inputs (on 8 CPU devices, stage 2's XLA temp
  is 12 MiB with it and 55 MiB without, and the step is faster).

  With ``prefetch`` 0 or 1 the same parameters are looped over with
  ``zj.scan`` instead (``--prefetch``): with 1 the next block is gathered while
  this one computes, and each block's gradient reduced one block later; each
  block keeps what ``remat`` names (``--remat``, zj.scan's ``policy=``).
  """
  d_model: int
  layers: int
  heads: int
  max_len: int
  prefetch: int | None = None
  remat: str = "full"
  attention: str = "written"  # `causal_attention`'s implementation (``--attention``)

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, self.d_model, embedding_init=nn.initializers.normal(0.02),
                     name="embed")
    pos = self.param("pos", nn.initializers.normal(0.02), (self.max_len, self.d_model))
    x = embed(tokens) + pos[:tokens.shape[1]].astype(embed.embedding.dtype)
    if self.prefetch is None or self.is_initializing():
      block = nn.map_variables(Block, "params", trans_in_fn=zj.gather,
                               init=self.is_initializing())
      blocks = nn.scan(nn.remat(block), variable_axes={"params": 0},
                       split_rngs={"params": True}, length=self.layers)
      x, _ = blocks(self.d_model, self.heads, self.attention, name="blocks")(x, None)
    else:  # the parameters nn.scan made, one block applied to each layer's slice
      one = Block(self.d_model, self.heads, self.attention, parent=None)
      x, _ = zj.scan(lambda h, p: one.apply({"params": p}, h, None), x,
                     self.variables["params"]["blocks"], prefetch=self.prefetch,
                     policy=remat_policy(self.remat))
    x = nn.LayerNorm(name="ln_f")(x)
    return embed.attend(x).astype(jnp.float32)  # logits in float32 for the loss


def attention_for(args, platform: str) -> str:
  """``--attention``'s implementation; ``auto``: cuDNN's fused attention on GPUs in bf16/fp16
  (what GPU users run), the written-out one elsewhere (CPU, TPU, fp32)."""
  if args.attention != "auto":
    return args.attention
  return "cudnn" if platform == "gpu" and args.precision != "fp32" else "written"


def remat_policy(remat: str):
  """``--remat``'s ``jax.checkpoint`` policy for `zero_jax.scan` (None: keep everything)."""
  return {"none": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
          "full": jax.checkpoint_policies.nothing_saveable}[remat]


def remat_name(policy) -> str:
  """The ``--remat`` name of a policy `zj.plan` tries."""
  for name in REMAT:
    if remat_policy(name) is policy:
      return name
  raise ValueError(f"no --remat name for the policy {policy!r}; known: {REMAT}")


def in_blocks(path, _):
  """`stacked=`: the scanned blocks' parameters, layers first."""
  return jax.tree_util.keystr(path).startswith("['blocks']")


def make_loss_fn(model):
  def loss_fn(params, batch):
    tokens = batch["tokens"]
    logits = model.apply({"params": params}, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss_fn


def replicated(mesh, x) -> jax.Array:
  """``x`` as one array every device holds whole (every process passes the same)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, P()), lambda i: x[i])


def sample(step, state, mesh, model, prompt: bytes, n: int, seed: int,
           temperature: float = 0.8) -> str:
  """``n`` bytes continuing ``prompt``, one forward pass per byte over a sliding window, by
  ``step.apply`` on the split state (at stage 3 the blocks gathered one at a time, as in
  the step; the window's length is an argument: compiled once)."""
  t = model.max_len

  def next_byte(params, window, length, i):
    logits = model.apply({"params": params}, window)[0, length - 1]
    return jax.random.categorical(jax.random.fold_in(jax.random.key(seed), i),
                                  logits / temperature)

  tokens = list(prompt)
  for i in range(n):
    ctx = tokens[-t:]
    window = np.zeros((1, t), np.int32)
    window[0, :len(ctx)] = ctx
    args = (window, np.int32(len(ctx)), np.int32(i))
    out = step.apply(state, next_byte, *(replicated(mesh, a) for a in args))
    tokens.append(int(np.asarray(out if out.is_fully_addressable else
                                 multihost_utils.process_allgather(out))))
  text = bytes(b if b != EOF else 10 for b in tokens)
  return text.decode("utf-8", errors="replace")


# ----------------------------------------------------------------- reporting
def shard_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def memory_section(step, state, params_shapes, optimizer, batch, args) -> str:
  """The `zj.memory_report` table, this run's state and XLA's figure for its step."""
  report = zj.memory_report(params_shapes, optimizer, n_devices=step.n,
                            precision=args.precision, stacked=in_blocks)
  row = report[args.stage]
  from zero_jax.step.memory import format_bytes as f  # pylint: disable=g-import-not-at-top
  lines = [str(report), "",
           f"This run (ZeRO-{args.stage}), device 0's shards of the state: params and master "
           f"copy {f(shard_bytes(state.params) + shard_bytes(state.master))} (report: "
           f"{f(row.params + row.master)}; at stage 3 in bf16/fp16 the params are the master), "
           f"optimizer state {f(shard_bytes(state.opt_state))} (report: "
           f"{f(row.optimizer_state)})."]
  stats = step.lower(state, batch).compile().memory_analysis()
  if stats is not None:
    cm = zj.CompiledMemory(
        int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
        int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes),
        int(stats.generated_code_size_in_bytes))
    lines.append(f"XLA's analysis of the compiled step, per device: {cm}.")
  return "\n".join(lines)


def param_checksum(state) -> list[float]:
  """(sum, sum of squares) over all parameters (the float32 master copy where there is one),
  in float64: equal runs give equal sums. Read block by block from the split state, each
  block once (its first replica) by the process that holds it, then added over the
  processes: no parameter is gathered whole (padding is zeros, which add nothing)."""
  values = jax.tree.leaves(state.params)
  for i, m in enumerate(state.master or ()):
    values[i] = values[i] if m is None else m
  total = np.zeros(2)
  for x in values:
    for shard in x.addressable_shards:
      if shard.replica_id == 0:
        block = np.asarray(shard.data, np.float64)
        total += [block.sum(), (block * block).sum()]
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    total = np.asarray(multihost_utils.process_allgather(total)).reshape(-1, 2).sum(0)
  return [float(total[0]), float(total[1])]


# ---------------------------------------------------------------------- train
def global_batch(data, index: int, args, step):
  """Batch ``index`` as one array over all processes: each gives its own rows."""
  batch = get_batch(data, index, args.batch_size, args.seq_len, args.seed)
  rows = zj.process_batch_slice(args.batch_size, step)
  return zj.make_global_batch({k: v[rows] for k, v in batch.items()}, step)


def train_loop(step, state, mngr, train, args):
  """Steps to ``--steps``; returns (state, losses, (timed steps, seconds after compilation)).

  Before each step, every process asks ``mngr.reached_preemption``: after a
  notice, all of them stop at the same step, saved.
  """
  start = int(state.step)
  losses: dict[int, float] = {}
  pending = []
  tokens_per_step = args.batch_size * args.seq_len
  timed_steps, timed_s, t_mark = 0, 0.0, None
  bar = tqdm(range(start, args.steps), initial=start, total=args.steps, unit="step",
             desc=f"ZeRO-{args.stage} {args.precision}",
             disable=args.no_progress or not zj.is_main_process(), dynamic_ncols=True)
  batch = global_batch(train, start, args, step)
  t_first = time.perf_counter()
  for i in bar:
    if mngr.reached_preemption(state):  # cheap; True on every process at the same step
      break
    state, metrics = step(state, batch)
    pending.append((i + 1, metrics["loss"]))
    if i + 1 < args.steps:  # prepare the next batch while the step runs
      batch = global_batch(train, i + 1, args, step)
    last = i + 1 == args.steps
    if (i + 1 - start) % args.log_every == 0 or last or i == start:
      losses.update((s, float(l)) for s, l in pending)  # waits for the step
      now = time.perf_counter()
      if t_mark is not None:
        timed_steps += len(pending)
        timed_s += now - t_mark
      else:
        zj.print_main(f"step {i + 1} done, compilation included: {now - t_first:.1f} s")
      t_mark, pending = now, []  # the first interval (compilation) is not timed
      rate = timed_steps * tokens_per_step / timed_s if timed_s else float("nan")
      bar.set_postfix(loss=f"{losses[i + 1]:.3f}", tok_s=f"{rate:,.0f}")
    if args.save_every and (i + 1) % args.save_every == 0 and not last:
      mngr.save(state, force=True)  # force: a resumed run replaces later checkpoints
  bar.close()
  losses.update((s, float(l)) for s, l in pending)
  return state, losses, (timed_steps, timed_s)


def command(argv) -> str:
  """``python <this script> ARGV``, the script's path relative to here if it is below."""
  script = os.path.relpath(__file__)
  return shlex.join(["python", os.path.abspath(__file__) if script.startswith("..") else script,
                     *argv])


def resume_command(argv) -> str:
  """This run's command line with ``--resume`` (and without ``--overwrite``)."""
  argv = list(sys.argv[1:] if argv is None else argv)
  out, skip = [], False
  for i, a in enumerate(argv):
    if skip:
      skip = False
    elif a == "--resume":
      skip = i + 1 < len(argv) and argv[i + 1].isdigit()
    elif a != "--overwrite" and not a.startswith("--resume="):
      out.append(a)
  return command([*out, "--resume"])


def stopped_for_preemption(mngr, args, argv, start: int, losses: dict, state) -> dict:
  """One line naming the step and the command that resumes; the run ends (exit 0)."""
  p = mngr.preemption
  mngr.close()
  if p.saved:
    print(f"{p}. Resume on any number of processes and devices with: {resume_command(argv)}",
          flush=True)
  else:
    print(f"{p}. Start again with: {command(sys.argv[1:] if argv is None else argv)}",
          flush=True)
  result = {"start_step": start, "step": p.step, "preempted": True, "saved": p.saved,
            "losses": losses, "param_checksum": param_checksum(state)}
  write_metrics(args, result)
  return result


def write_metrics(args, result: dict) -> None:
  if args.metrics_json and zj.is_main_process():
    with open(args.metrics_json, "w") as fh:
      json.dump(result, fh, indent=1)


# ----------------------------------------------------------------------- main
def plan_main(args) -> dict:
  """``--plan``: which stage and options fit and run fastest on the GPUs named, by compiling.

  The flags written on the command line (``--stage``, ``--quantize``, ``--prefetch``,
  ``--remat``, ``--hpz``) are fixed; the planner searches the others, exactly (``--quantize
  search`` adds ZeRO++'s lossy choices). The plan's table ends with why candidates were
  refused, skipped or pruned."""
  d_model, layers, heads = SIZES[args.size]
  fixed = {"precision": args.precision, "max_grad_norm": 1.0, "stacked": in_blocks}
  if "stage" in args.given:
    fixed["stage"] = args.stage
  if "quantize" in args.given:
    fixed["quantize"] = "search" if args.quantize == "search" else quantize_option(args.quantize)
  if "hpz" in args.given:
    fixed["hpz_axis"] = "data"

  def searched(params, batch, *, prefetch=0, policy=None):  # zj.scan's, which zj.plan tries
    model = ByteLM(d_model, layers, heads, args.seq_len, prefetch, remat_name(policy),
                   attention_for(args, "gpu"))
    return make_loss_fn(model)(params, batch)

  given = {}
  if "prefetch" in args.given:
    given["prefetch"] = args.prefetch
  if "remat" in args.given:
    given["policy"] = remat_policy(args.remat)
  loss_fn = functools.partial(searched, **given) if given else searched
  init = lambda: ByteLM(d_model, layers, heads, args.seq_len).init(
      jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
  batch = {"tokens": jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32)}
  logging.getLogger("zero_jax.plan").setLevel(logging.INFO)  # progress, on stderr
  logging.getLogger("zero_jax.plan").addHandler(logging.StreamHandler())
  plan = zj.plan(loss_fn, make_optimizer(args.lr, args.steps), init, batch, gpu=args.gpu,
                 hosts=args.hosts, per_host=args.per_host, max_compiles=args.max_compiles,
                 **fixed)
  print(plan)
  return {"plan": str(plan), "best": plan.best.name if plan.best else None}


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.plan:
    return plan_main(args)
  ckpt_dir = os.path.abspath(args.ckpt_dir)
  devices = setup_devices(args)
  prepare_ckpt_dir(args, ckpt_dir, default_dir=args.ckpt_dir == parse_args([]).ckpt_dir)
  t_start = time.perf_counter()
  n = len(devices)
  if n % args.hosts:
    sys.exit(f"--hosts {args.hosts} must divide the {n} devices.")
  mesh = jax.make_mesh((args.hosts, n // args.hosts), ("replica", "data"), devices=devices)
  if args.batch_size % n:
    sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {n} devices.")

  d_model, layers, heads = SIZES[args.size]
  model = ByteLM(d_model, layers, heads, max_len=args.seq_len, prefetch=args.prefetch,
                 remat=args.remat, attention=attention_for(args, devices[0].platform))
  dummy = jnp.zeros((1, args.seq_len), jnp.int32)
  params_shapes = jax.eval_shape(model.init, jax.random.key(args.seed), dummy)["params"]
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params_shapes))
  train, held = load_corpus()
  zj.print_main(f"ByteLM {args.size}: d_model={d_model}, layers={layers}, heads={heads}, "
                f"context={args.seq_len}, vocab={VOCAB}, {n_params:,} parameters")
  zj.print_main(f"data: Python {sys.version.split()[0]} standard library, {len(train):,} "
                f"train bytes, {len(held):,} held-out bytes")
  zj.print_main(f"devices: {n} x {devices[0].platform} ({devices[0].device_kind}); "
                f"ZeRO-{args.stage}, precision {args.precision}, global batch "
                f"{args.batch_size} x {args.seq_len} tokens")

  # A resumed run keeps the schedule its run started with (another --steps only trains
  # longer, at the schedule's final lr beyond its end).
  optimizer = make_optimizer(args.lr, schedule_steps(args, ckpt_dir))
  loss_fn = make_loss_fn(model)
  step = zj.make_sharded_train_step(loss_fn, optimizer, mesh=mesh, stage=args.stage,
                                    axis_name=("replica", "data"),
                                    hpz_axis="data" if args.hpz else None,
                                    quantize=quantize_option(args.quantize),
                                    precision=args.precision, max_grad_norm=1.0,
                                    stacked=in_blocks)

  # Fresh start or resume (prepare_ckpt_dir checked the directory and the flags).
  mngr = zj.CheckpointManager(ckpt_dir, max_to_keep=2)
  if args.resume is not None:
    if mngr.latest_step() is None:
      sys.exit(f"--resume: no checkpoint in {ckpt_dir}.")
    state = mngr.restore(step, params_shapes, step=None if args.resume < 0 else args.resume)
    zj.print_main(f"resumed from {ckpt_dir} at step {int(state.step)}")
  else:
    params = jax.jit(model.init)(jax.random.key(args.seed), dummy)["params"]
    state = step.init(params)
    record_run_flags(args, ckpt_dir)
  start = int(state.step)
  start_checksum = param_checksum(state)

  rows = zj.process_batch_slice(args.batch_size, step)  # this process's rows of each batch
  eval_batches = [zj.make_global_batch({k: v[rows] for k, v in get_batch(
      held, i, args.batch_size, args.seq_len, args.seed + 1).items()}, step)
                  for i in range(args.eval_batches)]

  def eval_loss(state):
    """The mean held-out loss, by ``step.evaluate`` on the split state (no update; at stage
    3 no parameter gathered whole)."""
    if not eval_batches:
      return float("nan")
    return float(np.mean([zj.metrics_to_host(step.evaluate(state, b))["loss"]
                          for b in eval_batches]))

  eval_before = eval_loss(state)
  zj.print_main(f"held-out loss at step {start}: {eval_before:.3f} nats/byte "
                f"(uniform guess: {math.log(VOCAB):.3f})")

  # Train; a preemption notice saves the step all processes reach and ends the run.
  state, losses, timing = train_loop(step, state, mngr, train, args)
  if mngr.preemption is not None:
    return stopped_for_preemption(mngr, args, argv, start, losses, state)
  if int(state.step) > start:
    mngr.save(state, force=True)
  mngr.wait_until_finished()
  timed_steps, timed_s = timing
  tokens_per_step = args.batch_size * args.seq_len
  tokens_per_s = timed_steps * tokens_per_step / timed_s if timed_s else float("nan")

  eval_after = eval_loss(state)
  if losses:
    first, last = losses[min(losses)], losses[max(losses)]
    zj.print_main(f"train loss: step {min(losses)} {first:.3f} -> step {max(losses)} {last:.3f}; "
                  f"{tokens_per_s:,.0f} tokens/s after compilation")
  zj.print_main(f"held-out loss at step {int(state.step)}: {eval_after:.3f} nats/byte "
                f"({eval_after / math.log(2):.2f} bits/byte)")
  zj.print_main(f"checkpoint: {ckpt_dir} (step {mngr.latest_step()}); continue with --resume "
                f"--steps {args.steps + 300}")
  mngr.close()

  zj.print_main()
  zj.print_main(memory_section(step, state, params_shapes, optimizer,
                global_batch(train, int(state.step), args, step), args))

  if args.sample_bytes > 0:
    zj.print_main(f"\nsampled text (temperature 0.8, prompt {args.prompt!r}):\n" + "-" * 60)
    zj.print_main(sample(step, state, mesh, model, args.prompt.encode(), args.sample_bytes,
                         args.seed))
    zj.print_main("-" * 60)
  wall = time.perf_counter() - t_start
  zj.print_main(f"wall time {wall:.1f} s")

  result = {
      "start_step": start, "step": int(state.step), "losses": losses,
      "eval_loss_before": eval_before, "eval_loss_after": eval_after,
      "tokens_per_s": tokens_per_s, "wall_s": wall, "n_devices": n, "n_params": n_params,
      "stage": args.stage, "precision": args.precision,
      "param_checksum": param_checksum(state), "start_checksum": start_checksum,
  }
  write_metrics(args, result)
  return result


if __name__ == "__main__":
  main()
