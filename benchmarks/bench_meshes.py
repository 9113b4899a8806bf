"""Meshes: flat ZeRO-2, hybrid sharding and data x model parallelism, side by side.

Writes the ``meshes`` section of BENCHMARKS.md. On 8 CPU devices, one model three ways:

* ``(8,)`` ZeRO-2: batch and state split over all 8 devices;
* ``(2, 4)`` hybrid: ``replica_axis="replica"``, state split over the 4 devices of a
  "host" (devices 0-3 and 4-7) and replicated across the two;
* ``(4, 2)`` data x model: ``param_specs`` with Megatron-style column/row splits over
  "model", state split over data x model.

For each: the step time (interleaved rounds, median and IQR), every collective of the
compiled program with the size of its device groups and its bytes, and the bytes each
device sends between the two hosts per step (ring algorithms: a reduce-scatter over G
devices sends (G-1)/G of its input, an all-gather (G-1)/G of its output, an all-reduce
twice that) — what would cross the network if each half were one host.

Usage: ``python benchmarks/bench_meshes.py [--quick] [--no-write]``.
"""

from __future__ import annotations

import os

import _step_common as sc  # 8 fake CPU devices, before anything touches JAX

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.comm import hlo as hlo_lib  # noqa: E402

HOSTS = ({0, 1, 2, 3}, {4, 5, 6, 7})


def megatron_specs(params) -> dict:
  """Even layers column-parallel, odd layers row-parallel (bias replicated)."""
  specs = {}
  for i, name in enumerate(sorted(params)):
    specs[name] = ({"w": P(None, "model"), "b": P("model")} if i % 2 == 0 else
                   {"w": P("model", None), "b": P()})
  return specs


def configs(params):
  return {
      "(8,) ZeRO-2": (jax.make_mesh((8,), ("data",)), {}),
      "(2, 4) hybrid": (jax.make_mesh((2, 4), ("replica", "data")), {"replica_axis": "replica"}),
      "(4, 2) data x model": (jax.make_mesh((4, 2), ("data", "model")),
                              {"param_specs": megatron_specs(params)}),
  }


def ring_sent(c: hlo_lib.Collective) -> float:
  """Bytes one device sends for collective ``c`` with ring algorithms."""
  g = len(c.groups[0]) if c.groups else 1
  if g <= 1:
    return 0.0
  if c.op == "reduce-scatter":
    return (g - 1) * c.nbytes
  if c.op == "all-gather":
    return (g - 1) / g * c.nbytes
  if c.op == "all-reduce":
    return 2 * (g - 1) / g * c.nbytes
  if c.op == "all-to-all":
    return (g - 1) / g * c.nbytes
  return float(c.nbytes)


def crosses_hosts(c: hlo_lib.Collective) -> bool:
  return bool(c.groups) and any(not (set(g) <= HOSTS[0] or set(g) <= HOSTS[1])
                                for g in c.groups)


def describe(colls) -> list:
  rows = {}
  for c in colls:
    key = (c.op, len(c.groups[0]) if c.groups else "?")
    n, b = rows.get(key, (0, 0))
    rows[key] = (n + 1, b + c.nbytes)
  return [f"{op} x{n} over groups of {g}: {b / sc.MIB:.3f} MiB" for (op, g), (n, b) in
          sorted(rows.items(), key=str)]


def measure(args) -> dict:
  width, layers = (128, 2) if args.quick else (512, 4)
  rounds, iters = (4, 2) if args.quick else (15, 3)
  params = sc.init_mlp(jax.random.key(0), [width] * (layers + 1))
  batch = sc.make_batches(jax.random.key(1), 1, 64, width, width)[0]
  steps, states, out = {}, {}, {"model": f"MLP {layers} x {width}^2, Adam, batch 64, "
                                         f"{sc.n_params(params):,} params"}
  for name, (mesh, kw) in configs(params).items():
    step = zj.make_sharded_train_step(sc.mlp_loss, optax.adam(1e-3), mesh=mesh, **kw)
    states[name] = step.init(params)
    steps[name] = step
    colls = hlo_lib.collectives(step.lower(states[name], batch).compile().as_text())
    big = [c for c in colls if c.nbytes > 64]  # not the loss and norm scalars
    out.setdefault("collectives", {})[name] = describe(big)
    out.setdefault("cross_host_mib", {})[name] = sum(
        ring_sent(c) for c in big if crosses_hosts(c)) / sc.MIB
    out.setdefault("all_mib", {})[name] = sum(ring_sent(c) for c in big) / sc.MIB
    out.setdefault("state_mib", {})[name] = sc.bytes_per_device(states[name].opt_state) / sc.MIB
  t = sc.interleave(sc.steppers(steps, states, batch), rounds=rounds, iters=iters)
  out["times"] = {k: sc.spread(v) for k, v in t.items()}
  out["ratios"] = {k: sc.ratio_iqr(t, k, "(8,) ZeRO-2") for k in t}
  out["grad_mib"] = sc.n_params(params) * 4 / sc.MIB
  return out


def render(results, args, seconds) -> str:
  first = next(iter(results.values()))
  lines = sc.header(
      "meshes: flat ZeRO-2, hybrid (replica_axis) and data x model (param_specs)",
      "bench_meshes.py", results, seconds,
      f"Model: {first['model']}; the gradient is {first['grad_mib']:.2f} MiB. Hosts: devices "
      f"0-3 and 4-7 (the hybrid mesh's replica rows).")
  for cond, r in results.items():
    lines += [f"Step time, {sc.CONDITION_TEXT[cond]}:", "",
              sc.table(["mesh", "ms / step", "vs (8,) ZeRO-2"],
                       [[k, r["times"][k], r["ratios"][k]] for k in r["times"]]), ""]
  lines += ["Per device and step (ring algorithms), and the optimizer state each device holds:",
            "", sc.table(["mesh", "MiB sent, all collectives", "MiB sent between the hosts",
                          "optimizer state MiB", "collectives (result bytes)"],
                         [[k, f"{first['all_mib'][k]:.2f}", f"{first['cross_host_mib'][k]:.2f}",
                           f"{first['state_mib'][k]:.2f}", "; ".join(first["collectives"][k])]
                          for k in first["times"]]), ""]
  flat, hyb = first["cross_host_mib"]["(8,) ZeRO-2"], first["cross_host_mib"]["(2, 4) hybrid"]
  lines += [f"Hybrid sharding sends {hyb:.2f} MiB per device between the hosts per step against "
            f"{flat:.2f} MiB for flat ZeRO-2 ({hyb / flat:.2f}x): only each device's 1/4 "
            f"block of the gradient is all-reduced across the replica axis; the reduce-scatter "
            f"and all-gather stay within a host.", "",
            "The step times are those of 8 fake devices sharing 2 CPU cores, where the network "
            "costs nothing and every collective is a rendezvous of threads: the hybrid step "
            "has one more (the all-reduce across the replica axis, after the reduce-scatter) "
            "and each device updates twice the state (1/4 of it, not 1/8: each replica group "
            "updates its own copy), so it is slower here; its compiled program is otherwise "
            "the flat one. What it saves, the bytes between hosts, only shows on a real "
            "network, and no multi-host machine was available to this work. The data x model "
            "mesh is faster here because each device's matmuls are half as large.", ""]
  return "\n".join(lines)


if __name__ == "__main__":
  sc.main(__doc__, os.path.abspath(__file__), measure, render, "meshes")
