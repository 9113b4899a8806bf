"""offload="optimizer": per-device memory with and without it, its transfers, its step time.

For a GELU MLP of a few million parameters trained with Adam in bf16 (an fp32
master copy and Adam's moments: 12 bytes per parameter, 12Ψ/N per device) on
8 CPU devices, this compiles stages 1-3 with and without
``offload="optimizer"`` and reads

- XLA's ``memory_analysis()`` of each compiled step: its device figures
  (argument, output, alias, temp) and its host figures (``host_*``);
- the state's bytes per device by memory kind, off the arrays' shards, next
  to `zero_jax.memory_report` (``offload=``);
- the transfers of the program lowered for CUDA (``step.lower(...,
  lowering_platforms=("cuda",))``; XLA:CPU drops host moves when it compiles):
  moves to the device and to the host, barriers, and how many buckets the
  update streams in, at the default `zero_jax.step.offload.BUCKET_BYTES` and at 0 (one
  group of leaves per bucket).

Then it times stages 2 and 3 with and without offload (interleaved, in each
malloc condition of ``_step_common.CONDITIONS``) and writes the "offload"
section of BENCHMARKS.md.

Usage:
  python benchmarks/bench_offload.py [--quick] [--no-write] [--conditions retain,default]
"""

from __future__ import annotations

import re
import time

import _step_common as sc  # first: sets up 8 CPU devices
from _report import machine

import jax  # noqa: E402
import optax  # noqa: E402

from zero_jax.step import offload  # noqa: E402

zj = sc.zj
N = 8
PRECISION = "bf16"
STAGES = (1, 2, 3)
PCIE_GBS = 25  # GB/s one way, a PCIe 4.0 x16 link in practice


def config(quick):
  if quick:
    return dict(sizes=[256, 512, 512, 256], batch_size=64, rounds=5, iters=2)
  return dict(sizes=[512, 1024, 1024, 1024, 1024, 512], batch_size=64, rounds=21, iters=2)


def make_step(mesh, stage, off):
  return zj.make_sharded_train_step(sc.mlp_loss, optax.adam(1e-3), mesh=mesh, stage=stage,
                                    precision=PRECISION, offload=off)


def bytes_by_kind(state) -> dict:
  """Largest per-device bytes of the state's shards, per memory kind."""
  out = {}
  for kind in ("device", "pinned_host"):
    leaves = [x for x in jax.tree.leaves(state) if x.sharding.memory_kind == kind]
    out[kind] = sc.bytes_per_device(leaves)
  return out


def host_memory(compiled) -> dict:
  m = compiled.memory_analysis()
  return {k: getattr(m, f"host_{k}_size_in_bytes") for k in ("argument", "output", "temp")}


_MOVE = re.compile(r"annotate_device_placement\(.*_xla_buffer_placement = \"(\w+)\"")


def moves(text: str) -> dict:
  """Memory-placement annotations in a lowered program, per memory kind."""
  kinds = _MOVE.findall(text)
  return {k: kinds.count(k) for k in ("device", "pinned_host")}


def transfers(mesh, stage, params, batch, bucket_bytes) -> dict:
  """Moves, barriers and buckets of the step lowered for CUDA, at ``BUCKET_BYTES=bucket_bytes``.

  JAX annotates every output of a jitted function with its memory kind, on CPU as on
  GPU; the moves inside the step are what the CUDA lowering has beyond that.
  """
  plans = []  # per trace of the step, the bytes of each bucket
  plan = offload.plan

  def spy(jaxpr, inputs, weights, size):
    out = plan(jaxpr, inputs, weights, size)
    weight = dict(zip(inputs, weights))
    plans.append([sum(weight[p] for p in ins) for ins, _ in out])
    return out

  lower = lambda step, **kw: step.lower(step.abstract_state(params), batch, **kw).as_text()
  offload.plan, old = spy, offload.BUCKET_BYTES
  offload.BUCKET_BYTES = bucket_bytes
  try:
    step = make_step(mesh, stage, "optimizer")  # a fresh step: traced with this bucket size
    gpu, cpu = lower(step, lowering_platforms=("cuda",)), lower(step)
  finally:
    offload.plan, offload.BUCKET_BYTES = plan, old
  plain = lower(make_step(mesh, stage, None), lowering_platforms=("cuda",))
  barriers = lambda text: text.count("stablehlo.optimization_barrier")
  g, c = moves(gpu), moves(cpu)
  return {"buckets": len(plans[0]), "largest": max(plans[0], default=0),
          "barriers": barriers(gpu) - barriers(plain),
          "to_device": g["device"] - c["device"], "to_host": g["pinned_host"] - c["pinned_host"]}


def measure(args) -> dict:
  cfg = config(args.quick)
  mesh = sc.mesh_of(N)
  params = sc.init_mlp(jax.random.key(0), cfg["sizes"])
  batch = sc.place_batch(sc.make_batches(jax.random.key(1), 1, cfg["batch_size"],
                                         cfg["sizes"][0], cfg["sizes"][-1])[0], mesh)
  out = {"psi": sc.n_params(params), "rows": [], "lowered": {}}
  if not args.timing_only:
    report = {off: zj.memory_report(params, optax.adam(1e-3), n_devices=N, precision=PRECISION,
                                    offload=off) for off in (None, "optimizer")}
    for stage in STAGES:
      for off in (None, "optimizer"):
        step = make_step(mesh, stage, off)
        state = step.init(params)
        compiled = step.lower(state, batch).compile()
        state, metrics = step(state, batch)
        row = {"stage": stage, "offload": off, "mem": sc.memory(compiled),
               "host": host_memory(compiled), "kinds": bytes_by_kind(state),
               "report_device": report[off][stage].device - report[off][stage].gradients,
               "report_host": report[off][stage].host,
               "loss": float(metrics["loss"])}
        out["rows"].append(row)
        print(row, flush=True)
        if off is not None and stage in (2, 3):
          for size in (offload.BUCKET_BYTES, 0):
            out["lowered"][f"{stage},{size}"] = transfers(mesh, stage, params, batch, size)
            print(stage, size, out["lowered"][f"{stage},{size}"], flush=True)

  steps, states = {}, {}
  for stage in (2, 3):
    for off in (None, "optimizer"):
      name = f"stage {stage}" + (" offload" if off else "")
      steps[name] = make_step(mesh, stage, off)
      states[name] = steps[name].init(params)
  cpu = {name: [] for name in steps}  # process CPU seconds (all threads) per call
  out["times"] = sc.interleave(
      {name: with_cpu_time(go, cpu[name]) for name, go in sc.steppers(steps, states, batch).items()},
      rounds=cfg["rounds"], iters=cfg["iters"])
  out["cpu"] = {name: [sum(c[1 + r * cfg["iters"]:1 + (r + 1) * cfg["iters"]]) / cfg["iters"]
                       for r in range(cfg["rounds"])] for name, c in cpu.items()}
  return out


def with_cpu_time(fn, acc: list):
  """``fn``, appending the process CPU time of each call to ``acc`` (contention inflates
  wall time on a shared host much more than the work done)."""
  def go():
    t0 = time.process_time()
    fn()
    acc.append(time.process_time() - t0)
  return go


def render(results, args, seconds) -> str:
  cfg = config(args.quick)
  conds = list(results)
  first = results[conds[0]]
  psi = first["psi"]
  by = {(r["stage"], r["offload"]): r for r in first["rows"]}
  rows = []
  for r in first["rows"]:
    m, h, k = r["mem"], r["host"], r["kinds"]
    rows.append([r["stage"], "`optimizer`" if r["offload"] else "-", sc.mib(k["device"]),
                 sc.mib(k["pinned_host"]), sc.mib(r["report_device"]), sc.mib(r["report_host"]),
                 sc.mib(m["arg"]), sc.mib(m["out"]), sc.mib(m["alias"]), sc.mib(m["temp"]),
                 f"{sc.mib(h['argument'])} / {sc.mib(h['output'])} / {sc.mib(h['temp'])}",
                 f"{r['loss']:.6f}"])
  tab = sc.table(["stage", "offload", "state on device", "state on host",
                  "memory_report: state on device", "memory_report: on host", "XLA arg", "XLA out",
                  "XLA alias", "XLA temp", "XLA host arg / out / temp", "loss"], rows)
  low_rows = []
  for key, t in first["lowered"].items():
    stage, size = key.split(",")
    low_rows.append([stage, sc.mib(int(size)), t["buckets"], sc.mib(t["largest"]), t["barriers"],
                     t["to_device"], t["to_host"]])
  low_tab = sc.table(["stage", "BUCKET_BYTES (MiB)", "buckets", "largest bucket (MiB/device)",
                      "barriers", "moves to device", "moves to host"], low_rows)
  moved = by[2, "optimizer"]["report_host"]
  time_rows = []
  for stage in (2, 3):
    row = [stage]
    for c in conds:
      t = results[c]["times"]
      row += [sc.spread(t[f"stage {stage}"]), sc.spread(t[f"stage {stage} offload"]),
              sc.ratio_iqr(t, f"stage {stage} offload", f"stage {stage}"),
              sc.ratio_iqr(results[c]["cpu"], f"stage {stage} offload", f"stage {stage}")]
    time_rows.append(row)
  time_tab = sc.table(["stage"] + [f"{c}: {h}" for c in conds for h in
                                   ("ms", "offload ms", "offload / on device",
                                    "same, CPU time")], time_rows)
  ratio = lambda c, s, what: sc.median_ratio(results[c][what], f"stage {s} offload",
                                             f"stage {s}")
  ratios = ", ".join(f"{c} stage {s}: {ratio(c, s, 'times'):.2f} (CPU time "
                     f"{ratio(c, s, 'cpu'):.2f})" for c in conds for s in (2, 3))
  conds_text = "\n".join(f"- `{c}`: {sc.CONDITION_TEXT[c]}" for c in conds)
  temp = lambda s, o: by[s, o]["mem"]["temp"]
  extra = sum(temp(s, "optimizer") - temp(s, None) for s in STAGES) / len(STAGES) / moved
  return f"""## offload: optimizer state and master copy in pinned host memory

Machine: {machine()}. **No GPU was available for these figures**: everything below was
measured on 8 fake CPU devices, whose `pinned_host` memory exists (so the placement and the
results are real) but on which XLA does not move anything (the CPU compiler strips
memory-space annotations, and JAX lowers `device_put` inside `jit` to nothing on CPU).
Model: GELU MLP {cfg['sizes']}, Ψ = {psi:,} parameters, Adam, precision `{PRECISION}`
(fp32 master + m + v = 12Ψ/N = {sc.mib(12 * psi / N)} MiB per device at rest), N = {N},
global batch {cfg['batch_size']}. Figures are MiB per device.
`python benchmarks/bench_offload.py{' --quick' if args.quick else ''}` ({seconds:.0f} s in all).

{tab}

- **State at rest** (read off the arrays' shards): with offload the optimizer state and
  master copy ({sc.mib(moved)} MiB) are in `pinned_host` memory and the device keeps the
  bf16 parameters (1/N of them at stage 3). `memory_report(..., offload="optimizer")` gives
  the same split (its state columns here leave out its gradient column, which is transient).
- **XLA's `memory_analysis()` on CPU does not see the host**: its host figures are 0 and the
  argument bytes are the same with and without offload, because XLA:CPU strips memory
  spaces and compiles host arguments as ordinary buffers. On a GPU the argument bytes would
  fall by the host column.
- **Temp is larger with offload on CPU**: stage 1 {sc.mib(temp(1, "optimizer"))} vs
  {sc.mib(temp(1, None))}, stage 2 {sc.mib(temp(2, "optimizer"))} vs {sc.mib(temp(2, None))},
  stage 3 {sc.mib(temp(3, "optimizer"))} vs {sc.mib(temp(3, None))} MiB, on average
  {extra:.0%} of the offloaded state. The offloaded update skips a non-finite step with a
  select between the old and new values of each leaf (a `lax.cond` per bucket would make
  XLA:GPU read every bucket's predicate back to the host); on a GPU the old values are the
  copies just loaded, but XLA:CPU, having
  stripped the loads, reads the donated buffers themselves and so copies them first. On a
  GPU the update's temp holds the loaded copies of at most `IN_FLIGHT` = {offload.IN_FLIGHT}
  buckets (not measurable here).
- **Losses** are equal with and without offload (same first step).

Transfers in the program lowered for CUDA (what a GPU would compile), per step:

{low_tab}

Each bucket is a set of leaves that the update computes independently (here: Adam's m, v
and the master of one weight), merged up to `BUCKET_BYTES` per device; a bucket is loaded
only after the bucket `IN_FLIGHT` = {offload.IN_FLIGHT} places before it is written back (an
`optimization_barrier` joins its host arguments with that bucket's stores). With the default
{sc.mib(offload.BUCKET_BYTES)} MiB this model's whole state is one bucket (no barrier); at 0 it
streams one weight's m, v and master at a time. Scalars (Adam's count) are moved once, outside the buckets. Every step moves
the offloaded state twice over PCIe: {sc.mib(2 * moved)} MiB per device here, about
{2 * moved / (PCIE_GBS * 1e9) * 1e3:.2f} ms at {PCIE_GBS} GB/s each way if loads and
stores do not overlap (half that if they do, PCIe being full duplex).

Step time, interleaved ({cfg['rounds']} rounds x {cfg['iters']} steps, order rotated;
median (IQR) in ms, ratio = median (IQR) of paired per-round ratios; the host's 2 cores are
shared with other jobs, 1-min load average {sc.load_text(results)}, so the wall times are
noisy; "CPU time" is the same ratio of the process's CPU seconds per step, all threads, which
contention inflates less). Each malloc condition is its own process:
{conds_text}

{time_tab}

Median step-time ratio offload / on device: {ratios}. On CPU nothing moves, so what
differs is the program: most likely the copies above (and, with malloc defaults, the page
faults of the larger temp), within this shared host's noise;
the figure says nothing about the PCIe cost on a GPU, which is the transfer time above per
step unless XLA overlaps it with the update.
"""


if __name__ == "__main__":
  sc.main(__doc__, __file__, measure, render, "offload")
