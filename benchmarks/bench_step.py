"""Step time and memory of zero_jax stages 1-2 against plain DP and a jit-annotated step.

On one 8-device mesh and one process, with Adam and a GELU MLP of a few million
parameters, this times (interleaved rounds, medians and paired ratios):

- ``zj-s1`` / ``zj-s2``: ``zj.make_sharded_train_step(..., stage=1 / 2)``;
- ``dp``: plain data parallelism, a ``shard_map`` step whose gradients are
  ``pmean``ed and whose optax update runs replicated on every device;
- ``jit``: one ``jax.jit``, parameters replicated, batch sharded, optimizer
  state sharded over the data axis by ``in_shardings``/``out_shardings``;
- ``jit+g``: the same with the gradient also constrained to that sharding.

It reports per-device optimizer-state bytes (from the arrays' shards), XLA's
``memory_analysis()`` and the collectives in each compiled program, checks that
all variants give the same losses for a few steps, and writes the "core"
section of BENCHMARKS.md.

Usage:
  python benchmarks/bench_step.py [--quick] [--no-write]
"""

from __future__ import annotations

import time

import _step_common as sc  # first: sets up 8 CPU devices
from _report import machine, write_section

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

zj = sc.zj


def build(mesh, params, optimizer):
  """Every variant as (init, step, lower) closures sharing one calling convention."""
  variants = {}
  for stage in (1, 2):
    step = zj.make_sharded_train_step(sc.mlp_loss, optimizer, mesh=mesh, stage=stage)

    def init(step=step):
      return step.init(params)

    def run(state, batch, step=step):
      state, m = step(state, batch)
      return state, m["loss"]

    variants[f"zj-s{stage}"] = (init, run, lambda s, b, step=step: step.lower(s, b),
                                lambda s: s.opt_state)
  for name, (init_b, step_b) in {
      "dp": sc.make_dp_step(sc.mlp_loss, optimizer, mesh),
      "jit": sc.make_jit_step(sc.mlp_loss, optimizer, mesh),
      "jit+g": sc.make_jit_step(sc.mlp_loss, optimizer, mesh, shard_grads=True)}.items():

    def run(state, batch, step_b=step_b):
      p, o, loss = step_b(state[0], state[1], batch)
      return (p, o), loss

    variants[name] = (lambda init_b=init_b: init_b(params), run,
                      lambda s, b, step_b=step_b: step_b.lower(s[0], s[1], b),
                      lambda s: s[1])
  return variants


def main():
  args = sc.parser(__doc__).parse_args()
  t_start = time.perf_counter()
  if args.quick:
    sizes, batch_size, rounds, iters = [256, 512, 512, 256], 64, 5, 2
  else:
    sizes, batch_size, rounds, iters = [512, 1024, 1024, 1024, 1024, 512], 64, 15, 3
  mesh = sc.mesh_of(8)
  params = sc.init_mlp(jax.random.key(0), sizes)
  psi = sc.n_params(params)
  optimizer = optax.adam(1e-3)
  batches = [sc.place_batch(b, mesh)
             for b in sc.make_batches(jax.random.key(1), 4, batch_size, sizes[0], sizes[-1])]
  variants = build(mesh, params, optimizer)

  # Sanity: same losses over a few steps from the same parameters.
  losses, states, mem, opt_bytes, colls = {}, {}, {}, {}, {}
  for name, (init, run, lower, opt_of) in variants.items():
    state = init()
    opt_bytes[name] = sc.bytes_per_device(opt_of(state))
    compiled = lower(state, batches[0]).compile()
    mem[name] = sc.memory(compiled)
    colls[name] = sc.collectives_str(compiled.as_text())
    ls = []
    for b in batches:
      state, loss = run(state, b)
      ls.append(float(loss))
    losses[name], states[name] = ls, state
  ref = np.array(losses["dp"])
  max_dev = max(float(np.max(np.abs(np.array(v) - ref) / np.abs(ref))) for v in losses.values())
  print("losses:", {k: [f"{x:.6f}" for x in v] for k, v in losses.items()})
  assert max_dev < 1e-4, f"variants disagree on the loss: relative deviation {max_dev:.2e}"

  def timed(name):
    run = variants[name][1]

    def go():
      states[name], loss = run(states[name], batches[0])
      jax.block_until_ready((states[name], loss))
    return go

  go = {name: timed(name) for name in variants}
  for f in go.values():  # warm up
    f()
  times = sc.interleave(go, rounds=rounds, iters=iters)

  rows = []
  for name in variants:
    m = mem[name]
    rows.append([f"`{name}`", sc.spread(times[name]), sc.ratio_iqr(times, name, "dp"),
                 sc.ratio_iqr(times, name, "jit"), sc.mib(opt_bytes[name]), sc.mib(m["arg"]),
                 sc.mib(m["out"]), sc.mib(m["temp"]), colls[name]])
  header = ["variant", "step ms, median (IQR)", "time / dp", "time / jit",
            "opt state MiB/device", "XLA arg MiB", "XLA out MiB", "XLA temp MiB",
            "collectives in the compiled step (count, result bytes)"]
  tab = sc.table(header, rows)
  print(tab)
  r1, r2 = sc.median_ratio(times, "zj-s1", "dp"), sc.median_ratio(times, "zj-s2", "dp")
  text = f"""## core: zero_jax stages 1-2 vs plain DP and a jit-annotated step

Machine: {machine()}. Model: GELU MLP {sizes} (Ψ = {psi:,} fp32 parameters, {psi * 4 / sc.MIB:.1f} MiB),
Adam, global batch {batch_size} ({batch_size // 8} per device), 8 devices on one `data` axis.
`dp`: `shard_map` step, `pmean` of the gradients, optax update replicated on every device.
`jit`: one `jax.jit`, params replicated, batch sharded, Adam state sharded over `data` via
in/out shardings. `jit+g`: the same with the gradient constrained to the state's sharding.
The machine's 2 cores are shared with other jobs, so absolute times are noisy: the variants
run interleaved ({rounds} rounds x {iters} steps, order rotated each round) in one process;
ratios are the median (and IQR) over rounds of the paired per-round ratio. Memory is per
device: optimizer state from the arrays' addressable shards, the rest from XLA's
`compiled.memory_analysis()` (`arg` includes params and the donated state; `out` aliases it).
Losses after {len(batches)} steps agree across all variants to {max_dev:.1e} (relative).
`python benchmarks/bench_step.py{' --quick' if args.quick else ''}` ({time.perf_counter() - t_start:.0f} s).

{tab}

zero_jax stage 1 / DP = {r1:.2f}, stage 2 / DP = {r2:.2f} (median paired ratios).
"""
  print(text)
  if not args.no_write:
    write_section("core", text)
  return times, mem, colls


if __name__ == "__main__":
  main()
