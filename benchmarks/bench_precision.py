"""Per-device memory of zero_jax's precision policies next to the ZeRO paper's formulas.

For ``precision`` in fp32 / bf16 / fp16 / fp16_memory_efficient and stages 1-2
on 8 devices, with Adam and a GELU MLP of a few million parameters, this reads
the per-device bytes of the state's parts (parameters, fp32 master copy, Adam
moments) off the arrays' addressable shards, and XLA's ``memory_analysis()`` of
the compiled step, and sets them next to the ZeRO paper's accounting. It also
times fp32 stage 2 with ``comm_dtype=jnp.bfloat16`` against the default fp32
gradient communication (interleaved, in each malloc condition of
``_step_common.CONDITIONS``), and writes the "precision" section of
BENCHMARKS.md.

Usage:
  python benchmarks/bench_precision.py [--quick] [--no-write] [--conditions retain,default]
"""

from __future__ import annotations


import _step_common as sc  # first: sets up 8 CPU devices
from _report import machine

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

zj = sc.zj
PRECISIONS = ["fp32", "bf16", "fp16", "fp16_memory_efficient"]
N = 8


def config(quick):
  if quick:
    return dict(sizes=[256, 512, 512, 256], batch_size=64, rounds=5, iters=2)
  return dict(sizes=[512, 1024, 1024, 1024, 1024, 512], batch_size=64, rounds=11, iters=2)


def formula(precision: str, stage: int, n: int) -> dict:
  """ZeRO-paper accounting in bytes per parameter: states at rest, gradients, total.

  Parameters and gradients in the policy's parameter dtype; Adam's m and v in
  fp32 (8 bytes) plus the fp32 master copy (4) where the policy keeps one:
  K = 12 for mixed precision, as in the paper.
  """
  p, k = _bytes(precision)
  g = p
  state = p + k / n  # params replicated, K sharded (stages 1 and 2)
  grads = g if stage == 1 else g / n
  return {"state": state, "grads": grads, "total": state + grads, "dp": p + g + k}


def _bytes(precision: str):
  """(bytes per parameter and per gradient, K) of a policy; fp32 keeps the leaves' float32."""
  pol = zj.POLICIES[precision]
  p = 4 if pol.param_dtype is None else jnp.dtype(pol.param_dtype).itemsize
  return p, 8 + (4 if pol.master_dtype is not None else 0)


def fmt_formula(precision: str, stage: int) -> str:
  p, k = _bytes(precision)
  if stage == 1:
    return f"{2 * p}Ψ + {k}Ψ/N"
  return f"{p}Ψ + {p + k}Ψ/N"


def measure(args) -> dict:
  cfg = config(args.quick)
  mesh = sc.mesh_of(N)
  params = sc.init_mlp(jax.random.key(0), cfg["sizes"])
  psi = sc.n_params(params)
  optimizer = optax.adam(1e-3)
  batch = sc.place_batch(sc.make_batches(jax.random.key(1), 1, cfg["batch_size"],
                                         cfg["sizes"][0], cfg["sizes"][-1])[0], mesh)
  out = {"psi": psi, "rows": [], "comm": {}}
  if not args.timing_only:
    for precision in PRECISIONS:
      for stage in (1, 2):
        step = zj.make_sharded_train_step(sc.mlp_loss, optimizer, mesh=mesh, stage=stage,
                                          precision=precision)
        state = step.init(params)
        compiled = step.lower(state, batch).compile()
        state, metrics = step(state, batch)
        out["rows"].append({
            "precision": precision, "stage": stage,
            "params": sc.bytes_per_device(state.params),
            "master": sc.bytes_per_device(state.master) if state.master is not None else 0,
            "opt": sc.bytes_per_device(state.opt_state),
            "mem": sc.memory(compiled), "colls": sc.collectives_str(compiled.as_text()),
            "upcast": sc.half_param_upcasts(compiled.as_text()),
            "loss": float(metrics["loss"])})
        print(out["rows"][-1], flush=True)

  # fp32 stage 2: gradients reduce-scattered in bf16 vs in fp32.
  steps, states = {}, {}
  for name, comm in [("fp32 comm", None), ("bf16 comm", jnp.bfloat16)]:
    steps[name] = zj.make_sharded_train_step(sc.mlp_loss, optimizer, mesh=mesh, stage=2,
                                             comm_dtype=comm)
    states[name] = steps[name].init(params)
    if not args.timing_only:
      out["comm"][name] = sc.collectives_str(steps[name].lower(states[name], batch)
                                             .compile().as_text())

  out["times"] = sc.interleave(sc.steppers(steps, states, batch), rounds=cfg["rounds"],
                               iters=cfg["iters"])
  return out


def render(results, args, seconds) -> str:
  cfg = config(args.quick)
  conds = list(results)
  first = results[conds[0]]
  psi = first["psi"]
  rows = []
  for r in first["rows"]:
    f = formula(r["precision"], r["stage"], N)
    state = r["params"] + r["master"] + r["opt"]
    m = r["mem"]
    rows.append([
        f"`{r['precision']}`", r["stage"], sc.mib(r["params"]), sc.mib(r["master"]),
        sc.mib(r["opt"]), f"**{sc.mib(state)}**", sc.mib(f["state"] * psi),
        sc.mib(m["arg"]), sc.mib(m["temp"]), sc.mib(f["grads"] * psi),
        f"{fmt_formula(r['precision'], r['stage'])} = {sc.mib(f['total'] * psi)}",
        f"**{sc.mib(m['arg'] + m['temp'])}**", sc.mib(f["dp"] * psi),
        f"{r['upcast'][0]}: {sc.mib(r['upcast'][1])}", r["colls"]])
  tab = sc.table(
      ["precision", "stage", "params", "master", "Adam m+v", "state (measured)",
       "state (formula)", "XLA arg", "XLA temp", "grads (formula)", "formula total",
       "XLA arg + temp", "DP formula", "f32 copies of half weights (CPU dots)",
       "collectives (dtype, result bytes)"], rows)
  by = {(r["precision"], r["stage"]): r for r in first["rows"]}
  total = lambda p, s: by[p, s]["mem"]["arg"] + by[p, s]["mem"]["temp"]
  temp = lambda p, s: by[p, s]["mem"]["temp"]
  state = lambda p, s: by[p, s]["params"] + by[p, s]["master"] + by[p, s]["opt"]
  exact = all(abs(state(r["precision"], r["stage"]) -
                  formula(r["precision"], r["stage"], N)["state"] * psi) < 1024
              for r in first["rows"])
  comm_rows = []
  for name in ["fp32 comm", "bf16 comm"]:
    row = [name, first["comm"][name]]
    for c in conds:
      t = results[c]["times"]
      row += [sc.spread(t[name]), sc.ratio_iqr(t, name, "fp32 comm")]
    comm_rows.append(row)
  comm_tab = sc.table(["fp32 stage 2", "collectives"] +
                      [f"{c}: {h}" for c in conds for h in ("step ms", "/ fp32 comm")], comm_rows)
  ratios = ", ".join(f"{c}: {sc.median_ratio(results[c]['times'], 'bf16 comm', 'fp32 comm'):.2f}"
                     for c in conds)
  conds_text = "\n".join(f"- `{c}`: {sc.CONDITION_TEXT[c]}" for c in conds)
  return f"""## precision: per-device memory of the precision policies vs the ZeRO formulas

Machine: {machine()}. Model: GELU MLP {cfg['sizes']}, Ψ = {psi:,} parameters
(Ψ x 4 bytes = {psi * 4 / sc.MIB:.2f} MiB), Adam, N = {N} devices, global batch {cfg['batch_size']}.
All figures are MiB per device. `params`, `master` (fp32 copy) and `Adam m+v` are read off
the state arrays' addressable shards; `XLA arg`/`temp` come from
`step.lower(state, batch).compile().memory_analysis()` (`arg` is the whole state plus the
batch; `temp` holds everything transient, gradients included). Formulas: the ZeRO paper's
accounting with parameters and gradients in the policy's parameter dtype (p = 2 or 4 bytes)
and K bytes of fp32 optimizer state per parameter (K = 12: master + m + v for bf16/fp16;
K = 8: m + v for fp32 and for fp16_memory_efficient, which keeps no master). Stage 1: 2pΨ +
KΨ/N; stage 2: pΨ + (p + K)Ψ/N; DP: (2p + K)Ψ, e.g. 16Ψ for mixed precision, and 2Ψ +
2Ψ/N + 8Ψ/N at stage 2 for the memory-efficient mode.
`python benchmarks/bench_precision.py{' --quick' if args.quick else ''}` ({seconds:.0f} s in all).

{tab}

How the measurements differ from the formulas, and why:
- **State at rest: {"as the formulas, to within 1 KiB" if exact else "NOT as the formulas (see table)"}.**
  Replicated params in the parameter dtype, and master, m, v sharded 1/N (no padding here:
  every dimension divides by 8; Adam's step counter adds a few bytes). The memory-efficient
  fp16 mode saves exactly the master's 4Ψ/N: {sc.mib(state("fp16", 2))} vs
  {sc.mib(state("fp16_memory_efficient", 2))} MiB.
- **Gradients: the formulas' pΨ (stage 1) or pΨ/N (stage 2) is a persistent buffer; XLA's
  temp is the peak of everything transient**, so the formula totals are lower bounds, not
  predictions. fp32: stage 1's temp ({sc.mib(temp("fp32", 1))} MiB) holds the whole fp32
  gradient (4Ψ, all-reduced, then sliced); stage 2's ({sc.mib(temp("fp32", 2))} MiB) is a few reduce-scattered
  gradient blocks and the update's temporaries (the optimizer state is updated in place).
- **Half precision on this CPU: the temp is not what a GPU would need.** XLA:CPU has no f16/bf16
  matmul: it makes an f32 copy of every half-precision weight before the forward pass
  (column "f32 copies": 4Ψ in all, issued up front), computes weight gradients in f32, and
  runs bf16 collectives in f32 (the `reduce-scatter`/`all-gather` dtypes in the last column;
  f16 ones stay f16). So at stage 2 the bf16 / fp16 temp is {sc.mib(temp("bf16", 2))} /
  {sc.mib(temp("fp16", 2))} MiB against fp32's {sc.mib(temp("fp32", 2))}, and arg + temp
  {sc.mib(total("bf16", 2))} / {sc.mib(total("fp16", 2))} MiB against fp32's
  {sc.mib(total("fp32", 2))} MiB, where the formulas promise {sc.mib(formula("fp16", 2, N)["total"] * psi)}
  against {sc.mib(formula("fp32", 2, N)["total"] * psi)}. fp16_memory_efficient's temp
  ({sc.mib(temp("fp16_memory_efficient", 2))} MiB, fp16's {sc.mib(temp("fp16", 2))}: a
  difference of {sc.mib(temp("fp16_memory_efficient", 2) - temp("fp16", 2))} MiB, where 4Ψ/N =
  {sc.mib(4 * psi / N)}) also holds the f32 upcast of its block of the fp16 parameters, which
  the update starts from since there is no master to read: the 4Ψ/N it saves at rest comes
  back as a transient at the peak.

Gradient communication in bf16 for an fp32 model (stage 2, `comm_dtype=jnp.bfloat16`),
interleaved ({cfg['rounds']} rounds x {cfg['iters']} steps, order rotated; a ratio is the median
(IQR) of paired per-round ratios; the host's 2 cores are shared with other jobs, so
absolute times are noisy; 1-min load average
{sc.load_text(results)}). Each malloc condition is its own process:
{conds_text}

{comm_tab}

Median step-time ratio bf16 comm / fp32 comm: {ratios}. On this CPU the bf16 reduce-scatter is
promoted back to f32 (see the collectives column: the wire carries f32 either way), so
`comm_dtype=bf16` only adds two casts per leaf and cannot show the halved traffic it is for;
this figure says nothing about GPUs.
"""



if __name__ == "__main__":
  sc.main(__doc__, __file__, measure, render, "precision")
