"""Per-device memory of ZeRO stages 1, 2, 3 on 1, 2, 4, 8 devices, and stage 3's step time.

The deep model is a GELU MLP of 16 layers of 512 x 512 (+ bias), a few million
parameters, trained with Adam, written twice:

- ``scanned``: the layers' weights stacked, ``(L, W, W)`` and ``(L, W)``, and a
  ``lax.scan`` over them whose body (under ``jax.checkpoint``) gathers its layer
  with ``zj.gather``; marked ``stacked=True``. The same ``loss_fn`` runs at every
  stage.
- ``unrolled``: one leaf per layer and a Python loop (``_step_common.mlp_loss``),
  which stage 3 gathers before calling ``loss_fn``.

Each is compiled for stages 1-3 on meshes over the first N = 1, 2, 4, 8 CPU
devices; XLA's ``memory_analysis()`` gives each program's per-device argument and
temp bytes. For the unrolled stage 3 on 8 devices it also reads where the
all-gathers are in the lowered and the compiled program. Then it times stages 2
and 3 of both models on 8 devices (interleaved, in each malloc condition of
``_step_common.CONDITIONS``) and writes the "stages" section of BENCHMARKS.md.

Usage:
  python benchmarks/bench_stages.py [--quick] [--no-write] [--conditions retain,default]
"""

from __future__ import annotations

import re

import _step_common as sc  # first: sets up 8 CPU devices
from _report import machine

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

zj = sc.zj
NS = [1, 2, 4, 8]
MODELS = ("scanned", "unrolled")


def config(quick):
  if quick:
    return dict(layers=6, width=256, batch_size=64, rounds=5, iters=2)
  return dict(layers=16, width=512, batch_size=64, rounds=11, iters=2)


def scanned_loss(params, batch):
  """The unrolled MLP's loss over stacked layers: one gather per layer, inside the loop.

  Every layer is scanned (the last one has no GELU, chosen by its index): slicing the
  stack (``params[:-1]``) would copy the sliced weights before the loop.
  """
  last = params["w"].shape[0] - 1

  @jax.checkpoint  # the backward loop gathers each layer again
  def layer(h, xs):
    lp, i = xs
    lp = zj.gather(lp)
    h = h @ lp["w"] + lp["b"]
    return jnp.where(i < last, jax.nn.gelu(h), h), None

  h, _ = jax.lax.scan(layer, batch["x"], (params, jnp.arange(last + 1)))
  return jnp.mean(jnp.square(h - batch["y"]))


def setup(cfg):
  unrolled = sc.init_mlp(jax.random.key(0), [cfg["width"]] * (cfg["layers"] + 1))
  names = sorted(unrolled)
  scanned = {k: np.stack([unrolled[n][k] for n in names]) for k in ("w", "b")}
  batch = {k: jax.ShapeDtypeStruct((cfg["batch_size"], cfg["width"]), jnp.float32)
           for k in ("x", "y")}
  return {"scanned": scanned, "unrolled": unrolled}, batch


def make_step(model, stage, mesh):
  if model == "scanned":
    return zj.make_sharded_train_step(scanned_loss, optax.adam(1e-3), mesh=mesh, stage=stage,
                                      stacked=True)
  return zj.make_sharded_train_step(sc.mlp_loss, optax.adam(1e-3), mesh=mesh, stage=stage)


def schedule_facts(hlo: str) -> dict:
  """Where the all-gathers sit in a compiled (scheduled) program's entry computation."""
  entry = hlo[hlo.index("\nENTRY"):].splitlines()
  gathers = [i for i, line in enumerate(entry) if re.search(r"\sall-gather(-start)?\(", line)]
  dots = [i for i, line in enumerate(entry)
          if "dot_general" in line and not re.search(r"\sall-gather", line)]
  return {"gathers": len(gathers),
          "before_first_dot": sum(i < dots[0] for i in gathers) if dots else None}


def measure(args) -> dict:
  cfg = config(args.quick)
  params, batch = setup(cfg)
  out = {"psi": sc.n_params(params["unrolled"]), "mem": {}}
  if not args.timing_only:
    for n in NS:
      mesh = sc.mesh_of(n)
      for model in MODELS:
        for stage in (1, 2, 3):
          step = make_step(model, stage, mesh)
          lowered = step.lower(step.abstract_state(params[model]), batch)
          compiled = lowered.compile()
          out["mem"][f"{model},{n},{stage}"] = sc.memory(compiled)
          print(model, n, stage, out["mem"][f"{model},{n},{stage}"], flush=True)
          if n == 8 and stage == 3:
            text = compiled.as_text()
            facts = schedule_facts(text)
            facts["lowered_gathers"] = lowered.as_text().count("stablehlo.all_gather")
            facts["colls"] = sc.collectives_str(text)
            out[f"facts,{model}"] = facts
            print(facts, flush=True)

  mesh = sc.mesh_of(8)
  placed = sc.place_batch(sc.make_batches(jax.random.key(1), 1, cfg["batch_size"], cfg["width"],
                                          cfg["width"])[0], mesh)
  steps, states, losses = {}, {}, {}
  for model in MODELS:
    for stage in (2, 3):
      name = f"{model} stage {stage}"
      steps[name] = make_step(model, stage, mesh)
      states[name] = steps[name].init(params[model])
      states[name], m = steps[name](states[name], placed)
      losses[name] = float(m["loss"])
  out["losses"] = losses

  out["times"] = sc.interleave(sc.steppers(steps, states, placed), rounds=cfg["rounds"],
                               iters=cfg["iters"])
  return out


def render(results, args, seconds) -> str:
  cfg = config(args.quick)
  conds = list(results)
  first = results[conds[0]]
  psi, mem = first["psi"], first["mem"]
  cell = lambda m: f"{sc.mib(m['arg'])} + {sc.mib(m['temp'])} = **{sc.mib(m['arg'] + m['temp'])}**"
  rows = [[n] + [cell(mem[f"scanned,{n},{s}"]) for s in (1, 2, 3)]
          + [cell(mem[f"unrolled,{n},{s}"]) for s in (2, 3)] for n in NS]
  tab = sc.table(["N", "stage 1", "stage 2", "stage 3", "unrolled: stage 2",
                  "unrolled: stage 3"], rows)
  t3 = {n: mem[f"scanned,{n},3"]["temp"] for n in NS}
  tot = lambda k: mem[k]["arg"] + mem[k]["temp"]
  fs, fu = first["facts,scanned"], first["facts,unrolled"]
  layer = (cfg["width"] ** 2 + cfg["width"]) * 4
  time_rows = []
  for c in conds:
    t = results[c]["times"]
    for model in MODELS:
      time_rows.append([c, model, sc.spread(t[f"{model} stage 2"]),
                        sc.spread(t[f"{model} stage 3"]),
                        sc.ratio_iqr(t, f"{model} stage 3", f"{model} stage 2")])
  for c in conds:
    t = results[c]["times"]
    time_rows.append([c, "scanned stage 3 vs unrolled stage 2", sc.spread(t["unrolled stage 2"]),
                      sc.spread(t["scanned stage 3"]),
                      sc.ratio_iqr(t, "scanned stage 3", "unrolled stage 2")])
  time_tab = sc.table(["malloc condition", "model", "stage 2 ms", "stage 3 ms",
                       "stage 3 / stage 2"], time_rows)
  losses = ", ".join(f"{k} {v:.6f}" for k, v in first["losses"].items())
  conds_text = "\n".join(f"- `{c}`: {sc.CONDITION_TEXT[c]}" for c in conds)
  return f"""## stages: per-device memory of stages 1-3 vs N, and stage 3's cost

Machine: {machine()}. Model: GELU MLP, {cfg['layers']} layers of {cfg['width']} x {cfg['width']}
(+ bias), Ψ = {psi:,} fp32 parameters ({psi * 4 / sc.MIB:.2f} MiB; one layer
{layer / sc.MIB:.2f} MiB), Adam, global batch {cfg['batch_size']}; meshes over the first N CPU
devices. Written two ways: **scanned** (weights stacked `(L, W, W)`, `lax.scan` over them,
the body under `jax.checkpoint` gathering its layer with `zj.gather`, `stacked=True`; the
same `loss_fn` at every stage) and **unrolled** (a leaf per layer, a Python loop; stage 3
gathers every leaf before `loss_fn`). MiB per device from XLA's `compiled.memory_analysis()`:
`arg` (params + Adam state + batch) + `temp` (everything transient) = **total**.
`python benchmarks/bench_stages.py{' --quick' if args.quick else ''}` ({seconds:.0f} s in all).

{tab}

- **Stage 3 (scanned) falls like 1/N**: `arg` ≈ 12Ψ/N (params and Adam state all split) and
  `temp` {'; '.join(f'N={n}: {sc.mib(t3[n])}' for n in NS)} MiB: gradient blocks, Adam's
  update temporaries and one or two gathered layers. On 8 devices it needs
  {sc.mib(tot('scanned,8,3'))} MiB against stage 2's {sc.mib(tot('scanned,8,2'))} MiB and stage
  1's {sc.mib(tot('scanned,8,1'))} MiB. The compiled step has {fs['gathers']} all-gathers in its
  entry computation; all the others are inside the layer loop ({fs['colls']}).
- **Stage 2 of the scanned model** keeps 4Ψ of replicated parameters; `zj.gather`'s
  transpose reduce-scatters each layer's gradient inside the backward loop, so the loop
  accumulates only the device's block, and the updated layers are gathered one at a time
  into the parameters' buffer. Its temp falls with N ({sc.mib(mem['scanned,1,2']['temp'])}
  -> {sc.mib(mem['scanned,8,2']['temp'])} MiB from N=1 to 8; the unrolled stage 2's:
  {sc.mib(mem['unrolled,8,2']['temp'])} MiB on 8 devices). **Stage 1** all-reduces the
  gradient by definition: the scan's backward writes every layer's full gradient into one
  `(L, W, W)` buffer first, so its temp does not fall with N.
- **Stage 3 without stacked leaves does not save memory on XLA:CPU**: unrolled, on 8
  devices, {sc.mib(tot('unrolled,8,3'))} MiB, about stage 2's. The lowered program asks for
  {fu['lowered_gathers']} all-gathers (every leaf in the forward pass, and again in the
  backward pass behind `jax.checkpoint`'s optimization barrier); the compiled one keeps
  {fu['gathers']}, {fu['before_first_dot']} of them before the first matmul. XLA:CPU removes the
  barrier (`cse_barrier_expander`), merges each re-gather into its forward twin (`cse`), and
  its scheduler issues every gather first (a gather depends only on its shard), so the whole
  model is resident at once. A loop is a dependency XLA keeps; hence `stacked=`.

Step time on 8 devices (losses after one step: {losses}), interleaved ({cfg['rounds']} rounds
x {cfg['iters']} steps, order rotated; ratio = median (IQR) of paired per-round ratios; the
host's 2 cores are shared with other jobs, so absolute times are noisy; 1-min load average
{sc.load_text(results)}). Each malloc condition is its own process:
{conds_text}

{time_tab}

The scanned stage 3 recomputes each layer's forward pass in the backward pass (the
`jax.checkpoint` that makes it gather again); the scanned stage 2 runs the same `loss_fn`, so
its row compares like with like, and its large `temp` is what makes it slow in the `default`
malloc condition (page faults). The last rows compare the scanned stage 3 with the best
stage 2 here, the unrolled one, which does no recomputation.
"""


if __name__ == "__main__":
  sc.main(__doc__, __file__, measure, render, "stages")
