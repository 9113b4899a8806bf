"""ZeRO++ on a language model: how far each leaf's gradient moves under qwZ and qgZ.

Writes the ``zeropp-error`` section of BENCHMARKS.md (the figures of
``docs/guides/zeropp_error.md``). The model is Flax's lm1b decoder at half its width
(written here: token embedding, sinusoidal positions, pre-LayerNorm blocks of causal
self-attention without biases and a ReLU MLP, a final LayerNorm and a logit layer), trained
for a few Adam steps on one device first so that its weights are not at their
initialisation. Each configuration is stage 3 with hpZ on a (2, 4) mesh of (replica, data)
in bf16 with an fp32 master copy; one SGD step with learning rate 1 gives the applied
gradient, ``master before - master after``, and each leaf's error is
``|g - g_exact| / |g_exact|`` against the same step without quantization, for several
batches (the median over batches is reported). The exact bf16 step's own distance from a
float32 single-device gradient is the floor that rounding to bf16 already costs.

A second part (``--part accumulation``, section ``zeropp-error-accumulation``) measures qgZ's
error against gradient accumulation: 1, 2, 4 and 8 micro-batches, each micro-batch's gradient
reduce-scattered (quantized) at once (``accumulate="sharded"``, stage 2 and stage 3) or summed
locally in float32 and reduce-scattered once (``accumulate="local"``: stage 2, and stage 3 with
``gather_once=True``). In float32 on the same (2, 4) mesh, against the exact step with the
same accumulation, so that only the quantization differs.

Usage: ``python benchmarks/bench_zeropp_error.py [--quick] [--no-write]
[--part all|leaves|accumulation]``.
"""

from __future__ import annotations

import argparse
import time

import _step_common as sc  # 8 fake CPU devices, before anything touches JAX

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from _report import write_section  # noqa: E402


class Block(nn.Module):
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, x, mask):
    dense = lambda n: nn.Dense(n, kernel_init=nn.initializers.xavier_uniform(),
                               bias_init=nn.initializers.normal(1e-6))
    y = nn.SelfAttention(num_heads=self.heads, qkv_features=x.shape[-1], use_bias=False,
                         kernel_init=nn.initializers.xavier_uniform())(nn.LayerNorm()(x), mask)
    x = x + y
    return x + dense(x.shape[-1])(nn.relu(dense(self.mlp)(nn.LayerNorm()(x))))


class LM(nn.Module):
  vocab: int
  dim: int
  heads: int
  mlp: int
  layers: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.dim, embedding_init=nn.initializers.normal(1.0))(tokens)
    t = np.arange(tokens.shape[1])[:, None] / 1e4 ** (np.arange(self.dim // 2) / (self.dim // 2))
    x = x + jnp.asarray(np.concatenate([np.sin(t), np.cos(t)], -1), x.dtype)
    mask = nn.make_causal_mask(tokens)
    for i in range(self.layers):
      x = Block(self.heads, self.mlp, name=f"block_{i}")(x, mask)
    x = nn.LayerNorm(name="final_norm")(x)
    return nn.Dense(self.vocab, kernel_init=nn.initializers.xavier_uniform(), name="logits")(x)


def make_loss(model):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
  return loss_fn


def zipf_batches(rng, n, batch, length, vocab):
  """Token ids drawn from a Zipf law (text-like frequencies; lm1b itself is not here)."""
  return [(rng.zipf(1.2, size=(batch, length + 1)) - 1) % vocab for _ in range(n)]


def configs(quick: bool) -> dict:
  q = lambda **kw: zj.Quantize(**kw)
  out = {"exact": None, "qgZ B=256": q(weights=False, block_size=256)}
  for b in ((64, 256) if quick else (32, 64, 256, 1024)):
    out[f"qwZ B={b}"] = q(grads=False, block_size=b)
  out["qwZ + qgZ B=256"] = q(block_size=256)
  return out


def short(path: str) -> str:
  return path.replace("']['", "/").strip("[']")


def trained(dims: dict, length: int, steps: int, rng):
  """``(loss_fn, params)``: the model after ``steps`` Adam steps on one device."""
  model = LM(**dims)
  loss_fn = make_loss(model)
  params = model.init(jax.random.key(0), np.zeros((1, length), np.int32))["params"]
  opt = optax.adam(1e-3)
  train = jax.jit(lambda p, s, b: (lambda g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *opt.update(g, s, p)))(jax.grad(loss_fn)(p, b)))
  state = opt.init(params)
  for b in zipf_batches(rng, steps, 16, length, dims["vocab"]):
    params, state = train(params, state, b)
  return loss_fn, jax.tree.map(np.asarray, params)


def flat(tree) -> list:
  return [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)]


def applied(step, params, batches) -> list:
  """Per batch, the gradient one SGD step of learning rate 1 applied: before - after."""
  out = []
  for b in batches:
    new, _ = step(step.init(params), b)
    out.append([p0 - p1 for p0, p1 in zip(flat(params), flat(step.get_params(new)))])
  return out


def errors(gs, exact, paths) -> dict:
  """All leaves' (L2) and each leaf's relative error of ``gs`` against ``exact``, medians
  over the batches."""
  per_leaf = np.median([[np.linalg.norm(g - e) / np.linalg.norm(e) for g, e in zip(gb, eb)]
                        for gb, eb in zip(gs, exact)], axis=0)
  total = np.median([np.sqrt(sum(np.sum((g - e) ** 2) for g, e in zip(gb, eb)) /
                             sum(np.sum(e ** 2) for e in eb)) for gb, eb in zip(gs, exact)])
  return {"total": float(total), "leaves": dict(zip(map(short, paths), map(float, per_leaf)))}


def describe(dims, params, n_batches, batch, length) -> str:
  n = sum(x.size for x in jax.tree.leaves(params))
  return (f"{dims['layers']} blocks, width {dims['dim']}, MLP {dims['mlp']}, {dims['heads']} "
          f"heads, vocabulary {dims['vocab']}, {n:,} parameters; {n_batches} batches of "
          f"{batch} x {length} tokens")


def measure(args) -> dict:
  dims = dict(vocab=1024, dim=64, heads=2, mlp=256, layers=2) if args.quick else \
      dict(vocab=4096, dim=256, heads=4, mlp=1024, layers=4)
  length, batch, n_batches = (32, 16, 2) if args.quick else (64, 32, 3)
  rng = np.random.default_rng(0)
  loss_fn, params = trained(dims, length, 20 if args.quick else 100, rng)
  batches = zipf_batches(rng, n_batches, batch, length, dims["vocab"])
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  grads = {}
  for name, q in configs(args.quick).items():
    step = zj.make_sharded_train_step(loss_fn, optax.sgd(1.0), mesh=mesh, stage=3,
                                      axis_name=("replica", "data"), hpz_axis="data",
                                      precision="bf16", quantize=q)
    grads[name] = applied(step, params, batches)
  fp32 = jax.jit(jax.grad(loss_fn))
  grads["fp32, one device"] = [flat(fp32(params, b)) for b in batches]
  errs = {name: errors(gs, grads["exact"], paths) for name, gs in grads.items()
          if name != "exact"}
  return {"model": describe(dims, params, n_batches, batch, length), "errs": errs}


ACCUMULATION = {  # name: step options; the quantized step adds qgZ
    "stage 2, sharded": dict(stage=2, accumulate="sharded"),
    "stage 2, local": dict(stage=2, accumulate="local"),
    "stage 3, sharded": dict(stage=3),
    "stage 3 gather_once, local": dict(stage=3, gather_once=True, accumulate="local"),
}


def measure_accumulation(args) -> dict:
  """qgZ's error against the exact step with the same accumulation, per micro-batch count."""
  dims = dict(vocab=1024, dim=64, heads=2, mlp=256, layers=2) if args.quick else \
      dict(vocab=4096, dim=128, heads=4, mlp=512, layers=2)
  length, batch, n_batches = (16, 64, 2) if args.quick else (32, 64, 2)
  rng = np.random.default_rng(1)
  loss_fn, params = trained(dims, length, 20 if args.quick else 100, rng)
  batches = zipf_batches(rng, n_batches, batch, length, dims["vocab"])
  paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  q = zj.Quantize(weights=False, block_size=256)
  errs = {}
  for name, kw in ACCUMULATION.items():
    for k in (1, 2, 4, 8):
      make = lambda **more: zj.make_sharded_train_step(
          loss_fn, optax.sgd(1.0), mesh=mesh, axis_name=("replica", "data"),
          grad_accum_steps=k, **kw, **more)
      exact = applied(make(), params, batches)
      errs[name, k] = errors(applied(make(quantize=q), params, batches), exact, paths)
      print(name, k, f"{errs[name, k]['total']:.4f}", flush=True)
  return {"model": describe(dims, params, n_batches, batch, length), "errs": errs}


def render_accumulation(r, seconds: float) -> str:
  errs = r["errs"]
  pct = lambda v: f"{100 * v:.2f}%"
  rows = []
  for (name, k), e in errs.items():
    ls = e["leaves"]
    worst = max(ls, key=ls.get)
    rows.append([name, str(k), pct(e["total"]), pct(float(np.median(list(ls.values())))),
                 f"{pct(ls[worst])} ({worst})"])
  return "\n".join([
      "## zeropp error against accumulation: qgZ per micro-batch or once per step", "",
      f"Measured by `python benchmarks/bench_zeropp_error.py --part accumulation` on "
      f"{jax.devices()[0].platform}, 8 devices as a (2, 4) mesh of (replica, data), both data "
      f"axes, jax {jax.__version__} ({seconds / 60:.1f} min). Model: the lm1b-like decoder, "
      f"{r['model']}. float32, qgZ at B = 256 (weights exact), one SGD step; error of the "
      f"applied gradient against the exact step with the same accumulation, median over the "
      f"batches. `sharded`: each micro-batch's gradient is reduce-scattered (quantized) at "
      f"once; `local`: summed in float32 on each device, reduce-scattered once.", "",
      sc.table(["accumulation", "micro-batches", "all leaves (L2)", "median leaf",
                "worst leaf"], rows), ""])


def render(r, seconds: float) -> str:
  errs = r["errs"]
  names = list(errs)
  leaves = list(next(iter(errs.values()))["leaves"])
  pct = lambda v: f"{100 * v:.2f}%"
  rows = []
  for name in names:
    ls = errs[name]["leaves"]
    worst = max(ls, key=ls.get)
    rows.append([name, pct(errs[name]["total"]), pct(float(np.median(list(ls.values())))),
                 f"{pct(ls[worst])} ({worst})"])
  kinds = {}
  for leaf in leaves:  # one row per kind of leaf: the worst over the blocks
    kinds.setdefault(leaf.split("/", 1)[1] if leaf.startswith("block_") else leaf, []).append(leaf)
  shown = [n for n in names if n in ("fp32, one device", "qgZ B=256", "qwZ B=256",
                                     "qwZ + qgZ B=256") or n.startswith("qwZ B=")]
  per_kind = [[k] + [pct(max(errs[n]["leaves"][leaf] for leaf in group)) for n in shown]
              for k, group in kinds.items()]
  lines = [
      "## zeropp error: per-leaf gradient error of qwZ and qgZ on an lm1b-like model", "",
      f"Measured by `python benchmarks/bench_zeropp_error.py` on {jax.devices()[0].platform}, "
      f"8 devices as a (2, 4) mesh, jax {jax.__version__} ({seconds / 60:.1f} min). Model: "
      f"Flax lm1b's decoder at half width: {r['model']}; stage 3, hpZ, bf16 with an fp32 "
      f"master, one SGD step. Error of the applied gradient against the same step "
      f"without quantization, median over the batches. The `fp32, one device` row is "
      f"the exact bf16 step's own distance from a float32 gradient on one device: what "
      f"bf16 already costs.", "",
      sc.table(["configuration", "all leaves (L2)", "median leaf", "worst leaf"], rows), "",
      "Per kind of leaf, the worst over the blocks:", "",
      sc.table(["leaf"] + shown, per_kind), ""]
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="a smaller model (a smoke test)")
  p.add_argument("--no-write", action="store_true", help="print only")
  p.add_argument("--part", choices=("all", "leaves", "accumulation"), default="all",
                 help="leaves: the per-leaf table; accumulation: error against micro-batches")
  args = p.parse_args()
  parts = {"leaves": ("zeropp-error", measure, render),
           "accumulation": ("zeropp-error-accumulation", measure_accumulation,
                            render_accumulation)}
  for part, (section, run, show) in parts.items():
    if args.part not in ("all", part):
      continue
    t0 = time.perf_counter()
    text = show(run(args), time.perf_counter() - t0)
    print(text)
    if not args.no_write:
      write_section(section, text)


if __name__ == "__main__":
  main()
