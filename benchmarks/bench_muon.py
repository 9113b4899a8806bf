"""Muon at ZeRO scale: ``whole_leaf_update=`` vs today's split Muon step vs the AdamW step.

Writes the ``muon`` section of BENCHMARKS.md. On 8 fake CPU devices, ZeRO-2 in float32,
an MLP of four 512 x 512 matrices (batch 64):

* **AdamW**: ``optax.adamw``, the elementwise baseline;
* **Muon, split**: ``optax.contrib.muon`` on the split layout (XLA partitions each
  Newton-Schulz matmul into collectives);
* **Muon, whole_leaf_update**: each matrix moved to its home device with one all-to-all,
  orthogonalised there once, its update moved back with one all-to-all.

Bytes are read from the compiled programs (ring algorithms: `zero_jax.comm.hlo.sent_bytes`),
peak memory from XLA's ``memory_analysis()``, step times are interleaved rounds (medians and
interquartile ranges of the per-round times and of the per-round ratios). On CPU the
"network" is memory copies, so the times weigh compute more than a GPU cluster would. A
second table compiles GPT-2 small's shapes (124M parameters, abstract: nothing allocated),
the 48 block matrices moved home, the embeddings and vectors on Muon's Adam.

A third table gives the bytes with weight decay at stages 2 and 3, in float32 and bf16 (where
the parameter moves home too).

Usage: ``python benchmarks/bench_muon.py [--quick] [--no-write]``.
"""

from __future__ import annotations

import argparse

import _step_common as sc  # 8 fake CPU devices, before anything touches JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from optax.contrib import MuonDimensionNumbers  # noqa: E402

import zero_jax as zj  # noqa: E402
from _report import machine, write_section  # noqa: E402
from zero_jax.comm import hlo  # noqa: E402

WIDTH, DEPTH, BATCH = 512, 4, 64


def mlp_loss(p, b):
  h = b["x"]
  for k in sorted(p):
    h = jnp.tanh(h @ p[k])
  return jnp.mean((h - b["y"]) ** 2)


def variants() -> dict:
  return {"AdamW": (optax.adamw(1e-3), {}),
          "Muon, split": (optax.contrib.muon(1e-3), {}),
          "Muon, whole_leaf_update": (optax.contrib.muon(1e-3), {"whole_leaf_update": True})}


def compiled_figures(step, params, batch) -> tuple[float, int, float]:
  """(MiB sent per device, collectives, peak MiB) of the compiled step."""
  compiled = step.lower(step.abstract_state(params), batch).compile()
  colls = hlo.collectives(compiled.as_text())
  stats = compiled.memory_analysis()
  peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
          - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  return sum(hlo.sent_bytes(c) for c in colls) / sc.MIB, len(colls), peak / sc.MIB


def mlp_section(mesh, rounds: int, iters: int) -> str:
  r = np.random.default_rng(0)
  params = {f"w{i}": (r.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
            for i in range(DEPTH)}
  batch = {"x": r.normal(size=(BATCH, WIDTH)).astype(np.float32),
           "y": r.normal(size=(BATCH, WIDTH)).astype(np.float32)}
  steps, states, rows = {}, {}, []
  for name, (opt, kw) in variants().items():
    steps[name] = zj.make_sharded_train_step(mlp_loss, opt, mesh=mesh, **kw)
    states[name] = steps[name].init(params)
    rows.append([name, *compiled_figures(steps[name], params, batch)])
  base = rows[0][1]
  times = sc.interleave(sc.steppers(steps, states, batch), rounds=rounds, iters=iters)
  table = sc.table(
      ["step", "MiB sent per device", "vs AdamW", "collectives", "peak MiB per device",
       "step ms, median (IQR)", "time vs AdamW", "time vs Muon split"],
      [[name, f"{mib:.2f}", f"{mib / base:.3f}x", n, f"{peak:.2f}", sc.spread(times[name]),
        sc.ratio_iqr(times, name, "AdamW"), sc.ratio_iqr(times, name, "Muon, split")]
       for name, mib, n, peak in rows])
  return (f"Four {WIDTH} x {WIDTH} matrices, batch {BATCH}, ZeRO-2 float32 on 8 devices; "
          f"{rounds} interleaved rounds of {iters} steps. The fake devices share the host's "
          f"cores, so a step's time is the work of all devices together: each matrix "
          f"orthogonalised once either way, the whole-leaf step saves the partitioned "
          f"matmuls' collectives, not the per-device time a cluster would.\n\n" + table)


DECAY = 0.1


def decay_section(mesh) -> str:
  """Bytes when the update reads the parameter (weight decay) and no device holds it whole:
  at stage 3, or with a master copy (bf16), the parameter takes a third all-to-all home."""
  params = {f"w{i}": jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32) for i in range(DEPTH)}
  batch = {k: jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.float32) for k in ("x", "y")}
  rows = []
  for stage, precision in [(2, "fp32"), (3, "fp32"), (2, "bf16"), (3, "bf16")]:
    make = lambda opt, **kw: zj.make_sharded_train_step(mlp_loss, opt, mesh=mesh, stage=stage,
                                                        precision=precision, **kw)
    base = compiled_figures(make(optax.adamw(1e-3, weight_decay=DECAY)), params, batch)[0]
    step = make(optax.contrib.muon(1e-3, ns_steps=1, weight_decay=DECAY), whole_leaf_update=True)
    text = step.lower(step.abstract_state(params), batch).compile().as_text()
    colls = hlo.collectives(text)
    mib = sum(hlo.sent_bytes(c) for c in colls) / sc.MIB
    rows.append([stage, precision, f"{base:.3f}", f"{mib:.3f}", f"{mib / base:.3f}x",
                 sum(c.op == "all-to-all" for c in colls)])
  return (f"With weight decay ({DECAY}, AdamW's and Muon's), compiled: the update reads the "
          f"parameter, which is whole on every device at stage 2 in float32 and otherwise "
          f"moves home with a third all-to-all. Four {WIDTH} x {WIDTH} matrices on 8 devices "
          f"(fewer than the devices: empty home slots travel too).\n\n" + sc.table(
              ["stage", "precision", "AdamW MiB per device", "Muon, whole_leaf_update MiB",
               "vs AdamW", "all-to-alls"], rows))


def gpt2_section(mesh) -> str:
  d, s = 768, lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  block = {"ln1": s(d), "attn": s(d, 3 * d), "attn_b": s(3 * d), "proj": s(d, d),
           "proj_b": s(d), "ln2": s(d), "fc": s(d, 4 * d), "fc_b": s(4 * d),
           "mlp": s(4 * d, d), "mlp_b": s(d)}
  params = {"wte": s(50257, d), "wpe": s(1024, d), "h": [dict(block) for _ in range(12)]}
  matrix = lambda path, x: x.ndim == 2 and "'h'" in jax.tree_util.keystr(path)
  dims = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, x: MuonDimensionNumbers() if matrix(path, x) else None, p)
  loss = lambda p, b: sum(jnp.sum(x * x) for x in jax.tree.leaves(p)) * jnp.mean(b["x"])
  batch = {"x": s(8)}
  muon = lambda **kw: optax.contrib.muon(1e-3, muon_weight_dimension_numbers=dims, **kw)
  rows = []
  for label, kw in [("", {}), (", weight decay, stage 3", {"weight_decay": DECAY})]:
    extra = {"stage": 3} if kw else {}
    steps = [("AdamW" + label, optax.adamw(1e-3, **kw), {}),
             ("Muon, whole_leaf_update" + label, muon(**kw), {"whole_leaf_update": matrix})]
    for i, (name, opt, options) in enumerate(steps):
      step = zj.make_sharded_train_step(loss, opt, mesh=mesh, **options, **extra)
      mib, n, peak = compiled_figures(step, params, batch)
      base = mib if i == 0 else base
      rows.append([name, f"{mib:.1f}", f"{mib / base:.3f}x", n, f"{peak:.0f}"])
  return ("GPT-2 small's shapes (124M parameters; the 48 block matrices moved home), ZeRO-2 "
          "float32 on 8 devices (and stage 3 with weight decay), compiled on abstract shapes; "
          "each Muon row against the AdamW row above it.\n\n" + sc.table(
              ["step", "MiB sent per device", "vs AdamW", "collectives", "peak MiB per device"],
              rows))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--quick", action="store_true", help="fewer rounds, no GPT-2 table")
  parser.add_argument("--no-write", action="store_true")
  args = parser.parse_args()
  mesh = jax.make_mesh((8,), ("data",))
  rounds, iters = (5, 3) if args.quick else (15, 10)
  parts = ["## muon: whole_leaf_update vs the split Muon step vs AdamW", "",
           f"Measured on {machine()}. `python benchmarks/bench_muon.py`.", "",
           mlp_section(mesh, rounds, iters), "", decay_section(mesh)]
  if not args.quick:
    parts += ["", gpt2_section(mesh)]
  text = "\n".join(parts)
  print(text)
  if not args.no_write:
    write_section("muon", text)


if __name__ == "__main__":
  main()
