"""Overlap by shape: does every in-loop collective of a stage-3 ``zj.scan`` step have another
layer's matmul in its window, whatever the model's shape? (compile-only GPUs, no GPU needed)

Writes the ``overlap-sweep`` section of BENCHMARKS.md. Each case is an MLP of ``--layers``
layers (width ``d``, hidden ``2 d``, gelu; ``residual``: ``h + f(h)``, ``plain``: ``f(h)``),
stacked and looped with ``zj.scan(prefetch=1, policy=...)`` in a stage-3 bf16 AdamW step,
``rows`` rows per GPU, on 1 x 8 GPUs, 2 x 8 with hpZ (weights gathered within a host) or 2 x 8
with a replica axis across the hosts (``2x8-replica``: ``replica_axis="hosts"``, hybrid
sharding as FSDP2's HSDP: state split within a host, gradients all-reduced across), compiled for compile-only H100/H200/A100 with the step's own compiler options
(``step.compiler_options``, as a user gets them from the step or ``step.jit``). For each
program `zero_jax.gpu.schedule.loops` reads, in the forward and backward layer loops, every
async collective and the matmuls XLA:GPU scheduled between its start and its done; a case
reports ``x/y``: the collectives with a matmul in their window out of those in the loops.

Before and after: ``--record FILE`` writes the results as JSON and nothing else; run it with
the code before issue 46.4c's fix first imported (``PYTHONPATH=<a copy of that commit's
zero_jax>``), then ``--before FILE`` puts them beside this code's in the section (``--now
FILE``: this code's, recorded the same way, instead of compiling them again).

Usage: ``python benchmarks/bench_overlap_sweep.py [--grid SPEC]... [--layers 8]
[--record FILE | --before FILE [--now FILE]] [--note TEXT] [--no-write]`` (needs JAX's CUDA plugin: the GPU
tier's venv). Each ``--grid`` is a product, ``gpus=a100,h100;meshes=1x8,2x8;kinds=residual,plain;
policies=none,dots,full;shapes=512x128,8192x4096`` (width x rows per GPU; a key left out takes
every value, shapes `SHAPES`); the cases are the union of the grids (`GRIDS` by default).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import optax

import _report
import zero_jax as zj
from zero_jax.gpu import schedule

POLICIES = {"none": None, "dots": jax.checkpoint_policies.dots_saveable,
            "full": jax.checkpoint_policies.nothing_saveable}
MESHES = ("1x8", "2x8", "2x8-replica")
KINDS = ("residual", "plain")
GPUS = ("a100", "h100", "h200")
SHAPES = ("512x128", "2048x512", "8192x4096")  # width x rows per GPU
# The default sweep, sized for a 2-core CPU (102 cases, 25 to 40 min of compiles there): every
# target, layer kind and policy on one host at a small, the A100 issue's and a large shape;
# two hosts (hpZ) at both ends for residual layers; two hosts with a replica axis (hybrid):
# every target, layer kind and policy at two widths between those.
GRIDS = ("meshes=1x8",
         "meshes=2x8;kinds=residual;policies=none,full;shapes=512x128,8192x4096",
         "meshes=2x8-replica;shapes=1024x256,4096x1024")


def loss_for(kind: str, policy):
  """The MLP's loss: ``kind`` ``"residual"`` (``h + f(h)``) or ``"plain"`` (``f(h)``)."""
  def layer(h, w):
    f = jax.nn.gelu(h @ w["up"]) @ w["down"]
    return (h + f if kind == "residual" else f), None

  def loss_fn(p, b):
    h, _ = zj.scan(layer, b, p["layers"], prefetch=1, policy=policy)
    return jnp.mean(h.astype(jnp.float32) ** 2)
  return loss_fn


def make_step(gpu: str, mesh_name: str, kind: str, policy: str):
  """The stage-3 bf16 AdamW step of one case, on compile-only GPUs."""
  if mesh_name == "1x8":
    mesh, opts = zj.compile_only_mesh((8,), ("data",), gpu=gpu), {}
  else:
    mesh = zj.compile_only_mesh((2, 8), ("hosts", "data"), gpu=gpu, hosts=2)
    opts = ({"replica_axis": "hosts"} if mesh_name == "2x8-replica" else
            {"axis_name": ("hosts", "data"), "hpz_axis": "data"})
  return zj.make_sharded_train_step(loss_for(kind, POLICIES[policy]), optax.adam(1e-3),
                                    mesh=mesh, stage=3, stacked=True, precision="bf16", **opts)


def inputs(step, width: int, rows: int, layers: int, mesh_name: str):
  """``(abstract state, batch)`` of one case: shapes only."""
  shapes = {"up": (layers, width, 2 * width), "down": (layers, 2 * width, width)}
  params = {"layers": {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}}
  devices = 8 if mesh_name == "1x8" else 16
  return (step.abstract_state(params),
          jax.ShapeDtypeStruct((rows * devices, width), jnp.float32))


def overlapped(text: str) -> tuple[int, int, list]:
  """``(with a matmul in their window, collectives, the exposed ones)`` over the layer loops
  (the ``while`` loops holding async collectives) of a compiled program."""
  ws = [(l.name, w) for l in schedule.loops(text) for w in l.windows]
  bare = [f"{name}:{w.op}" for name, w in ws if not w.flops > 0]
  return len(ws) - len(bare), len(ws), bare


def compile_case(gpu, mesh_name, kind, policy, width, rows, layers) -> dict:
  """One case compiled with the step's own options (``step.lower(...).compile()``)."""
  step = make_step(gpu, mesh_name, kind, policy)
  lowered = step.lower(*inputs(step, width, rows, layers, mesh_name))
  t0 = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  x, y, bare = overlapped(compiled.as_text())
  return {"x": x, "y": y, "bare": bare, "seconds": seconds,
          "temp": compiled.memory_analysis().temp_size_in_bytes}


def cases(spec: str) -> list[tuple]:
  """The cases ``(gpu, mesh, kind, policy, width, rows)`` of one ``--grid`` product."""
  allowed = {"gpus": GPUS, "meshes": MESHES, "kinds": KINDS, "policies": tuple(POLICIES),
             "shapes": None}
  got = dict(allowed, shapes=SHAPES)
  for part in filter(None, spec.split(";")):
    key, _, values = part.partition("=")
    if key not in allowed:
      raise SystemExit(f"--grid {spec!r}: unknown key {key!r}; choose from {list(allowed)}")
    got[key] = tuple(_names(values, allowed[key]) if allowed[key] else values.split(","))
  shapes = [tuple(int(v) for v in s.split("x")) for s in got["shapes"]]
  return [(g, m, k, p, w, r) for g, m, k, p, (w, r) in itertools.product(
      got["gpus"], got["meshes"], got["kinds"], got["policies"], shapes)]


def _names(s: str, allowed) -> list[str]:
  out = [v for v in s.split(",") if v]
  bad = [v for v in out if v not in allowed]
  if bad:
    raise SystemExit(f"unknown {bad}; choose from {list(allowed)}")
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--grid", action="append", help="a product of cases (see the module doc)")
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--record", help="write the results to this JSON file, and no section")
  ap.add_argument("--before", help="results recorded by --record with the code before the fix")
  ap.add_argument("--now", help="this code's results recorded by --record (nothing compiled)")
  ap.add_argument("--note", help="a paragraph put after the summary (where rows come from)")
  ap.add_argument("--no-write", action="store_true")
  args = ap.parse_args(argv)
  specs = args.grid or list(GRIDS)
  grid = list(dict.fromkeys(c for spec in specs for c in cases(spec)))
  read = lambda f: {tuple(r["case"]): r for r in json.loads(pathlib.Path(f).read_text())}
  before = read(args.before) if args.before else {}
  now = read(args.now) if args.now else {}
  results, lines = [], []
  for case in grid:
    r = now[case] if args.now else compile_case(*case, args.layers)
    results.append({**r, "case": list(case)})
    was = before.get(case)
    cells = ([_cell(was) if was else "-"] if args.before else []) + [_cell(r)]
    temps = (f"{was['temp'] / 2**20:.0f} / " if was else "- / " if args.before else "") + \
        f"{r['temp'] / 2**20:.0f}"
    lines.append(f"| {' | '.join(map(str, case))} | {' | '.join(cells)} | {temps} |")
    print(lines[-1], f"({r['seconds']:.1f} s)", flush=True)
  minutes = {label: sum(r["seconds"] for r in rs) / 60
             for label, rs in (("before", [before[c] for c in grid if c in before]),
                               ("now", results)) if rs}
  if args.record:
    pathlib.Path(args.record).write_text(json.dumps(results, indent=1))
    return
  cols = (["before: with a matmul"] if args.before else []) + ["with a matmul"]
  summary = _summary("this code", results)
  if args.before:
    summary = _summary("before", [before[c] for c in grid if c in before]) + "; " + summary
    summary += "; " + _growth(before, results)
  md = "\n".join([
      "## overlap sweep: every in-loop collective with a matmul in its window, by shape",
      "",
      f"`python benchmarks/bench_overlap_sweep.py "
      f"{' '.join(repr(f'--grid={g}') for g in specs)} --layers {args.layers}`: {len(grid)} "
      f"cases, XLA:GPU compile time "
      f"{', '.join(f'{k} {v:.1f} min' for k, v in minutes.items())} on {_report.machine()} "
      f"(a 2-core CPU shared with other jobs), compile-only GPUs, no GPU run. Each case: a "
      f"stage-3 bf16 AdamW step over a "
      f"{args.layers}-layer MLP (width d, hidden 2d, gelu; residual `h + f(h)` or plain "
      f"`f(h)`), `zj.scan(prefetch=1, policy=...)` (none: keep what lax.scan keeps, dots: "
      f"`dots_saveable`, full: `nothing_saveable`), 1 x 8 GPUs, 2 x 8 with hpZ, or 2 x 8 "
      f"with a replica axis across the hosts (`2x8-replica`: `replica_axis=\"hosts\"`, "
      f"hybrid sharding), compiled with the step's own compiler options. A cell is x/y: of the y async collectives in "
      f"the forward and backward layer loops, x have a matmul scheduled between their start "
      f"and their done (`zero_jax.gpu.schedule.loops`); the bare ones are named by loop. "
      + ("`before`: the same cases compiled with the code before issue 46.4c's fix (recorded "
         "with `--record`, read with `--before`; `-`: a case not compiled with it). "
         if args.before else "")
      + "Temp: XLA's temporary bytes per GPU (`memory_analysis()`).",
      "",
      f"Summary: {summary}.",
      "",
      *([args.note, ""] if args.note else []),
      "| gpu | mesh | layer | policy | width | rows/GPU | " + " | ".join(cols)
      + " | temp MiB" + (" (before / now)" if args.before else "") + " |",
      "|" + "---|" * (7 + len(cols)),
      *lines,
  ])
  _report.publish("overlap-sweep", md, write=not args.no_write)


def _cell(r: dict) -> str:
  return f"{r['x']}/{r['y']}" + (f" (bare: {', '.join(r['bare'])})" if r["bare"] else "")


def _growth(before: dict, results: list) -> str:
  """The largest growth of the temporary bytes against ``before``, beside that case's layer
  (its two weights gathered in bf16: the buffer one more layer in flight would cost)."""
  grown = [(r["temp"] - before[tuple(r["case"])]["temp"], r["case"]) for r in results
           if tuple(r["case"]) in before]
  if not grown:
    return "no case to compare temporaries with"
  most, case = max(grown, key=lambda g: g[0])
  layer = 2 * case[4] * 2 * case[4] * 2  # up and down, width x 2 width, bf16
  return (f"temporaries: at most {most / 2**20:+.0f} MiB ({' '.join(map(str, case))}: "
          f"{most / layer:.2f} of one gathered layer, {layer / 2**20:.0f} MiB), "
          f"{sum(g < 0 for g, _ in grown)} cases lower, {sum(g == 0 for g, _ in grown)} equal")


def _summary(label: str, results: list) -> str:
  x = sum(r["x"] for r in results)
  y = sum(r["y"] for r in results)
  full = sum(r["x"] == r["y"] for r in results)
  return (f"{label}: {x}/{y} collectives with a matmul in their window, {full}/{len(results)} "
          f"cases with every window filled")


if __name__ == "__main__":
  main()
