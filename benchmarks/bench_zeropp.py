"""ZeRO++ (hpZ, qwZ, qgZ): bytes across and within "hosts", and step time, side by side.

Writes the ``zeropp`` section of BENCHMARKS.md. On 8 CPU devices split as 2 "hosts" x 4
(a ``(2, 4)`` mesh of ``("replica", "data")``; devices 0-3 and 4-7), one model at stage 3:

* flat ZeRO-3 over all 8 devices; hybrid ZeRO-3 (state split within a host, replicated
  across); hpZ (``hpz_axis="data"``: optimizer state over all 8, parameters gathered within
  a host); hpZ with int8 weights and gradients (``quantize=zj.Quantize()``), and with int4
  gradients.

Bytes are read from the compiled programs (every collective, its device groups and its
result dtype; ring algorithms as in the ``meshes`` section: a reduce-scatter over G devices
sends (G-1)/G of its input, an all-gather (G-1)/G of its output, an all-reduce twice that,
an all-to-all (G-1)/G of its buffer). Step times are interleaved rounds on the fake CPU
devices, where the network is free and quantizing costs real compute.

A second table checks the rule that a quantized step never sends more than the exact one
(a leaf's share too short to gain travels exactly) on models of many small leaves: an MLP
6 x 24^2, a 41-leaf transformer of width 12, and GPT-2 small's 148 leaves (124M
parameters), whose step is lowered and compiled on abstract shapes (``step.abstract_state``:
nothing is allocated), hpZ in bf16 against hpZ + int8 weights and gradients (and int4
gradients), all at ``block_size=256``.

Usage: ``python benchmarks/bench_zeropp.py [--quick] [--no-write]``.
"""

from __future__ import annotations

import os

import _step_common as sc  # 8 fake CPU devices, before anything touches JAX

import jax  # noqa: E402
import optax  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import zero_jax as zj  # noqa: E402
from bench_meshes import crosses_hosts, ring_sent  # noqa: E402
from bench_zeropp_error import LM  # noqa: E402
from zero_jax.comm import hlo as hlo_lib  # noqa: E402

BASE = "hybrid fp32"
INTER_GBPS, INTRA_GBPS = 50.0, 900.0  # 400 Gb/s between hosts; NVLink-class within


def configs() -> dict:
  flat = {"axis_name": ("replica", "data")}
  hpz = {"axis_name": ("replica", "data"), "hpz_axis": "data"}
  return {
      "flat ZeRO-3 fp32": flat,
      BASE: {"axis_name": "data", "replica_axis": "replica"},
      "hpZ fp32": hpz,
      "hybrid bf16": {"axis_name": "data", "replica_axis": "replica", "precision": "bf16"},
      "hpZ bf16": {**hpz, "precision": "bf16"},
      "hpZ + qwZ + qgZ (int8) bf16": {**hpz, "precision": "bf16", "quantize": zj.Quantize()},
      "hpZ + qwZ + qgZ (int4 grads) bf16": {**hpz, "precision": "bf16",
                                            "quantize": zj.Quantize(grad_bits=4)},
  }


def traffic(colls) -> dict:
  big = [c for c in colls if c.nbytes > 64]  # not the loss and norm scalars
  cross = sum(ring_sent(c) for c in big if crosses_hosts(c))
  inside = sum(ring_sent(c) for c in big if not crosses_hosts(c))
  int8 = sorted({c.op for c in big if "s8[" in c.shape_text or "u8[" in c.shape_text})
  return {"cross_mib": cross / sc.MIB, "within_mib": inside / sc.MIB, "int8_ops": int8}


def measure(args) -> dict:
  width, layers = (128, 2) if args.quick else (512, 4)
  rounds, iters = (4, 2) if args.quick else (11, 3)
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  params = sc.init_mlp(jax.random.key(0), [width] * (layers + 1))
  batch = sc.make_batches(jax.random.key(1), 1, 64, width, width)[0]
  out = {"model": f"MLP {layers} x {width}^2, Adam, batch 64, {sc.n_params(params):,} "
                  f"params", "n_params": sc.n_params(params)}
  steps, states = {}, {}
  for name, kw in configs().items():
    step = zj.make_sharded_train_step(sc.mlp_loss, optax.adam(1e-3), mesh=mesh, stage=3, **kw)
    states[name], steps[name] = step.init(params), step
    if not args.timing_only:
      colls = hlo_lib.collectives(step.lower(states[name], batch).compile().as_text())
      out.setdefault("traffic", {})[name] = traffic(colls)
      out.setdefault("params_mib", {})[name] = sc.bytes_per_device(states[name].params) / sc.MIB
      out.setdefault("state_mib", {})[name] = sc.bytes_per_device(
          (states[name].opt_state, states[name].master)) / sc.MIB
  if not args.timing_only:
    out["models"] = model_bytes(args)
  t = sc.interleave(sc.steppers(steps, states, batch), rounds=rounds, iters=iters)
  out["times"] = {k: sc.spread(v) for k, v in t.items()}
  out["ratios"] = {k: sc.ratio_iqr(t, k, BASE) for k in t}
  return out


# ------------------------------------------------ many small leaves: never above exact
def _gpt2(layers=12, d=768, vocab=50257, ctx=1024, heads=12):
  """GPT-2 small's parameter shapes (abstract) and a loss over them."""
  f = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  norm = lambda: {"scale": f(d), "bias": f(d)}
  dense = lambda a, b: {"kernel": f(a, b), "bias": f(b)}
  params = {"wte": f(vocab, d), "wpe": f(ctx, d), "ln_f": norm()}
  for i in range(layers):
    params[f"h{i:02d}"] = {"ln_1": norm(), "c_attn": dense(d, 3 * d), "c_proj": dense(d, d),
                           "ln_2": norm(), "c_fc": dense(d, 4 * d), "mlp_proj": dense(4 * d, d)}

  def loss(p, tokens):
    ln = lambda x, n: (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(
        x.var(-1, keepdims=True) + 1e-5) * n["scale"] + n["bias"]
    lin = lambda x, n: x @ n["kernel"] + n["bias"]
    t = tokens.shape[1] - 1
    x = (p["wte"][tokens[:, :-1]] + p["wpe"][:t]).astype(p["wte"].dtype)
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(layers):
      h = p[f"h{i:02d}"]
      q, k, v = jnp.split(lin(ln(x, h["ln_1"]), h["c_attn"]).reshape(
          x.shape[0], t, 3 * heads, d // heads), 3, axis=2)
      a = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads), -1e4)
      y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(a, -1), v).reshape(x.shape)
      x = x + lin(y, h["c_proj"])
      x = x + lin(jax.nn.gelu(lin(ln(x, h["ln_2"]), h["c_fc"])), h["mlp_proj"])
    logits = (ln(x, p["ln_f"]) @ p["wte"].T).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
  return loss, params, jax.ShapeDtypeStruct((8, 17), jnp.int32)


def _small_models(quick: bool) -> dict:
  mlp = sc.init_mlp(jax.random.key(2), [24] * 7)
  mlp_batch = sc.make_batches(jax.random.key(3), 1, 64, 24, 24)[0]
  lm = LM(vocab=16, dim=12, heads=2, mlp=24, layers=3)
  tokens = np.zeros((16, 9), np.int32)
  lm_params = jax.tree.map(np.asarray, lm.init(jax.random.key(0), tokens[:1, :-1])["params"])

  def lm_loss(p, t):
    logits = lm.apply({"params": p}, t[:, :-1]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, 1:, None], -1))
  out = {"MLP 6 x 24^2": (sc.mlp_loss, mlp, mlp_batch),
         "transformer, width 12": (lm_loss, lm_params, tokens)}
  if not quick:
    out["GPT-2 small (abstract)"] = _gpt2()
  return out


def model_bytes(args) -> dict:
  """Per model: leaves, parameters, and per configuration the bytes (across, within)."""
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  hpz = {"axis_name": ("replica", "data"), "hpz_axis": "data", "precision": "bf16"}
  cfgs = {"hpZ bf16 (exact)": None, "int8": zj.Quantize(), "int4 grads": zj.Quantize(grad_bits=4)}
  out = {}
  for name, (loss, params, batch) in _small_models(args.quick).items():
    leaves = jax.tree.leaves(params)
    row = {"leaves": len(leaves), "params": int(sum(np.prod(x.shape) for x in leaves))}
    for cfg, q in cfgs.items():
      step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh, stage=3, quantize=q,
                                        **hpz)
      state = step.abstract_state(params)
      tr = traffic(hlo_lib.collectives(step.lower(state, batch).compile().as_text()))
      row[cfg] = (tr["cross_mib"], tr["within_mib"])
    out[name] = row
  return out


def _models_table(models) -> list:
  rows = []
  for name, r in models.items():
    exact = r["hpZ bf16 (exact)"]
    cells = [name, str(r["leaves"]), f"{r['params']:,}", f"{exact[0] * 1024:.1f}"]
    for cfg in ("int8", "int4 grads"):
      cells += [f"{r[cfg][0] * 1024:.1f}", f"{r[cfg][0] / exact[0]:.3f}",
                f"{r[cfg][1] / exact[1]:.3f}"]
    rows.append(cells)
  return ["Never more than the exact step: per device and step, hpZ in bf16 against the same "
          "step with int8 weights and gradients (and int4 gradients), `block_size=256`:", "",
          sc.table(["model", "leaves", "params", "exact KiB between hosts", "int8 KiB",
                    "int8 vs exact, between", "int8 vs exact, within", "int4 KiB",
                    "int4 vs exact, between", "int4 vs exact, within"], rows), ""]


def _gpu_ms(tr) -> float:
  """Communication time per step from the bytes at the stated link speeds (no overlap)."""
  return (tr["cross_mib"] * sc.MIB / (INTER_GBPS * 1e9) +
          tr["within_mib"] * sc.MIB / (INTRA_GBPS * 1e9)) * 1e3


def render(results, args, seconds) -> str:
  first = next(iter(results.values()))
  tr, base = first["traffic"], first["traffic"][BASE]["cross_mib"]
  lines = sc.header(
      "zeropp: ZeRO++ hpZ, qwZ and qgZ across two hosts", "bench_zeropp.py", results, seconds,
      f"Model: {first['model']}, stage 3 on a (2, 4) mesh of (replica, data); hosts: devices "
      f"0-3 and 4-7.")
  lines += ["Per device and step, from the compiled programs:", "", sc.table(
      ["configuration", "MiB between hosts", "vs hybrid fp32", "MiB within hosts",
       "params held MiB", "optimizer state + master MiB", "int8/int4 collectives",
       f"comm ms at {INTER_GBPS * 8:.0f} Gb/s + {INTRA_GBPS:.0f} GB/s"],
      [[k, f"{v['cross_mib']:.3f}", f"{v['cross_mib'] / base:.3f}", f"{v['within_mib']:.3f}",
        f"{first['params_mib'][k]:.2f}", f"{first['state_mib'][k]:.2f}",
        ", ".join(v["int8_ops"]) or "-", f"{_gpu_ms(v):.3f}"]
       for k, v in tr.items()]), ""]
  lines += _models_table(first["models"])
  for cond, r in results.items():
    lines += [f"Step time, {sc.CONDITION_TEXT[cond]}:", "",
              sc.table(["configuration", "ms / step", "vs hybrid fp32"],
                       [[k, r["times"][k], r["ratios"][k]] for k in r["times"]]), ""]
  q = tr["hpZ + qwZ + qgZ (int8) bf16"]["cross_mib"]
  q4 = tr["hpZ + qwZ + qgZ (int4 grads) bf16"]["cross_mib"]
  lines += [
      f"hpZ alone sends what hybrid sends across the hosts (its gradient's second "
      f"reduce-scatter hop and the refresh of the secondary copy move as many bytes as "
      f"hybrid's all-reduce of the 1/4 block), but it splits the optimizer state and master "
      f"copy over all 8 devices where hybrid splits them over 4, and its per-layer gathers "
      f"stay within a host where flat ZeRO-3's cross it. With int8 weights and gradients "
      f"each device sends {q:.3f} MiB between the hosts per step, {q / base:.3f}x of hybrid "
      f"fp32's {base:.3f} MiB: a quarter, plus the float32 scale of every 256 values "
      f"(4/256 = 1.6%); with int4 gradients {q4:.3f} MiB, {q4 / base:.3f}x. Within the hosts "
      f"the int8 gathers and all-to-alls cut the bytes by the same factor. (XLA:CPU carries "
      f"bfloat16 reductions as float32, so the bf16 rows move the fp32 rows' bytes here; on "
      f"a GPU they would halve.)", "",
      f"What a GPU cluster would see: the last column is the time the bytes take at "
      f"{INTER_GBPS * 8:.0f} Gb/s per device between hosts and {INTRA_GBPS:.0f} GB/s within "
      f"(NVLink class), without overlap; across hosts it is the bytes times "
      f"{1e3 * sc.MIB / (INTER_GBPS * 1e9):.4f} ms/MiB, so int8 cuts the cross-host time by "
      f"the byte ratio above, about 4x, for a model whose step is bound by that link. On the "
      f"fake CPU devices the network is free and quantizing is real work (an absmax, a "
      f"divide and a round per value, on every hop), so the quantized steps are slower "
      f"here; no GPU was available to measure the saving.", ""]
  return "\n".join(lines)


if __name__ == "__main__":
  sc.main(__doc__, os.path.abspath(__file__), measure, render, "zeropp")
