"""The regime ZeRO is for: many hosts, a thin network between them, one or two sequences a GPU.

Writes the ``regime`` section of BENCHMARKS.md. For GPT-2 small, the 1B model and Llama-3-8B's
shapes (``_lm``, cuDNN fused attention where it compiles, bf16 compute on fp32 weights, AdamW)
on 2 to 32 hosts of 8 compile-only H100s, with 1 or 2 sequences per GPU, it compiles:

- **zero_jax** stage 3 with ``zj.scan(prefetch=1)``: flat (state split over every GPU,
  gathered over every GPU: GSPMD's flat FSDP's counterpart), hybrid (``replica_axis`` across
  hosts), hpZ (gathered within the host, state split over every GPU), and hpZ with ZeRO++'s int8
  quantization on the hops across hosts (qwZ + qgZ: ``zj.Quantize(across_only=True)``,
  LOSSY), each with the step's own compile options;
- **GSPMD** (`_gspmd`, as MaxText writes it): FSDP flat over every GPU, and HSDP (split within
  the host, replicated across), each with XLA's default flags and with NVIDIA's flags;

all at one remat policy, ``dots_saveable`` (the fastest fitting policy of both systems on
every "peer (cudnn attention)" row). The network between hosts does not change the program:
each program is compiled once and predicted (`zero_jax.gpu.predict` and
`zero_jax.gpu.timeline`, as ``bench_peer``) at 100 Gb/s, 400 Gb/s and 3.2 Tb/s per host
(`zero_jax.gpu.with_network`). Step times are predictions, not measurements.

Results are kept in a JSON file as they come (``--results``), so an interrupted run resumes;
``--reread`` reads the kept programs again after a change to the predictor.

Usage: ``python benchmarks/bench_regime.py [--models small,1b,8b] [--hosts 2,8,32]
[--seqs 1,2] [--systems ...] [--no-write]``. Needs JAX's CUDA plugin.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import optax  # noqa: E402

import _gspmd  # noqa: E402
import _lm  # noqa: E402
import _peer_common  # noqa: E402
import bench_peer  # noqa: E402
import zero_jax as zj  # noqa: E402
from zero_jax.gpu import measure, predict, targets, timeline  # noqa: E402

GPU = "h100"
NETWORKS_GBPS = (100, 400, 3200)  # per host, each way
POLICY = "dots"
MODELS = bench_peer.MODELS
GiB, MiB = 1 << 30, 1 << 20
_BOTH = ("hosts", "data")
LOSSY = "hpZ + qwZ + qgZ int8 across hosts (LOSSY)"
SYSTEMS = {
    "flat": ("zero_jax", "step's own", {"stage": 3, "axis_name": _BOTH}),
    "hybrid": ("zero_jax", "step's own", {"stage": 3, "replica_axis": "hosts"}),
    "hpZ": ("zero_jax", "step's own", {"stage": 3, "axis_name": _BOTH, "hpz_axis": "data"}),
    LOSSY: ("zero_jax", "step's own", {"stage": 3, "axis_name": _BOTH, "hpz_axis": "data",
                                       "quantize": zj.Quantize(across_only=True)}),
    "FSDP flat": ("GSPMD", "XLA default", (_BOTH, _BOTH)),
    "FSDP flat (NVIDIA flags)": ("GSPMD", "NVIDIA flags", (_BOTH, _BOTH)),
    "HSDP": ("GSPMD", "XLA default", (("data",), _BOTH)),
    "HSDP (NVIDIA flags)": ("GSPMD", "NVIDIA flags", (("data",), _BOTH)),
}
EXACT = ("flat", "hybrid", "hpZ")
GOAL_SHARE, GOAL_EXACT, GOAL_LOSSY, GOAL_ANY = 0.25, 0.9, 0.7, 1.0


def network(gbps: int) -> targets.Target:
  return targets.with_network(GPU, gbps_per_host=gbps, gpus_per_host=8)


def lower(cfg, hosts: int, seqs: int, system: str):
  """The lowered step of ``system`` for ``cfg`` on ``hosts`` x 8 GPUs, ``seqs`` sequences each."""
  kind, _, opts = SYSTEMS[system]
  rows = hosts * 8 * seqs
  if kind == "GSPMD":
    mesh = _gspmd.compile_only_auto_mesh((hosts, 8), _BOTH, gpu=GPU, hosts=hosts)
    return _gspmd.lower_step(cfg, mesh, fsdp=opts[0], batch_axes=opts[1],
                             policy=bench_peer.POLICIES[POLICY], rows=rows)
  mesh = zj.compile_only_mesh((hosts, 8), _BOTH, gpu=GPU, hosts=hosts)
  fam = _lm.family(cfg)
  params = jax.eval_shape(lambda k: fam.init(cfg, k), jax.random.key(0))
  lookup = _lm.in_embedding if isinstance(cfg, _lm.LlamaShape) else None
  step = zj.make_sharded_train_step(
      fam.make_loss(cfg, prefetch=1, policy=bench_peer.POLICIES[POLICY]), optax.adamw(1e-4),
      mesh=mesh, precision="bf16", stacked=_lm.in_blocks, lookup=lookup, **opts)
  return step.lower(step.abstract_state(params), _lm.gpt_batch_shape(cfg, rows))


def read_all(text: str) -> dict:
  """The program's figures at each network, as `bench_peer.read` gives them (bytes sent within
  and across hosts, compute, memory-bound and exposed time, the step: the schedule walked by
  `zero_jax.gpu.timeline`), with its most exposed collectives by `predict_scheduled`'s windows
  (``top``: ``(where, op, MiB of one call, ms exposed per step)``); the program is
  read once."""
  program = predict.analyze(text)
  out = {}
  for gbps in NETWORKS_GBPS:
    device = measure.device_for(network(gbps), 8, "bf16")
    intra, cross = measure.sent_bytes(program, device)
    prediction = predict.predict(program, device)
    windows = []
    for loop in predict.predict_scheduled(text, device):
      where = "outside loops" if loop.name == "ENTRY" else f"in a loop of {loop.trips}"
      windows += [(where, w.op, w.nbytes / MiB, 1e3 * w.exposed * loop.trips * loop.runs)
                  for w in loop.windows]
    step = timeline.simulate(text, device).step
    out[str(gbps)] = {"intra": intra, "cross": cross, "memory_s": prediction.elementwise,
                      "compute_s": prediction.compute, "exposed_s": step - prediction.compute,
                      "step_s": step,
                      "top": sorted(windows, key=lambda w: -w[3])[:3]}
  return out


def compile_row(row, programs: pathlib.Path) -> dict:
  m, hosts, seqs, system = row
  kind, flags, _ = SYSTEMS[system]
  lowered = lower(MODELS[m], int(hosts), int(seqs), system)
  options = {**measure.FAST_COMPILE,
             **(_gspmd.nvidia_flags(MODELS[m]) if flags == "NVIDIA flags" else {})}
  compiled = lowered.compile(compiler_options=options)
  text = compiled.as_text()
  _peer_common.keep_program(programs, row, text)
  return {**bench_peer.memory(compiled), "net": read_all(text)}


def rows_for(models, hosts_list, seqs_list, systems) -> list:
  """Rows in the order they are worth compiling: by sequences per GPU, then hosts, then model,
  each in the order given."""
  return [(m, h, s, sys) for s in seqs_list for h in hosts_list for m in models
          for sys in systems]


def measure_all(rows, results_path: pathlib.Path) -> dict:
  def say(key: str, r: dict) -> None:
    n = r["net"]["400"]
    print(f"{key:70s} peak {r['peak'] / GiB:6.1f} GiB  sent {n['intra'] / MiB:7.0f}+"
          f"{n['cross'] / MiB:5.0f} MiB  step@100/400/3200 "
          f"{'/'.join('%.1f' % (r['net'][str(g)]['step_s'] * 1e3) for g in NETWORKS_GBPS)} ms "
          f"({r['seconds']:.0f} s)", flush=True)
  return _peer_common.compile_kept(rows, results_path, compile_row, say, keep_errors=True)


def reread(out: dict, programs: pathlib.Path, every: bool) -> dict:
  """Rows read again from their kept programs: ``every`` one, or those read before the
  results held each network's ``top`` collectives (an older reader)."""
  for row, r in out.items():
    stale = every or any("top" not in n for n in r.get("net", {}).values())
    text = _peer_common.kept_program(programs, row) if "error" not in r and stale else None
    if text is not None:
      r["net"] = read_all(text)
  return out


# ------------------------------------------------------------------ the verdicts
def fits(r: dict) -> bool:
  return "error" not in r and r["peak"] <= targets.get_target(GPU).memory_bytes


def verdict(out: dict, key: tuple, gbps: int) -> dict:
  """One (model, hosts, seqs) at one network: each system's step, GSPMD's best that fits, and
  zero_jax's exact best and lossy one against it."""
  at = lambda r: r["net"][str(gbps)]
  rows = {k[3]: r for k, r in out.items() if k[:3] == key}
  gspmd = [(s, at(r)) for s, r in rows.items() if SYSTEMS[s][0] == "GSPMD" and fits(r)]
  g = min(gspmd, key=lambda sr: sr[1]["step_s"], default=None)
  exact = [(s, at(r)) for s, r in rows.items() if s in EXACT and fits(r)]
  z = min(exact, key=lambda sr: sr[1]["step_s"], default=None)
  q = (LOSSY, at(rows[LOSSY])) if LOSSY in rows and fits(rows[LOSSY]) else None
  return {"rows": rows, "gspmd": g, "exact": z, "lossy": q,
          "share": g[1]["exposed_s"] / g[1]["step_s"] if g else None}


def goal_failures(v: dict) -> list:
  """The goals this verdict misses (an empty list: all met, or nothing to compare)."""
  if v["gspmd"] is None:
    return []
  out, g = [], v["gspmd"][1]["step_s"]
  for name, zr, bound in (("exact", v["exact"], GOAL_EXACT), ("lossy", v["lossy"], GOAL_LOSSY)):
    if zr is None:
      continue
    ratio = zr[1]["step_s"] / g
    if ratio > GOAL_ANY:
      out.append(f"{name} {ratio:.2f}x > {GOAL_ANY}")
    elif v["share"] >= GOAL_SHARE and ratio > bound:
      out.append(f"{name} {ratio:.2f}x > {bound} (communication {v['share']:.0%})")
  return out


def _parts(r: dict) -> tuple:
  return (1e3 * (r["compute_s"] - r["memory_s"]), 1e3 * r["memory_s"], 1e3 * r["exposed_s"])


def attribution(z, g) -> str:
  """zero_jax - GSPMD in ms: matmuls, memory-bound kernels, exposed communication."""
  if z is None or g is None:
    return "-"
  return ", ".join(f"{a - b:+.1f}" for a, b in zip(_parts(z[1]), _parts(g[1])))


def render(out: dict) -> str:
  order = lambda k: (list(MODELS).index(k[0]), int(k[1]), int(k[2]), list(SYSTEMS).index(k[3]))
  out = dict(sorted(out.items(), key=lambda kr: order(kr[0])))
  # Only cases with every system compiled are compared (an interrupted run leaves some out).
  keys = [key for key in dict.fromkeys(k[:3] for k in out)
          if all(key + (s,) in out for s in SYSTEMS)]
  out = {k: r for k, r in out.items() if k[:3] in keys}
  minutes = sum(r.get("seconds", 0) for r in out.values()) / 60
  lines = [
      "## regime: many hosts, thin networks, 1-2 sequences per GPU (PREDICTIONS for time)", "",
      f"`python benchmarks/bench_regime.py` ({len(out)} programs, {minutes:.0f} min of compiles "
      f"on this 2-core CPU, shared with other work). Each program is compiled once by XLA:GPU "
      f"for compile-only H100s (hosts of 8), bf16 compute on fp32 weights, AdamW, remat "
      f"`{POLICY}` on every system, attention on both sides: "
      f"{bench_peer.ATTENTION_WORDS[bench_peer.ATTENTION[0]]}; and predicted by "
      f"`zero_jax.gpu.predict`, the schedule walked by `zero_jax.gpu.timeline` (as in \"peer "
      f"(cudnn attention)\": at least 1.2x optimistic, see "
      f"\"calibration\") at three networks between hosts, per host each way: "
      f"{', '.join(f'{g:,} Gb/s' for g in NETWORKS_GBPS)} (`zj.gpu.with_network`; 3,200 is "
      f"DGX/HGX H100's 8 x 400 Gb/s NDR). zero_jax: stage 3, `zj.scan(prefetch=1)`, the step's "
      f"own options; *flat* = split and gathered over every GPU (`axis_name=(\"hosts\", "
      f"\"data\")`), *hybrid* = `replica_axis=\"hosts\"`, *hpZ* = `hpz_axis=\"data\"`, and "
      f"{LOSSY} = hpZ with `quantize=zj.Quantize(across_only=True)` (int8 weights and "
      f"gradients on the hops across hosts: not the exact step). GSPMD: `benchmarks/_gspmd.py` "
      f"(MaxText-style), FSDP flat over all GPUs and HSDP (split within a host, replicated "
      f"across), each with XLA's defaults and with NVIDIA's flags.",
      "",
      "Cases compiled (every system of each; hosts 4 and 16 were left out for this shared "
      "CPU's time): " + "; ".join(
          f"{MODELS[m].name}: " + ", ".join(f"{h} hosts x {q} seq" for mm, h, q in keys if mm == m)
          for m in dict.fromkeys(k[0] for k in keys)) + ".",
      "",
      f"**Goals (predicted):** where exposed communication is at least {GOAL_SHARE:.0%} of "
      f"GSPMD's best step, zero_jax exact at most {GOAL_EXACT}x of it and with quantization at "
      f"most {GOAL_LOSSY}x; nowhere above {GOAL_ANY}x. Rows that do not fit an 80 GB H100 are "
      f"marked and never compared.",
      "",
      *PROGRAMS, "",
      "Per program (compiled once): peak memory per GPU, and MiB each GPU sends per step within "
      "its host + across hosts.", "",
      "| model | hosts | seqs/GPU | system | peak GiB | sent MiB (intra+cross) | step ms at "
      + " / ".join(f"{g:,}" for g in NETWORKS_GBPS) + " Gb/s |",
      "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
  for k, r in out.items():
    head = f"| {MODELS[k[0]].name} | {k[1]} | {k[2]} | {k[3]} |"
    if "error" in r:
      lines.append(f"{head} - | - | did not compile: {r['error'][:120]} |")
      continue
    n = r["net"][str(NETWORKS_GBPS[0])]
    steps = " / ".join(f"{r['net'][str(g)]['step_s'] * 1e3:.1f}" for g in NETWORKS_GBPS)
    lines.append(f"{head} {r['peak'] / GiB:.1f}{'' if fits(r) else ' (does not fit)'} | "
                 f"{n['intra'] / MiB:,.0f}+{n['cross'] / MiB:,.0f} | {steps} |")
  lines += ["", "Per row and network: the best fitting GSPMD step, its exposed communication "
            "share, zero_jax's exact best and quantized step as ratios of it, where the "
            "difference comes from (zero_jax - GSPMD in ms: matmuls, memory-bound kernels, "
            "exposed communication), and the goal check.", "",
            "| model | hosts | seqs/GPU | Gb/s per host | GSPMD best | ms | comm share | exact "
            "best | ratio | lossy ratio | exact - GSPMD | lossy - GSPMD | goals |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: | --- | --- | "
            "--- |"]
  failed, why = [], []
  for key in keys:
    for gbps in NETWORKS_GBPS:
      v = verdict(out, key, gbps)
      g, z, q = v["gspmd"], v["exact"], v["lossy"]
      head = f"| {MODELS[key[0]].name} | {key[1]} | {key[2]} | {gbps:,} |"
      if g is None:
        lines.append(f"{head} none fits | - | - | - | - | - | - | - | not compared |")
        continue
      ratio = lambda x: "does not fit" if x is None else f"{x[1]['step_s'] / g[1]['step_s']:.2f}"
      miss = goal_failures(v)
      failed += [f"{MODELS[key[0]].name} {key[1]}x8 {key[2]} seq {gbps:,} Gb/s: {m}" for m in miss]
      if miss:
        why.append(explain(MODELS[key[0]].name, key, gbps, v))
      lines.append(f"{head} {g[0]} | {g[1]['step_s'] * 1e3:.1f} | {v['share']:.0%} | "
                   f"{z[0] if z else '-'} | {ratio(z)} | {ratio(q)} | {attribution(z, g)} | "
                   f"{attribution(q, g)} | {'; '.join(miss) if miss else 'met'} |")
  lines += ["", summary(out, keys), "",
            f"**Goals missed:** {'; '.join(failed) if failed else 'none'}.", ""]
  lines += [*READING, ""]
  if why:
    lines += ["Where each missed goal's time goes, read off the compiled programs at that "
              "network (MiB each GPU sends across hosts per step; the collectives leaving the "
              "most communication exposed per step, with the bytes of one call):", "", *why, ""]
  return "\n".join(lines)


# Which commit compiled which programs (the results file keeps no commit): said by hand.
PROGRAMS = [
    "*Code: zero_jax's 18 flat programs recompiled on commit e2f2775 (both two-layer loops "
    "run the same layers and no code outside them touches the stacked residuals, "
    "`zero_jax.layers.loops.span`: Llama-3-8B's flat steps lose four whole-stack transposes, "
    "up to 17 ms at 2 seq/GPU and 0.5 GiB of peak; GPT-2 small's and 1B's steps within 0.5 ms, "
    "GPT-2 small's peak +60 MiB); its 54 hybrid and hpZ programs, which that change leaves as "
    "they were (one recompiled, GPT-2 small 2x8 1 seq hybrid, reads the same to the byte and "
    "the nanosecond), kept from commit 4cf0c6c (that release: the flat step's "
    "layer loops run two layers an iteration, with no copy of what a layer hands to the next; "
    "every step moves a layer's leaves split along their first dimension in collectives of their "
    "own, splits stacked leaves along their layer's first dimension where that pads no more, and "
    "starts each collective as soon as it can; 91f2cb0 after it changes no GPU program); GSPMD's "
    "72 kept from the `regime` branch (commit 2eff297; `benchmarks/_gspmd.py` and `_lm.py` "
    "unchanged since). Every program read with the reader that walks the schedule "
    "(`zero_jax.gpu.timeline`, \"Reading it\" below). Before this release: exact at most 0.9x in "
    "24 cases, quantized at most 0.7x in 35, above 1.0x 15; now 35, 35 and 8, every one of the "
    "8 the quantized step at 3.2 Tb/s.*"]


READING = [
    "**Reading it** (predictions; figures from the rows above). *Bytes across hosts*: "
    "zero_jax's hybrid and hpZ steps send the same bytes across hosts, 2 (h-1)/h of each GPU's "
    "eighth of the bf16 gradient (Llama-3-8B: 1,915 MiB per GPU on 2 hosts, 3,709 on 32; the "
    "GPU tier pins the formula), as GSPMD's HSDP does (1,945 and 3,709 MiB); GSPMD's flat FSDP "
    "sends 1.4x to 2.8x that, its per-weight rings over every GPU each leaving every host once, "
    "and zero_jax's flat step as much or a little less (it gathers the leaves outside the "
    "layer stack once a step, where GSPMD gathers them again for the backward; the GPU tier "
    "pins its bytes). "
    "So on thin networks, where both sides are bound by the same bytes, the exact ratio is set "
    "by overlap, not volume: Llama-3-8B on 32 hosts at 100 Gb/s cannot reach 0.9x with any exact "
    "step sending those bytes (the floor line above). *What zero_jax leaves exposed*: hpZ "
    "refreshes its secondary copy across hosts once per step after the update (Llama-3-8B: "
    "1,915 MiB, 1.25 s of 2.6 s exposed on 32 hosts at 100 Gb/s, 0.31 s of 0.75 s at 400), "
    "where GSPMD's and hybrid's reductions run inside the backward loop; a refresh layer by "
    "layer inside the next step's forward loop would hide it behind compute, and is not built. "
    "The quantized step halves the bytes across hosts (int8 plus a float32 scale per 256) and "
    "meets 0.7x on every 1-sequence row at 100 and 400 Gb/s per host, but not at 3.2 Tb/s, where "
    "communication within the "
    "host, the embedding's gathers outside the loops and hpZ's memory-bound work remain. "
    "*At 3.2 Tb/s* the flat step (split and gathered over every GPU, as GSPMD's flat FSDP, "
    "which is GSPMD's best there) is zero_jax's exact best on every 1B and Llama-3-8B row "
    "where GSPMD's flat FSDP wins; hybrid and hpZ update an eighth of the model on each GPU "
    "where it updates 1/(8 h), memory-bound work that costs more than the bytes they save on "
    "so fast a network (Llama-3-8B on 8 hosts, one sequence: hybrid 220 ms, flat 175, GSPMD "
    "211). No exact step is above 1.0x (the flat step reaches 1.00x on Llama-3-8B with two "
    "sequences a GPU on 2 hosts, where communication is 7% of GSPMD's step). Before this "
    "release it was in 15 cases, by +3 to +24 ms of memory-bound kernels: the per-layer copies "
    "of one joined buffer a layer and of a loop of one layer an iteration (\"peer (cudnn "
    "attention)\" says what replaced them). "
    "The quantized step is hpZ's, whose update and secondary copy cost the same memory-bound "
    "work, and whose loops keep one layer an iteration (hpZ's blocks vary over fewer axes than "
    "the activations, so its gathers cannot wait for them), so it is above 1.0x on 8 of the "
    "cases where the flat exact step is best at 3.2 Tb/s (Llama-3-8B: +28 to +32 ms of "
    "memory-bound kernels). Quantizing "
    "every hop of the flat step instead (`zj.Quantize()`, compiled for the one-sequence rows "
    "on 2 and 8 hosts, not in the tables) is slower still: its int8 gradient all-to-all over "
    "every GPU sends more across hosts than the ring's reduce-scatter (Llama-3-8B on 8 hosts: "
    "8,115 against 5,189 MiB a GPU; 282 ms against the exact flat step's 201 at 3.2 Tb/s). "
    "*Overlap across two links*: the re-gather and the gradient's reduce-scatter within the "
    "host and hybrid's all-reduce (or hpZ's reduce-scatter) across hosts are in flight "
    "together in the backward loop. The step times here walk XLA:GPU's schedule "
    "(`zero_jax.gpu.timeline`: every kernel on one stream, the collectives on a link sharing "
    "it, the stream waiting at each done, matmuls alone hiding communication). The windows' "
    "model they replace (`predict_scheduled`, still what names the most exposed collectives "
    "below) kept, of collectives in flight together, the link that leaves the most exposed: "
    "a lower bound where the waits on two links fall at different points. Walked (on the "
    "previous release's programs), every GSPMD step was the same to the microsecond; "
    "zero_jax's hybrid, hpZ and quantized steps up to 4.3% longer (Llama-3-8B on 8 hosts, one "
    "sequence, hybrid at 3.2 Tb/s: 232 -> 242 ms) and its flat steps from 1.5% shorter to "
    "1.7% longer (collectives in flight "
    "together on one link are waited for one by one, not as one sum behind their windows' "
    "matmuls). "
    "*Latency*: GSPMD's per-weight collectives each pay a "
    "ring's (or for small all-reduces NCCL's tree's) latency across hosts, 2 us a step within "
    "a host and 6 us across (assumptions of NCCL's order, see `zero_jax.gpu.targets`): much of "
    "GSPMD's exposed time on GPT-2 small is latency, not bytes, so those ratios depend on "
    "these two figures more than the bandwidth-bound rows do."]


def summary(out: dict, keys: list) -> str:
  """The goals counted over every (model, hosts, sequences, network) compared."""
  vs = [verdict(out, key, g) for key in keys for g in NETWORKS_GBPS]
  vs = [v for v in vs if v["gspmd"] is not None]
  heavy = [v for v in vs if v["share"] >= GOAL_SHARE]
  ratio = lambda v, side: v[side][1]["step_s"] / v["gspmd"][1]["step_s"]
  met = lambda group, side, bound: sum(1 for v in group if v[side] and ratio(v, side) <= bound)
  over = sum(1 for v in vs for side in ("exact", "lossy") if v[side] and ratio(v, side) > GOAL_ANY)
  span = lambda side: (f"{min(ratio(v, side) for v in heavy if v[side]):.2f}x to "
                       f"{max(ratio(v, side) for v in heavy if v[side]):.2f}x") if heavy else "-"
  return (f"**The goals, counted** over {len(vs)} cases (model, hosts, sequences, network): "
          f"{len(heavy)} have GSPMD's best step at least {GOAL_SHARE:.0%} exposed communication; "
          f"there zero_jax exact is at most {GOAL_EXACT}x in {met(heavy, 'exact', GOAL_EXACT)} "
          f"(from {span('exact')}) and quantized at most {GOAL_LOSSY}x in "
          f"{met(heavy, 'lossy', GOAL_LOSSY)} (from {span('lossy')}); above {GOAL_ANY}x: {over} "
          f"(exact or quantized, any case).")


def cause(v: dict, gbps: int, miss: str) -> str:
  """Why one goal is missed, from the figures: the network's floor when zero_jax sends as many
  bytes across hosts as GSPMD, else the parts of the difference."""
  g = v["gspmd"]
  z = v["exact"] if miss.startswith("exact") else v["lossy"]
  floor = z[1]["cross"] / network(gbps).cross_bandwidth  # its bytes across, alone, at full rate
  bound = GOAL_EXACT if miss.startswith("exact") else GOAL_LOSSY
  if floor >= bound * g[1]["step_s"]:
    return (f"{z[0]} sends {z[1]['cross'] / MiB:,.0f} MiB across hosts (GSPMD "
            f"{g[1]['cross'] / MiB:,.0f}): at {gbps:,} Gb/s per host that alone takes "
            f"{floor * 1e3:,.0f} ms per GPU, {floor / g[1]['step_s']:.2f}x of GSPMD's step, so "
            f"no step sending those bytes reaches {bound}x")
  d = [a - b for a, b in zip(_parts(z[1]), _parts(g[1]))]
  return (f"{z[0]} - GSPMD: matmuls {d[0]:+.1f} ms, memory-bound kernels {d[1]:+.1f} ms, "
          f"exposed communication {d[2]:+.1f} ms; its own exposed communication "
          f"{z[1]['exposed_s'] * 1e3:.1f} ms of a {z[1]['step_s'] * 1e3:.1f} ms step")


def explain(name: str, key: tuple, gbps: int, v: dict) -> str:
  """One line per missed goal: the bytes across hosts of both sides and what is exposed."""
  g = v["gspmd"]
  causes = "; ".join(f"{m.split(' ')[0]}: {cause(v, gbps, m)}" for m in goal_failures(v))
  cross = lambda r: f"{r[1]['cross'] / MiB:,.0f} MiB across"
  top = lambda r: "; ".join(f"{op} of {mib:,.1f} MiB {where}: {ms:.2f} ms"
                            for where, op, mib, ms in r[1].get("top", ()))
  sides = [x for x in (v["exact"], v["lossy"]) if x is not None]
  return (f"- {name} {key[1]}x8, {key[2]} seq/GPU, {gbps:,} Gb/s. **Cause:** {causes}. "
          f"**Exposed:** GSPMD {g[0]} "
          f"{cross(g)}, exposed {g[1]['exposed_s'] * 1e3:.1f} of {g[1]['step_s'] * 1e3:.1f} ms "
          f"({top(g)}); " + "; ".join(
              f"zero_jax {z[0]} {cross(z)}, exposed {z[1]['exposed_s'] * 1e3:.1f} of "
              f"{z[1]['step_s'] * 1e3:.1f} ms ({top(z)})" for z in sides) + ".")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="small,1b,8b", help="of small, 1b, 8b")
  p.add_argument("--hosts", default="2,8,32", help="hosts of 8 H100s")
  p.add_argument("--seqs", default="1,2", help="sequences per GPU")
  p.add_argument("--systems", default=",".join(SYSTEMS),
                 help=f"of: {'; '.join(SYSTEMS)} (comma-separated)")
  p.add_argument("--attention", default="cudnn", choices=("cudnn", "written"))
  p.add_argument("--results", type=pathlib.Path,
                 default=pathlib.Path(tempfile.gettempdir()) / "zero_jax_regime.json")
  p.add_argument("--reread", action="store_true",
                 help="read the kept programs of rows read by an older reader again")
  p.add_argument("--reread-all", action="store_true", help="read every kept program again")
  p.add_argument("--compile-only", action="store_true", help="compile, render nothing")
  p.add_argument("--render-only", action="store_true",
                 help="compile nothing: render the rows the results file already holds")
  p.add_argument("--no-write", action="store_true", help="print only")
  args = p.parse_args()
  systems = [s for s in SYSTEMS if s in args.systems.split(",")] if args.systems else []
  unknown = set(args.systems.split(",")) - set(SYSTEMS)
  if unknown:
    p.error(f"--systems: unknown {sorted(unknown)}; choose from {list(SYSTEMS)}")
  bench_peer.use_attention(argparse.Namespace(attention=args.attention, gpus=GPU,
                                              results=args.results))
  rows = rows_for(args.models.split(","), [int(h) for h in args.hosts.split(",")],
                  [int(s) for s in args.seqs.split(",")], systems)
  out = measure_all([] if args.render_only else rows, args.results)
  if args.compile_only:
    return
  wanted = {tuple(map(str, r)) for r in rows}
  out = {k: v for k, v in out.items() if k in wanted}
  if args.reread or args.reread_all:
    out = reread(out, args.results.with_suffix(".programs"), args.reread_all)
    done = json.loads(args.results.read_text())
    done.update({"|".join(k): v for k, v in out.items()})
    args.results.write_text(json.dumps(done, indent=1))
  from _report import publish  # pylint: disable=g-import-not-at-top
  publish("regime", render(out), write=not args.no_write)


if __name__ == "__main__":
  main()
