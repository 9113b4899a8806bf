"""`zj.plan` from 1 to 32 hosts of 8 H100s: what the best candidate holds, sends and takes.

For GPT-2 small (``_lm.GPT2_SMALL``: 124M parameters, 8 sequences of 1024 tokens per GPU) and
Llama-3-8B's shapes (``_lm.LLAMA3_8B``: 8.0B parameters, 4 sequences of 2048 tokens per GPU,
its untied embedding marked ``lookup=``), each at hosts 1, 2, 4, 8, 16 and 32 (8 GPUs each;
the global batch grows with the GPUs), a fresh process plans the model as a user would
(``zj.plan`` with its defaults: exact communication, ``max_compiles=4``; bf16, AdamW, the loss
taking zj.scan's ``prefetch`` and ``policy``, attention by cuDNN's fused kernel where it
compiles here, else written out and said: `_lm.fused_attention`) and reports the best
candidate's bytes per device (XLA's memory analysis of the GPU-compiled program), the bytes
each device sends across hosts and within its host per step (read from the program's
collectives) and its PREDICTED step time (the compiled schedule walked by
`zero_jax.gpu.timeline` on the H100's figures, what the plan ranks by; not a measurement: see
BENCHMARKS.md "calibration").

Whether the best is the fastest fitting program, by the plan's own prediction: besides the
plan's candidates, each layout it compiled is compiled at the best's remat policy where the
plan did not (a layout it ranked lower may be faster there).

ZeRO++'s claim, checked on the same programs: with hpZ (the weights' secondary copy split
within a host) the bytes each device sends across hosts do not grow with the hosts. For hosts
>= 2 the process also reads ZeRO-3 with hpZ and flat ZeRO-3 (both prefetch 1, at the best's
remat policy; from the plan when it compiled them, else compiled on their own).

Results go to a JSON cache (``--cache``) as each run ends, so an interrupted run resumes;
then the table (BENCHMARKS.md, "scale") and the plot (docs/scale.png). Wall times depend on
the machine's load: each row gives the load average before and after its plan.

Usage: ``python benchmarks/bench_scale.py [--models small,8b] [--hosts 1,2,4,8,16,32]
[--cache /tmp/zero_jax_scale_v2.json] [--no-write]``. Needs JAX's CUDA plugin (no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB, GiB = 2**20, 2**30
PER_HOST = 8
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def model(key: str):
  """``(config, loss maker, init, sequences per GPU, fixed options)`` of a model key: Llama's
  untied embedding is read with ``zj.take``, so it is marked ``lookup=`` (split at stage 3)."""
  import _lm  # pylint: disable=import-outside-toplevel
  if key == "small":
    return _lm.GPT2_SMALL, _lm.make_gpt_loss, _lm.init_gpt, 8, {}
  return _lm.LLAMA3_8B, _lm.make_llama_loss, _lm.init_llama, 4, {"lookup": _lm.in_embedding}


def reading(c) -> dict:
  return {"name": c.name, "bytes": c.bytes_per_device, "cross": c.cross_bytes,
          "intra": c.intra_bytes, "step": c.step_time_s, "compute": c.compute_s,
          "fits": c.fits}


def compile_one(plan, opts: dict, init, batch) -> dict:
  """``opts`` (with ``prefetch``) compiled on the plan's mesh and read, as the plan reads."""
  from zero_jax.gpu import measure  # pylint: disable=import-outside-toplevel
  mesh = plan.candidates[0].options["mesh"]
  step = measure.build_step(plan.loss_fn, plan.optimizer, opts, mesh, plan.fixed)
  compiled = step.lower(step.abstract_state(init), batch).compile(
      compiler_options=measure.FAST_COMPILE)
  device = measure.device_for(plan.target, PER_HOST, plan.fixed.get("precision", "fp32"))
  r = measure.read(compiled, device)
  return {"name": "", "bytes": r.memory.peak, "cross": r.cross_bytes, "intra": r.intra_bytes,
          "step": r.step_s, "compute": r.compute_s, "fits": r.memory.peak <= plan.hbm}


def siblings(plan, policy: dict, init, batch) -> list[dict]:
  """Each layout the plan compiled, at its best's remat ``policy`` where the plan did not
  compile it so: whether a layout it ranked lower would have been faster at that policy."""
  from zero_jax.gpu import candidates as cands  # pylint: disable=import-outside-toplevel
  names, out = {c.name for c in plan.candidates}, []
  for c in plan.candidates:
    opts = {**{k: c.options[k] for k in cands.SEARCHED if k in c.options},
            "prefetch": c.prefetch, **policy}
    name = cands.describe(opts)
    if name not in names:
      names.add(name)
      out.append({**compile_one(plan, opts, init, batch), "name": name})
  return out


def plan_one(key: str, hosts: int) -> dict:
  """Plans ``key`` on ``hosts`` x 8 H100s in this process; its figures."""
  load0 = os.getloadavg()[0]
  import jax  # pylint: disable=import-outside-toplevel
  import optax
  import _lm
  import zero_jax as zj
  from zero_jax.gpu import candidates as cands
  cfg, make_loss, init_fn, rows, extra = model(key)
  zj.compile_only_mesh((hosts, PER_HOST), ("hosts", "data"), gpu="h100", hosts=hosts)
  attention, why = _lm.fused_attention("h100")  # cuDNN's fused kernel, where it compiles here
  cfg = _lm.with_attention(cfg, attention)

  def loss_fn(params, batch, *, prefetch=0, policy=None):  # zj.scan's, which zj.plan searches
    return make_loss(cfg, prefetch, policy)(params, batch)

  init = lambda: init_fn(cfg, jax.random.key(0))
  batch = _lm.gpt_batch_shape(cfg, rows * hosts * PER_HOST)
  t0 = time.perf_counter()
  plan = zj.plan(loss_fn, optax.adamw(3e-4), init, batch, gpu="h100", hosts=hosts,
                 per_host=PER_HOST, precision="bf16", stacked=_lm.in_blocks, **extra)
  wall = time.perf_counter() - t0
  commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
  out = {"model": cfg.name, "params": cfg.n_params(), "hosts": hosts, "wall": wall,
         "commit": commit + ("+" if subprocess.run(
             ["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", "zero_jax"],
             check=False).returncode else ""),
         "load": [load0, os.getloadavg()[0]], "jax": jax.__version__,
         "attention": attention, "attention_why": why,
         "best": reading(plan.best) if plan.best else None,
         "closest": reading(plan.closest) if plan.closest else None,
         "candidates": [reading(c) for c in plan.candidates],
         "compiled": len(plan.candidates), "table": str(plan),
         "estimated": [{"name": cands.describe(o), "est": t} for o, t in plan.estimated]}
  same = {k: v for k, v in (plan.best or plan.closest).loss_keywords.items() if k == "policy"}
  out["siblings"] = siblings(plan, same, init, batch)
  if hosts > 1:  # at the best candidate's remat policy, so that the rows compare
    for tag, hpz in (("hpz", {"hpz_axis": "data"}), ("flat", {})):
      opts = {"stage": 3, "axis_name": ("hosts", "data"), "quantize": None, **hpz,
              "prefetch": 1, **same}
      name = cands.describe(opts)
      got = next((reading(c) for c in plan.candidates if c.name == name), None)
      got = got or next((c for c in out["siblings"] if c["name"] == name), None)
      out[tag] = {**(got or compile_one(plan, opts, init, batch)), "name": name}
  return out


def in_child(key: str, hosts: int) -> dict:
  """`plan_one` in a fresh process."""
  out = subprocess.run([sys.executable, __file__, "--child", key, str(hosts)], check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def _mib(x: float) -> str:
  return f"{x / GiB:.2f} GiB" if x >= GiB else f"{x / MiB:,.1f} MiB"


def claim(runs: list[dict]) -> list[str]:
  """ZeRO++'s claim on hpZ, per model: cross-host bytes per device at the fewest and the most
  hosts, as sent and without the ring's (h-1)/h (what a ring over h hosts sends of a buffer)."""
  lines = []
  for name in dict.fromkeys(r["model"] for r in runs):
    rows = [r for r in runs if r["model"] == name and "hpz" in r]
    if len(rows) < 2:
      continue
    lo, hi = rows[0], rows[-1]
    g = lambda r, k: r[k]["cross"]
    per = lambda r, k: g(r, k) * r["hosts"] / (r["hosts"] - 1)
    lines.append(
        f"- {name}: with hpZ each device sends {_mib(g(lo, 'hpz'))} across hosts at "
        f"{lo['hosts']} hosts and {_mib(g(hi, 'hpz'))} at {hi['hosts']}; without the ring's "
        f"(h-1)/h factor {_mib(per(lo, 'hpz'))} and {_mib(per(hi, 'hpz'))} "
        f"(x{per(hi, 'hpz') / per(lo, 'hpz'):.3f} for {hi['hosts'] // lo['hosts']}x the "
        f"hosts). Flat ZeRO-3 without hpZ: {_mib(g(lo, 'flat'))} and {_mib(g(hi, 'flat'))}. "
        + ("The claim holds: bounded by a share that does not grow with the hosts."
           if per(hi, "hpz") <= 1.05 * per(lo, "hpz") else
           "It grows: the claim does not hold here."))
  return lines


def fastest_fitting(r: dict) -> str:
  """Whether the plan's best is, by the plan's own prediction, the fastest fitting program of
  those compiled for this row: the plan's candidates and the hpZ and flat ZeRO-3 programs
  compiled beside them (``"yes (k of n fit)"``), or which one is faster."""
  compiled = r["candidates"] + r.get("siblings", []) + [
      r[k] for k in ("hpz", "flat") if k in r
      and r[k]["name"] not in {c["name"] for c in r["candidates"] + r.get("siblings", [])}]
  fit = [c for c in compiled if c["fits"]]
  if not fit:
    return f"nothing fits (0 of {len(compiled)})"
  fastest = min(fit, key=lambda c: c["step"])
  if r["best"] and fastest["step"] >= r["best"]["step"]:
    return f"yes ({len(fit)} of {len(compiled)} fit)"
  return f"**no**: {fastest['name']} ({fastest['step'] * 1e3:.1f} ms)"


POLICY_WORDS = (" no remat", " remat saving dots", " full remat")


def layout(name: str) -> str:
  """A candidate's name less its remat policy."""
  return next((name[:-len(w)] for w in POLICY_WORDS if name.endswith(w)), name)


def why_not_fastest(r: dict) -> str:
  """For a row whose best is not the fastest fitting program: the two layouts, as the plan
  compiled them without remat (where it ranked the layouts by compiling)."""
  compiled = r["candidates"] + r.get("siblings", []) + [r[k] for k in ("hpz", "flat") if k in r]
  fastest = min((c for c in compiled if c["fits"]), key=lambda c: c["step"])
  plain = {layout(c["name"]): c["step"] for c in r["candidates"]
           if c["name"].endswith(POLICY_WORDS[0])}
  a, b = layout(r["best"]["name"]), layout(fastest["name"])
  return (f"- {r['model']} at {r['hosts']} hosts: the best, {r['best']['name']} "
          f"({r['best']['step'] * 1e3:.1f} ms), against {fastest['name']} "
          f"({fastest['step'] * 1e3:.1f} ms, {fastest['step'] / r['best']['step'] - 1:+.1%}). "
          f"Without remat, by the plan: {a} "
          + (f"{plain[a] * 1e3:.1f} ms" if a in plain else "not compiled") + f", {b} "
          + (f"{plain[b] * 1e3:.1f} ms" if b in plain else "not compiled") + ".")


def ordering(r: dict) -> str:
  """A table row: the layouts the plan compiled without remat, in the order the estimate of
  their lowered programs gives them and in the order of their compiled predictions."""
  est = {layout(e["name"]): e["est"] for e in r.get("estimated", [])}
  plain = sorted(((layout(c["name"]), c["step"]) for c in r["candidates"]
                  if c["name"].endswith(POLICY_WORDS[0]) and layout(c["name"]) in est),
                 key=lambda x: est[x[0]])
  if not plain:
    return f"| {r['model']} | {r['hosts']} x {PER_HOST} | - | - | - | - |"
  short = lambda name: name.replace(" prefetch 1", "")
  by_est = ", ".join(f"{short(n)} {est[n] * 1e3:.2f}" for n, _ in plain)
  by_comp = ", ".join(f"{short(n)} {t * 1e3:.1f}" for n, t in sorted(plain, key=lambda x: x[1]))
  lead = plain[0]
  flips = [(n, t) for n, t in plain[1:] if t < lead[1]]
  worst = max((est[n] / est[lead[0]] - 1 for n, _ in flips), default=None)
  return (f"| {r['model']} | {r['hosts']} x {PER_HOST} | {by_est} | {by_comp} | "
          + ("yes" if not flips else f"no: {len(flips)} compiled faster than the estimate's "
             f"first") + " | " + ("-" if worst is None else f"{worst:+.1%}") + " |")


def hpz_beside_best(runs: list[dict]) -> list[str]:
  """Per model, at the most hosts: ZeRO-3 with hpZ beside the best (memory, time)."""
  lines = []
  for name in dict.fromkeys(r["model"] for r in runs):
    r = [r for r in runs if r["model"] == name][-1]
    b, h = r["best"], r.get("hpz")
    if not (b and h) or b["name"] == h["name"]:
      continue
    lines.append(
        f"- {name} at {r['hosts']} hosts: {h['name']} holds {_mib(h['bytes'])} per GPU "
        f"against the best's {_mib(b['bytes'])}, for a step predicted "
        + (f"{h['step'] / b['step'] - 1:+.1%} ({h['step'] * 1e3:.1f} ms)." if h["fits"]
           else "(does not fit)."))
  return lines


def commits(runs: list[dict]) -> str:
  """Which commit each row was planned on (rows of a cache written before rows recorded it:
  "an earlier commit"); a ``+`` marks changes to zero_jax not committed yet."""
  by = {}
  for r in runs:
    by.setdefault(r.get("commit", "an earlier commit"), []).append(
        f"{r['model']} {r['hosts']}")
  if len(by) == 1:
    return f"every row on commit {next(iter(by))}"
  return "rows planned on " + "; ".join(f"{c}: {', '.join(rs)}" for c, rs in by.items())


def report(runs: list[dict]) -> str:
  import _lm  # pylint: disable=import-outside-toplevel,unused-import (this zero_jax first)
  import _report  # pylint: disable=import-outside-toplevel
  from zero_jax.gpu import candidates as cands  # pylint: disable=import-outside-toplevel
  r0 = runs[0]
  hosts = sorted({r["hosts"] for r in runs})
  checks = [fastest_fitting(r) for r in runs]
  lines = [f"## scale: zj.plan from {hosts[0]} to {hosts[-1]} hosts of 8 H100s (compiled, no "
           f"GPU; times PREDICTED)",
           "",
           f"Measured by `python benchmarks/bench_scale.py --hosts {','.join(map(str, hosts))}` "
           f"on {os.cpu_count()} CPU cores (shared with other jobs: see the load averages), "
           f"{commits(runs)}, jax "
           f"{r0['jax']}, each plan in a fresh process with zj.plan's defaults (exact "
           f"communication, max_compiles=4, 2 compiles at a time; the loss takes `zj.scan`'s "
           f"`prefetch` and `policy`, so the remat policy is searched), bf16 with AdamW, "
           f"attention: {_report.attention_words(r0['attention'], r0['attention_why'])}. GPT-2 "
           f"small: 8 x 1024 tokens per GPU; Llama-3-8B's shapes: 4 x 2048 tokens per GPU, the "
           f"embedding marked `lookup=` (read by `zj.take`). Bytes per device are XLA's memory "
           f"analysis of the GPU-compiled program; bytes sent per device and step are read "
           f"from its collectives (a collective whose group spans hosts counts as across); "
           f"step times are {_report.PREDICTED}. *best = fastest fitting*: whether the plan's "
           f"best is, by its own prediction, the fastest fitting program compiled for the row "
           f"(the plan's candidates, and the hpZ and flat ZeRO-3 programs compiled beside "
           f"them when the plan did not). "
           f"The hpZ and flat ZeRO-3 columns are compiled at the best's remat policy.",
           "",
           "| model | hosts x GPUs | best candidate | bytes/device | sent across hosts | sent "
           "within a host | predicted step | best = fastest fitting | hpZ: sent across hosts "
           "| flat ZeRO-3: sent across hosts | plan wall time | load before / after |",
           "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
  for r, check in zip(runs, checks):
    b = r["best"] or r["closest"]
    name = b["name"] if r["best"] else f"nothing fits (closest: {b['name']})"
    step = f"{b['step'] * 1e3:.1f} ms" if r["best"] else "not ranked"
    hpz = _mib(r["hpz"]["cross"]) if "hpz" in r else "-"
    flat = _mib(r["flat"]["cross"]) if "flat" in r else "-"
    lines.append(f"| {r['model']} | {r['hosts']} x {PER_HOST} | {name} | {_mib(b['bytes'])} | "
                 f"{_mib(b['cross'])} | {_mib(b['intra'])} | {step} | {check} | {hpz} | "
                 f"{flat} | {r['wall']:.0f} s | {r['load'][0]:.1f} / {r['load'][1]:.1f} |")
  bad = [r for r, c in zip(runs, checks) if c.startswith("**no**")]
  lines += ["", "**The plan's best against the fastest fitting program compiled for its row:** "
            + ("in every row above the best is the fastest, by the plan's own prediction."
               if not bad else
               f"not so in {len(bad)} of {len(runs)} rows. The plan spends `max_compiles` "
               "layout by layout, in the order its estimate of the lowered programs gives them "
               "without remat (an estimate without the memory-bound work, which only the "
               "compiled program shows): the first layout with every remat policy, the next "
               "without remat only, and every layout estimated within "
               f"{cands.NEAR_TIE:.0%} of the fastest without remat (a near tie); a layout "
               "that then compiles faster than the first under the same policy gets its other "
               "policies compiled too (`zero_jax.gpu.search.reversed_policies`). A layout the "
               "estimate ranked out is never compiled by the plan:")]
  lines += [why_not_fastest(r) for r in bad]
  if bad:
    lines += ["", "Where a row's faster layout was not compiled by the plan at all, the "
              "estimate ranked it below the `max_compiles` budget: a larger `max_compiles` "
              "compiles it."]
  lines += ["", "**The estimate against the compiled programs.** The plan ranks layouts by an "
            "estimate of their lowered programs (`zero_jax.gpu.measure.estimate`: matmuls and "
            "communication, the collectives combined as XLA's combiners combine them, no "
            "memory-bound work), then compiles the first layouts and those within "
            f"{cands.NEAR_TIE:.0%} of the fastest estimate (near ties, whatever `max_compiles` is). "
            "Per row, the layouts the plan compiled without remat, by estimate (ms) and by "
            "compiled prediction (ms), fastest first; the last column is the largest estimate "
            "gap that a compiled program reversed (a layout estimated that much slower than "
            "the first compiled faster):", "",
            "| model | hosts x GPUs | by estimate | by compiled prediction | same first? | "
            "largest reversed gap |", "|---|---:|---|---|---|---:|"]
  lines += [ordering(r) for r in runs]
  lines += ["", "ZeRO++'s claim (hpZ keeps cross-host traffic per device flat as hosts grow), on "
            "these programs:", ""] + claim(runs) + hpz_beside_best(runs)
  lines += ["", "![bytes per device, bytes across hosts and predicted step time vs hosts]"
            "(docs/scale.png)", "", "The largest plan's table "
            f"({runs[-1]['model']}, {runs[-1]['hosts']} x {PER_HOST}):", "", runs[-1]["table"]]
  return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
  """Three panels against the hosts: the best candidate's GiB per device, the MiB each GPU
  sends across hosts (the best, ZeRO-3 with hpZ, flat ZeRO-3), the predicted step time."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, axes = plt.subplots(1, 3, figsize=(13, 4))
  for name in dict.fromkeys(r["model"] for r in runs):
    rows = [r for r in runs if r["model"] == name]
    hosts = [r["hosts"] for r in rows]
    best = [r["best"] or r["closest"] for r in rows]
    line, = axes[0].plot(hosts, [b["bytes"] / GiB for b in best], "o-", label=name)
    colour = line.get_color()
    many = [r for r in rows if "hpz" in r]
    x = [r["hosts"] for r in many]
    axes[1].plot(x, [(r["best"] or r["closest"])["cross"] / MiB for r in many], "o-",
                 color=colour, label=f"{name}: best")
    axes[1].plot(x, [r["hpz"]["cross"] / MiB for r in many], "s", color=colour, alpha=0.5,
                 markersize=9, label=f"{name}: ZeRO-3 hpZ")
    axes[1].plot(x, [r["flat"]["cross"] / MiB for r in many], "^:", color=colour,
                 label=f"{name}: flat ZeRO-3")
    axes[2].plot(hosts, [b["step"] * 1e3 for b in best], "o-", color=colour, label=name)
  titles = ("best candidate: GiB per GPU", "MiB each GPU sends across hosts per step",
            "PREDICTED step time (ms; at least 1.2x optimistic)")
  for ax, title in zip(axes, titles):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 2, 4, 8, 16, 32], ["1", "2", "4", "8", "16", "32"])
    ax.set_xlabel("hosts (8 H100s each)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both")
  axes[1].set_ylim(top=axes[1].get_ylim()[1] * 30)   # room for the legend above the lines
  axes[1].legend(fontsize=7, ncol=2, loc="upper left")
  axes[0].legend(fontsize=8)
  fig.suptitle("zj.plan's best candidate from 1 to 32 hosts (compiled for H100s, no GPU)",
               fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--models", default="small,8b")
  p.add_argument("--hosts", default="1,2,4,8,16,32")
  p.add_argument("--cache", default="/tmp/zero_jax_scale_v2.json")
  p.add_argument("--no-write", action="store_true")
  p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    print(json.dumps(plan_one(args.child[0], int(args.child[1]))))
    return
  cache = json.load(open(args.cache)) if os.path.exists(args.cache) else {}
  runs = []
  for key in args.models.split(","):
    for hosts in map(int, args.hosts.split(",")):
      tag = f"{key}/{hosts}"
      if "siblings" not in cache.get(tag, {}):  # absent, or from an earlier version of this
        cache[tag] = in_child(key, hosts)
        json.dump(cache, open(args.cache, "w"))
        r = cache[tag]
        print(f"{tag}: {r['wall']:.0f} s, attention {r['attention']} ({r['attention_why']}), "
              f"best {(r['best'] or {}).get('name')}", flush=True)
      runs.append(cache[tag])
  text = report(runs)
  print(text)
  if not args.no_write:
    import _report  # pylint: disable=import-outside-toplevel
    _report.write_section("scale", text)
    plot(runs, os.path.join(ROOT, "docs", "scale.png"))


if __name__ == "__main__":
  main()
