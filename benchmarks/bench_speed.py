"""Speed: one device vs plain optax, many small leaves vs plain DP, scanned stage 2, stage 3
with accumulation, a real transformer vs plain DP, and the host-side cost of a call.

Writes the ``speed`` section of BENCHMARKS.md. Every time is a median over rounds of
interleaved, blocking steps (the variants take turns in one process; see
``_step_common.interleave``), with the interquartile range; ratios are paired by round.

1. **One device.** The same script on a 1-device mesh vs a plain ``jax.jit`` of
   ``value_and_grad`` + the optax update: a 6 x 768^2 MLP with AdamW and the LM
   example's model (``examples/train_lm.py``, size small).
2. **Many small leaves.** 24 layers of width 128, each a weight, a bias and two
   per-feature vectors (96 leaves), AdamW, 8 devices: ZeRO-2 (buckets on and off)
   vs plain data parallelism (replicated optax after a ``pmean``), and the number of
   collectives in each compiled program.
3. **Scanned stage 2.** Per-device XLA temp of a stacked, scanned 8 x 256^2 model at
   N = 1, 2, 4, 8 against the same model unrolled.
4. **Stage 3 with accumulation** (``grad_accum_steps=4``): parameters gathered per
   micro-batch (default) vs once per step (``gather_once=True``).
5. **A real transformer** (``_lm.LM1B``: Flax's lm1b decoder in miniature, padded batches,
   ``zj.WeightedLoss``), AdamW, 8 devices: plain data parallelism (one ``jax.jit``, params and
   optimizer state replicated, batch split) vs ZeRO-2 (buckets on and off) and ZeRO-3, in wall
   time and in the process's CPU time; then the same steps with a loss that does almost no
   model work, which leaves what the reduction, the update and the parameter gather cost.
6. **Host time per call** on the LM example's model: ``step(state, batch)`` as a user
   calls it (state check, batch check and placement, dispatch) vs the jitted function
   called directly with a placed batch.

Usage: ``python benchmarks/bench_speed.py [--quick] [--no-write]``.
"""

from __future__ import annotations

import os
import sys
import time

import _step_common as sc  # 8 fake CPU devices, before anything touches JAX
import _lm  # noqa: E402
import _timing  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import zero_jax as zj  # noqa: E402
from zero_jax.step import context  # noqa: E402
from zero_jax.gpu import predict as overlap  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_lm  # noqa: E402


def plain_optax(loss_fn, optimizer):
  """A plain single-device step: ``(params, opt_state), batch -> (state, loss)``."""
  def step(st, batch):
    params, opt_state = st
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss
  return jax.jit(step, donate_argnums=(0,))


def one_device(loss_fn, params, batch, optimizer, rounds, iters) -> dict:
  mesh1 = Mesh(np.array(jax.devices()[:1]), ("data",))
  dev = jax.devices()[0]
  p0 = jax.device_put(params, dev)
  step = zj.make_sharded_train_step(loss_fn, optimizer, mesh=mesh1, stacked=train_lm.in_blocks)
  states = {"plain optax": (p0, optimizer.init(p0)), "zero_jax": step.init(params)}
  runs = {"plain optax": plain_optax(loss_fn, optimizer), "zero_jax": step}
  placed = jax.device_put(batch, NamedSharding(mesh1, P("data")))
  fns = sc.steppers(runs, states, placed)
  t = sc.interleave(fns, rounds=rounds, iters=iters)
  return {"times": {k: sc.spread(v) for k, v in t.items()},
          "ratio": sc.ratio_iqr(t, "zero_jax", "plain optax")}


def mlp_case(quick):
  width, layers, rows = (256, 3, 64) if quick else (768, 6, 256)
  params = sc.init_mlp(jax.random.key(0), [width] * (layers + 1))
  batch = sc.make_batches(jax.random.key(1), 1, rows, width, width)[0]
  return f"MLP {layers} x {width}^2, batch {rows}", sc.mlp_loss, params, batch


def lm_case(quick, n_rows=32):
  d, layers, heads = train_lm.SIZES["tiny" if quick else "small"]
  model = train_lm.ByteLM(d, layers, heads, max_len=128)
  params = jax.tree.map(np.asarray, model.init(jax.random.key(0),
                                               jnp.zeros((1, 128), jnp.int32))["params"])
  r = np.random.default_rng(0)
  batch = {"tokens": r.integers(0, train_lm.VOCAB, size=(n_rows, 129)).astype(np.int32)}
  return (f"LM example ({'tiny' if quick else 'small'}, {sc.n_params(params):,} params), "
          f"batch {n_rows} x 128", train_lm.make_loss_fn(model), params, batch)


# ------------------------------------------------------------- small leaves
def small_leaves(layers, width):
  r = np.random.default_rng(0)
  return {f"l{i:02d}": {"w": (r.normal(size=(width, width)) / np.sqrt(width)).astype(np.float32),
                        "b": np.zeros(width, np.float32), "g": np.ones(width, np.float32),
                        "s": np.zeros(width, np.float32)} for i in range(layers)}


def small_loss(p, b):
  h = b["x"]
  for name in sorted(p):
    h = h @ p[name]["w"] + p[name]["b"]
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = jax.nn.gelu((h - mu) * jax.lax.rsqrt(var + 1e-5) * p[name]["g"] + p[name]["s"])
  return jnp.mean((h - b["y"]) ** 2)


def many_leaves(quick, rounds, iters) -> dict:
  layers, width = (8, 64) if quick else (24, 128)
  params = small_leaves(layers, width)
  mesh = sc.mesh_of(8)
  opt = optax.adamw(1e-3)
  batch = sc.place_batch(sc.make_batches(jax.random.key(1), 1, 64, width, width)[0], mesh)
  dp_init, dp_step = sc.make_dp_step(small_loss, opt, mesh)
  steps = {"zero2 (buckets)": zj.make_sharded_train_step(small_loss, opt, mesh=mesh),
           "zero2 (one per leaf)": zj.make_sharded_train_step(small_loss, opt, mesh=mesh,
                                                              bucket_bytes=0)}
  runs = {"plain DP": lambda st, b: (lambda p, o, l: ((p, o), l))(*dp_step(*st, b)), **steps}
  states = {"plain DP": dp_init(params), **{k: s.init(params) for k, s in steps.items()}}
  counts = {"plain DP": sc.collectives_str(dp_step.lower(*states["plain DP"], batch)
                                           .compile().as_text())}
  for k, s in steps.items():
    counts[k] = sc.collectives_str(s.lower(states[k], batch).compile().as_text())
  t = sc.interleave(sc.steppers(runs, states, batch), rounds=rounds, iters=iters)
  return {"model": f"{layers} layers x (w {width}^2, b, g, s) = {4 * layers} leaves, "
                   f"{sc.n_params(params):,} params, AdamW, 8 devices, batch 64",
          "times": {k: sc.spread(v) for k, v in t.items()},
          "ratios": {k: sc.ratio_iqr(t, k, "plain DP") for k in steps}, "collectives": counts}


# ---------------------------------------------------------------- memory
def scan_loss(p, b):
  @jax.checkpoint
  def layer(h, lp):
    lp = zj.gather(lp)
    return jax.nn.gelu(h @ lp["w"] + lp["b"]), None
  h, _ = jax.lax.scan(layer, b["x"], p)
  return jnp.mean((h - b["y"]) ** 2)


def unrolled_loss(p, b):
  h = b["x"]
  for name in sorted(p):
    h = jax.nn.gelu(h @ p[name]["w"] + p[name]["b"])
  return jnp.mean((h - b["y"]) ** 2)


def scanned_stage2(quick) -> dict:
  layers, width = (4, 128) if quick else (8, 256)
  sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  stacked = {"w": sds(layers, width, width), "b": sds(layers, width)}
  unrolled = {f"l{i}": {"w": sds(width, width), "b": sds(width)} for i in range(layers)}
  batch = {k: sds(32, width) for k in ("x", "y")}
  out = {}
  for n in (1, 2, 4, 8):
    mesh = sc.mesh_of(n)
    row = {}
    for name, loss, params, kw in (("scanned", scan_loss, stacked, {"stacked": True}),
                                   ("unrolled", unrolled_loss, unrolled, {})):
      step = zj.make_sharded_train_step(loss, optax.adam(1e-3), mesh=mesh, stage=2, **kw)
      row[name] = sc.memory(step.lower(step.abstract_state(params), batch).compile())
    out[n] = row
  return {"model": f"{layers} layers of {width}^2 (+bias), Adam, batch 32", "by_n": out}


def stage3_accumulation(quick, rounds, iters) -> dict:
  width, layers, rows = (128, 4, 64) if quick else (512, 8, 128)
  params = sc.init_mlp(jax.random.key(0), [width] * (layers + 1))
  mesh = sc.mesh_of(8)
  batch = sc.place_batch(sc.make_batches(jax.random.key(1), 1, rows, width, width)[0], mesh)
  steps = {f"gather_once={once}": zj.make_sharded_train_step(
      sc.mlp_loss, optax.adam(1e-3), mesh=mesh, stage=3, grad_accum_steps=4, gather_once=once)
      for once in (False, True)}
  states = {k: s.init(params) for k, s in steps.items()}
  mem = {k: sc.memory(s.lower(states[k], batch).compile()) for k, s in steps.items()}
  coll = {k: sc.collectives_str(s.lower(states[k], batch).compile().as_text())
          for k, s in steps.items()}
  t = sc.interleave(sc.steppers(steps, states, batch), rounds=rounds, iters=iters)
  return {"model": f"MLP {layers} x {width}^2, Adam, 8 devices, batch {rows}, 4 micro-batches",
          "times": {k: sc.spread(v) for k, v in t.items()},
          "ratio": sc.ratio_iqr(t, "gather_once=True", "gather_once=False"),
          "memory": mem, "collectives": coll}


# -------------------------------------------------------- real transformer
def jit_dp_step(loss_fn, optimizer, mesh):
  """Plain data parallelism as a user writes it: one ``jax.jit`` over the global batch
  (split over ``data``), parameters and optimizer state replicated; a `WeightedLoss` is
  divided out. Returns ``(init, step)``, ``step(state, batch) -> (state, loss)``."""
  rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(sc.AXIS))

  def mean_loss(p, b):
    out = loss_fn(p, b)
    return out.total / out.weight

  def step(st, b):
    loss, grads = jax.value_and_grad(mean_loss)(st[0], b)
    updates, opt_state = optimizer.update(grads, st[1], st[0])
    return (optax.apply_updates(st[0], updates), opt_state), loss

  def init(params):
    params = jax.device_put(params, rep)
    return params, jax.jit(optimizer.init, out_shardings=rep)(params)

  return init, jax.jit(step, in_shardings=((rep, rep), split), out_shardings=((rep, rep), rep),
                       donate_argnums=(0,))


def no_model_work(p, b):
  """A loss of the same parameters and batch that does (almost) no model work."""
  w = (b["targets"] > 0).astype(jnp.float32)
  return zj.WeightedLoss(1e-6 * w.sum() * sum(jnp.sum(x) for x in jax.tree.leaves(p)), w.sum())


def real_transformer(quick, rounds, iters, count_flops) -> dict:
  cfg = (_lm.LM1BConfig(500, 64, 2, 256, 2, 32) if quick else
         _lm.LM1BConfig(2000, 128, 4, 512, 4, 64))
  params = _lm.lm1b_params(cfg)
  mesh, opt = sc.mesh_of(8), optax.adamw(1e-3)
  batch = sc.place_batch(_lm.lm1b_batch(cfg, 32, seed=0), mesh)
  out = {"title": f"lm1b-like: vocab {cfg.vocab}, d {cfg.d_model}, {cfg.heads} heads, MLP "
                  f"{cfg.mlp}, {cfg.layers} layers, {sc.n_params(params):,} params; AdamW, 8 "
                  f"devices, batch 32 x {cfg.seq_len} padded to random lengths"}
  for part, loss in (("steps", _lm.make_lm1b_loss(cfg)), ("no model work", no_model_work)):
    dp_init, dp_step = jit_dp_step(loss, opt, mesh)
    steps = {"ZeRO-2": {"stage": 2}, "ZeRO-2, bucket_bytes=0": {"stage": 2, "bucket_bytes": 0},
             "ZeRO-3": {"stage": 3}}
    steps = {k: zj.make_sharded_train_step(loss, opt, mesh=mesh, **kw) for k, kw in steps.items()}
    runs = {"plain DP (jit)": dp_step, **steps}
    states = {"plain DP (jit)": dp_init(params), **{k: s.init(params) for k, s in steps.items()}}
    if count_flops and part == "steps":  # matmul flops per device, from the compiled programs
      out["flops"] = {k: overlap.analyze(runs[k].lower(states[k], batch).compile().as_text())
                      .total_flops() for k in ("plain DP (jit)", "ZeRO-2")}
    fns, cpu = _timing.with_cpu_time(sc.steppers(runs, states, batch), iters)
    t = sc.interleave(fns, rounds=rounds, iters=iters)
    out[part] = {k: {"wall": sc.spread(t[k]), "wall_ratio": sc.ratio_iqr(t, k, "plain DP (jit)"),
                     "cpu": sc.spread(cpu[k]),
                     "cpu_ratio": sc.ratio_iqr(cpu, k, "plain DP (jit)"),
                     "cpu_ms": float(np.median(cpu[k]) * 1e3)} for k in t}
  return out


# ------------------------------------------------------------ host per call
def host_per_call(quick, calls) -> dict:
  """Microseconds of host work per call that the step adds before dispatching.

  XLA:CPU runs a step of this size on the calling thread, so timing ``step(...)``
  would time the whole step; instead the host-side parts a call runs before the
  compiled function are timed on their own: the state check (cached by the
  state's meta), the batch check (cached by structure and shapes) and placement,
  and entering the mesh context. A full step's time is given for scale.
  """
  title, loss, params, batch = lm_case(quick)
  mesh = sc.mesh_of(8)
  step = zj.make_sharded_train_step(loss, optax.adamw(1e-3), mesh=mesh, donate=False,
                                    stacked=train_lm.in_blocks)
  state = step.init(params)
  placed = sc.place_batch(batch, mesh)
  jax.block_until_ready(step(state, placed))
  t_step = sc.interleave({"step": lambda: jax.block_until_ready(step(state, placed))},
                         rounds=5, iters=2)["step"]

  def per_call(fn):
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
      fn()
    return (time.perf_counter() - t0) / calls * 1e6

  def enter_context():
    with context.mesh_context(step.spec):
      pass

  parts = {
      "state check (`_prepare`)": per_call(lambda: step._prepare(state)),
      "batch check + placement, placed batch": per_call(lambda: step._place(placed)),
      "batch check + placement, numpy batch": per_call(lambda: step._place(batch)),
      "mesh context": per_call(enter_context),
  }
  return {"model": title, "parts_us": parts, "step_ms": float(np.median(t_step) * 1e3)}


def measure(args) -> dict:
  quick = args.quick
  rounds, iters = (4, 2) if quick else (15, 3)
  out = {"one_device": {}}
  for title, loss, params, batch in (mlp_case(quick), lm_case(quick)):
    out["one_device"][title] = one_device(loss, params, batch, optax.adamw(1e-3), rounds, iters)
  out["many_leaves"] = many_leaves(quick, rounds, iters)
  out["stage3_accum"] = stage3_accumulation(quick, rounds, iters)
  out["transformer"] = real_transformer(quick, rounds, iters, not args.timing_only)
  if args.timing_only:
    return out
  out["scanned"] = scanned_stage2(quick)
  out["host"] = host_per_call(quick, 30 if quick else 200)
  return out


def transformer_table(tr: dict, cond: str) -> list:
  rows = [[k, v["wall"], v["wall_ratio"], v["cpu"], v["cpu_ratio"], tr["no model work"][k]["cpu"],
           tr["no model work"][k]["cpu_ratio"]] for k, v in tr["steps"].items()]
  return [f"### A real transformer ({sc.CONDITION_TEXT[cond]}): {tr['title']}", "",
          sc.table(["variant", "wall ms", "wall vs DP", "CPU ms", "CPU vs DP",
                    "no model work: CPU ms", "no model work: CPU vs DP"], rows), ""]


def transformer_text(results: dict) -> list:
  """Does ZeRO-2 cost more than plain DP on the real transformer, and where the time goes."""
  dp, z2, z2b, z3 = ("plain DP (jit)", "ZeRO-2", "ZeRO-2, bucket_bytes=0", "ZeRO-3")
  trs = [r["transformer"] for r in results.values()]
  each = lambda f: " / ".join(f(tr) for tr in trs)  # one figure per malloc condition
  steps = lambda k, what: each(lambda tr: tr["steps"][k][what])
  rest = lambda k: each(lambda tr: f"{tr['no model work'][k]['cpu_ms']:.1f}")
  cpu = [tr["steps"][z2]["cpu_ms"] / tr["steps"][dp]["cpu_ms"] for tr in trs]
  verdict = ("Within 2% of DP's CPU time (medians)" if max(cpu) < 1.02 else
             f"A little: {min(cpu):.2f}-{max(cpu):.2f}x its CPU time (medians)")
  ms = lambda tr, part, k: tr[part][k]["cpu_ms"]
  diff_step = lambda tr: f"{ms(tr, 'steps', z2) - ms(tr, 'steps', dp):+.1f}"
  diff_rest = lambda tr: f"{ms(tr, 'no model work', z2) - ms(tr, 'no model work', dp):+.1f}"
  wall = lambda tr, k: float(tr["steps"][k]["wall_ratio"].split()[0])
  quicker = all(wall(tr, z2b) < wall(tr, z2) and ms(tr, "no model work", z2b)
                < ms(tr, "no model work", z2) for tr in trs)
  faster = ("on this CPU host, with leaves as large as these, it is the faster setting." if
            quicker else "not faster here in every condition.")
  flops = trs[0].get("flops", {})
  same = (f", {flops[dp] / 1e9:.2f} and {flops[z2] / 1e9:.2f} GFLOP per device "
          f"(`zero_jax.gpu.predict.analyze` of the compiled programs)" if flops else "")
  return [
      f"**Does ZeRO-2 cost more than plain DP on the real transformer?** {verdict}. Figures "
      f"per malloc condition ({' / '.join(results)}): CPU time per step of all threads, ZeRO-2 / "
      f"DP {steps(z2, 'cpu_ratio')}; wall time {steps(z2, 'wall_ratio')}. Both programs run the "
      f"same matmuls{same}; what differs is what follows the backward pass. DP all-reduces the "
      f"gradient and runs AdamW on all of it on each of the 8 devices; ZeRO-2 packs the leaves "
      f"into buckets, reduce-scatters, runs AdamW on 1/8 of them, all-gathers and unpacks. With "
      f"no model work (last columns) that part costs {rest(dp)} ms of CPU per step for DP, "
      f"{rest(z2)} ms for ZeRO-2, {rest(z2b)} ms with one collective per leaf and {rest(z3)} ms "
      f"for ZeRO-3: on fake CPU devices a collective is memory copies between threads, and on a "
      f"model of {trs[0]['title'].split('; ')[0].split(', ')[-1]} ZeRO-2 trades the 7/8 of the "
      f"update it skips for the buckets' pack and unpack copies and the all-gather. (The MLP of the `core` section, 0.69x "
      f"of DP, is a model whose update is a large share of its step: 16 MiB of parameters, "
      f"little activation work.) Of ZeRO-2's whole-step CPU difference from DP, {each(diff_step)} "
      f"ms, the part after the backward pass accounts for {each(diff_rest)} ms.",
      "",
      f"One collective per leaf (`bucket_bytes=0`) skips the pack and unpack copies: its part "
      f"after the backward pass costs {rest(z2b)} ms against the buckets' {rest(z2)}, and its "
      f"wall time is {steps(z2b, 'wall_ratio')} of DP's: {faster} On a GPU a copy takes "
      f"microseconds and each collective a launch, so buckets pay there (and on CPU with many "
      f"small leaves: the table above).",
      "",
      "Why the wall-time ratios move with the load (see the load averages above) while the "
      "CPU-time ratios do not: the 8 device threads wait at every collective for the slowest "
      "of them, and on an oversubscribed host a waiting thread gives its core to other "
      "processes, so a step's wall time depends on when its threads meet as well as on its "
      "work. That is the likely source of the 1.19-1.28x measured on a loaded machine; on a "
      "shared host, compare CPU times. (CPU time also counts any spinning at those meetings, so "
      "it is an upper bound on the work.)", ""]


def render(results, args, seconds) -> str:
  first = next(iter(results.values()))
  lines = sc.header(
      "speed: one device, many small leaves, scanned stage 2, stage 3 accumulation, a real "
      "transformer vs plain DP",
      "bench_speed.py", results, seconds,
      "Times: median (IQR) ms per blocking step over interleaved rounds; ratios paired by "
      "round.")
  for cond, r in results.items():
    lines += [f"### One device vs plain optax ({sc.CONDITION_TEXT[cond]})", ""]
    lines.append(sc.table(["model", "plain optax", "zero_jax", "zero_jax / plain"],
                          [[t, v["times"]["plain optax"], v["times"]["zero_jax"], v["ratio"]]
                           for t, v in r["one_device"].items()]))
    m = r["many_leaves"]
    lines += ["", f"### Many small leaves ({sc.CONDITION_TEXT[cond]}): {m['model']}", ""]
    lines.append(sc.table(["variant", "ms / step", "vs plain DP"],
                          [[k, v, m["ratios"].get(k, "1")] for k, v in m["times"].items()]))
    s = r["stage3_accum"]
    lines += ["", f"### Stage 3 with accumulation ({sc.CONDITION_TEXT[cond]}): {s['model']}", ""]
    lines.append(sc.table(["variant", "ms / step"], [[k, v] for k, v in s["times"].items()]))
    lines += ["", f"gather_once=True / default: {s['ratio']}", ""]
    lines += transformer_table(r["transformer"], cond)
  lines += transformer_text(results)
  m, s = first["many_leaves"], first["stage3_accum"]
  lines += ["### Collectives in the compiled programs", "",
            sc.table(["program", "collectives (count, dtype, result bytes)"],
                     [[k, v] for k, v in m["collectives"].items()] +
                     [[f"stage 3, k=4, {k}", v] for k, v in s["collectives"].items()]), "",
            "### Stage 3 with accumulation: XLA memory per device (MiB)", "",
            sc.table(["variant", "arguments", "temp"],
                     [[k, sc.mib(v["arg"]), sc.mib(v["temp"])] for k, v in s["memory"].items()]),
            ""]
  sc_ = first["scanned"]
  lines += [f"### Scanned stage 2: XLA temp per device (MiB), {sc_['model']}", "",
            sc.table(["N", "scanned + stacked", "unrolled"],
                     [[n, sc.mib(v["scanned"]["temp"]), sc.mib(v["unrolled"]["temp"])]
                      for n, v in sc_["by_n"].items()]), ""]
  h = first["host"]
  placed = sum(v for k, v in h["parts_us"].items() if "numpy" not in k)
  lines += [f"### Host work per call before dispatch, {h['model']}, 8 devices", "",
            sc.table(["part", "us per call"],
                     [[k, f"{v:.1f}"] for k, v in h["parts_us"].items()]), "",
            f"With a placed batch the step adds {placed:.0f} us of host work per call "
            f"({placed / (h['step_ms'] * 10):.2f}% of this model's {h['step_ms']:.1f} ms step).",
            ""]
  return "\n".join(lines)


if __name__ == "__main__":
  sc.main(__doc__, os.path.abspath(__file__), measure, render, "speed")
