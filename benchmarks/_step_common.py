"""Shared pieces of the step benchmarks (bench_step, bench_precision, bench_stages).

Import this module before anything touches the JAX backend: it asks for 8 fake
CPU devices. It holds the benchmark model, the baselines that zero_jax is measured against
(plain DP in ``shard_map``, a jit-annotated step), an interleaved timer, readers
for per-device memory (from the arrays' addressable shards and from XLA's
``memory_analysis()``) and for the collectives in a compiled program, and the
runner that times each malloc condition in its own child process.

Example:
  >>> import _step_common as sc
  >>> params = sc.init_mlp(jax.random.key(0), [64, 64, 64])
  >>> times = sc.interleave({"a": lambda: None, "b": lambda: None}, rounds=3, iters=2)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before the backend starts
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zero_jax as zj  # noqa: E402,F401
from zero_jax.comm import hlo as hlo_lib  # noqa: E402

AXIS = "data"
MIB = 2.0**20


# ------------------------------------------------------------------ the model
def init_mlp(key, sizes) -> dict:
  """An MLP's parameters: ``{"l00": {"w": (a, b), "b": (b,)}, ...}``, float32 numpy.

  Host arrays, so that every variant's ``init`` makes fresh device buffers
  (a ``device_put`` of a device array may share its buffer, which a donating
  step would then delete).
  """
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    params[f"l{i:02d}"] = {"w": jax.random.normal(sub, (a, b), jnp.float32) / np.sqrt(a),
                           "b": jnp.zeros((b,), jnp.float32)}
  return jax.tree.map(np.asarray, params)


def mlp_loss(params, batch):
  """Mean squared error of a GELU MLP, computed in the parameters' dtype."""
  x = batch["x"]
  names = sorted(params)
  dt = params[names[0]]["w"].dtype
  x = x.astype(dt)
  for j, name in enumerate(names):
    x = x @ params[name]["w"] + params[name]["b"]
    if j < len(names) - 1:
      x = jax.nn.gelu(x)
  return jnp.mean(jnp.square(x.astype(jnp.float32) - batch["y"]))


def make_batches(key, count, batch_size, d_in, d_out) -> list:
  keys = jax.random.split(key, count)
  return [{"x": jax.random.normal(jax.random.fold_in(k, 0), (batch_size, d_in)),
           "y": jax.random.normal(jax.random.fold_in(k, 1), (batch_size, d_out))}
          for k in keys]


def n_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def mesh_of(n: int) -> Mesh:
  """A 1-D Auto mesh over the first ``n`` devices."""
  return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def place_batch(batch, mesh):
  return jax.device_put(batch, NamedSharding(mesh, P(AXIS)))


# ---------------------------------------------------------------- baselines
def _rs_ag_mean(g, n):
  """Mean over the axis as reduce-scatter + all-gather (what an all-reduce is made of)."""
  spec = _split_spec(g.shape, n)
  if spec == P():
    return jax.lax.pmean(g, AXIS)
  d = len(spec) - 1
  part = jax.lax.psum_scatter(g, AXIS, scatter_dimension=d, tiled=True) / n
  return jax.lax.all_gather(part, AXIS, axis=d, tiled=True, to="invarying")


def make_dp_step(loss_fn, optimizer, mesh, *, rs_ag=False):
  """Plain data parallelism: grads ``pmean``ed, optax update replicated everywhere.

  With ``rs_ag`` the mean is computed as ``psum_scatter`` + ``all_gather``
  instead of one all-reduce (same result, same bytes on the wire in a ring).
  Returns ``(init, step)``; ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
  """
  rep = NamedSharding(mesh, P())
  n = mesh.shape[AXIS]

  def local(params, opt_state, batch):
    mine = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), params)
    loss, grads = jax.value_and_grad(loss_fn)(mine, batch)
    if rs_ag:
      grads = jax.tree.map(lambda g: _rs_ag_mean(g, n), grads)
    else:
      grads = jax.lax.pmean(grads, AXIS)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, AXIS)

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(AXIS)),
                               out_specs=(P(), P(), P())), donate_argnums=(0, 1))

  def init(params):
    params = jax.device_put(params, rep)
    return params, jax.jit(optimizer.init, out_shardings=rep)(params)

  return init, step


def _split_spec(shape, n) -> P:
  """Split the largest dimension divisible by ``n``; replicate if there is none."""
  dims = [d for d, s in enumerate(shape) if s % n == 0 and s >= n]
  if not dims:
    return P()
  d = max(dims, key=lambda d: shape[d])
  return P(*([None] * d + [AXIS]))


def make_jit_step(loss_fn, optimizer, mesh, *, shard_grads=False):
  """The compiler-driven way: one ``jax.jit``, no shard_map.

  Parameters replicated, batch sharded, every optimizer-state leaf sharded over
  the data axis (``in_shardings``/``out_shardings``); XLA's SPMD partitioner
  decides the collectives. With ``shard_grads`` the gradient is also
  constrained to the optimizer state's sharding (ZeRO-2 by annotation).
  """
  n = mesh.shape[AXIS]
  rep = NamedSharding(mesh, P())
  shard_of = lambda x: NamedSharding(mesh, _split_spec(np.shape(x), n))

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    if shard_grads:
      grads = jax.lax.with_sharding_constraint(grads, jax.tree.map(shard_of, grads))
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    return new_params, new_opt, loss

  cache = {}

  def init(params):
    params = jax.device_put(params, rep)
    opt_shardings = jax.tree.map(shard_of, jax.eval_shape(optimizer.init, params))
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    cache["step"] = jax.jit(step, in_shardings=(rep, opt_shardings, NamedSharding(mesh, P(AXIS))),
                            out_shardings=(rep, opt_shardings, rep), donate_argnums=(0, 1))
    return params, opt_state

  def call(params, opt_state, batch):
    return cache["step"](params, opt_state, batch)

  call.lower = lambda *a: cache["step"].lower(*a)
  return init, call


def collective_pair(mesh, n_elems):
  """Two jitted functions of an ``(N * n_elems,)`` f32 array sharded over the axis,

  each device's ``n_elems`` block standing for its local gradient: ``psum``
  (one all-reduce) and ``all_gather(psum_scatter(.))`` (the same sum).
  Returns ``(x, {"all-reduce": f, "rs+ag": g})``.
  """
  n = mesh.shape[AXIS]
  sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
  ar = sm(lambda x: jax.lax.psum(x, AXIS))
  rsag = sm(lambda x: jax.lax.all_gather(jax.lax.psum_scatter(x, AXIS, tiled=True), AXIS,
                                         tiled=True))
  x = jax.device_put(jnp.arange(n * n_elems, dtype=jnp.float32) % 7,
                     NamedSharding(mesh, P(AXIS)))
  return x, {"all-reduce": ar, "rs+ag": rsag}


# ------------------------------------------------------------------- memory
def bytes_per_device(tree) -> int:
  """Largest per-device total of ``tree``'s addressable shards, in bytes."""
  per_dev: dict = {}
  for x in jax.tree.leaves(tree):
    for s in x.addressable_shards:
      per_dev[s.device] = per_dev.get(s.device, 0) + s.data.nbytes
  return max(per_dev.values()) if per_dev else 0


def memory(compiled) -> dict:
  """XLA's per-device argument / output / temp / alias bytes of a compiled step."""
  m = compiled.memory_analysis()
  return {"arg": m.argument_size_in_bytes, "out": m.output_size_in_bytes,
          "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}


def collectives(hlo_text: str) -> dict:
  """``{(kind, dtypes): (count, result bytes)}`` of the collectives in an HLO module's text."""
  out: dict = {}
  for c in hlo_lib.collectives(hlo_text):
    dtypes = "+".join(sorted(set(re.findall(r"([a-z]+\d*)\[", c.shape_text))))
    n, b = out.get((c.op, dtypes), (0, 0))
    out[(c.op, dtypes)] = (n + 1, b + c.nbytes)
  return out


def collectives_str(hlo_text: str) -> str:
  """E.g. ``all-gather x10 f32 16.0 MiB, reduce-scatter x10 f32 2.0 MiB`` (result bytes)."""
  c = collectives(hlo_text)
  return ", ".join(f"{k} x{n} {dt} {b / MIB:.2f} MiB"
                   for (k, dt), (n, b) in sorted(c.items())) or "none"


_PARAM = re.compile(r"(%[\w.\-]+) = (f16|bf16)\[[\d,]*\]\S* parameter\(")
_UPCAST = re.compile(r"%[\w.\-]+ = f32\[([\d,]+)\]\S* (?:fusion|convert)\((%[\w.\-]+)\)")


def half_param_upcasts(hlo_text: str) -> tuple[int, int]:
  """(count, bytes) of f32 copies of whole f16/bf16 entry parameters in a compiled program.

  XLA:CPU has no half-precision matmul: it converts half weights to f32 first.
  """
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  halves = {m.group(1) for m in _PARAM.finditer(entry)}
  count = nbytes = 0
  for m in _UPCAST.finditer(entry):
    if m.group(2) in halves and "," in m.group(1):
      count += 1
      nbytes += 4 * int(np.prod([int(d) for d in m.group(1).split(",")]))
  return count, nbytes


def collectives_counts(text: str) -> list:
  """``[(count, kind), ...]`` parsed back from a `collectives_str` string."""
  return [(int(n), k) for k, n in re.findall(r"([a-z\-]+) x(\d+)", text)]


# ------------------------------------------------------------------- timing
from _timing import (interleave, median_ratio, ratio_iqr, spread, steppers,  # noqa: E402,F401
                     table)


def mib(b) -> str:
  return f"{b / MIB:.2f}"


# --------------------------------------------------------- malloc conditions
# XLA:CPU allocates each step's temporary buffers with glibc malloc. With the
# default settings, buffers above the (dynamic) mmap threshold are mmapped and
# unmapped every step, so every step page-faults all its temp memory afresh
# (for an 8-device step with 32 MiB temp per device: ~65k minor faults and
# ~150 ms of system time per step on this host). Accelerator runtimes reuse a
# pooled allocation instead. "retain" keeps freed memory in the heap, which is
# closer to that; "default" is what a plain `python` run gets. Each condition
# runs in its own process (glibc reads these at start-up).
CONDITIONS = {
    "retain": {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"},
    "default": {},
}
CONDITION_TEXT = {
    "retain": "glibc malloc keeping freed memory (`MALLOC_MMAP_THRESHOLD_=MALLOC_TRIM_THRESHOLD_=2**32`)",
    "default": "glibc malloc defaults (temp buffers mmapped and page-faulted every step)",
}


def header(title: str, script: str, results: dict, seconds: float, what: str) -> list[str]:
  """The first lines of a section: its title, the command and machine, then ``what``."""
  from _report import machine  # pylint: disable=g-import-not-at-top
  return [f"## {title}", "",
          f"Measured by `python benchmarks/{script}` on {machine()} ({seconds / 60:.1f} min; "
          f"load {load_text(results)}). {what} No GPU was available to this work: CPU "
          f"figures only.", ""]


def load_text(results: dict) -> str:
  """The 1-minute load averages at the start and end of each condition's run."""
  return ", ".join(f"{c}: {r['load'][0]:.1f} -> {r['load'][1]:.1f}" for c, r in results.items())


def parser(doc: str) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="fewer rounds, smaller model; a smoke run")
  p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
  p.add_argument("--conditions", default="retain,default",
                 help="comma-separated malloc conditions to time in: retain, default")
  p.add_argument("--child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--json", default=None, help=argparse.SUPPRESS)
  return p


def run_children(script: str, args) -> dict:
  """Runs ``script`` once per malloc condition in a child process; returns their results.

  The first condition's child measures everything (``full=True``); the others
  only time (their memory figures would be the same).
  """
  results = {}
  argv = ["--quick"] if args.quick else []
  for i, cond in enumerate(args.conditions.split(",")):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(CONDITIONS[cond])
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, "out.json")
      cmd = [sys.executable, script, *argv, "--child", cond, "--json", path]
      if i:
        cmd.append("--timing-only")
      print(f"--- {cond}: {' '.join(f'{k}={v}' for k, v in CONDITIONS[cond].items())} "
            f"{' '.join(cmd[1:])}", flush=True)
      subprocess.run(cmd, env=env, check=True)
      with open(path) as f:
        results[cond] = json.load(f)
  return results


def child_main(args, measure) -> bool:
  """In a child: ``measure(args)`` and dump its JSON; returns True if this was a child."""
  if args.child is None:
    return False
  before = os.getloadavg()[0]
  out = measure(args)
  out["load"] = (before, os.getloadavg()[0])
  with open(args.json, "w") as f:
    json.dump(out, f)
  return True


def main(doc: str, script: str, measure, render, section: str) -> None:
  """Runs ``measure`` in one child process per malloc condition, prints and records."""
  import time
  from _report import write_section
  args = parser(doc).parse_args()
  if child_main(args, measure):
    return
  t0 = time.perf_counter()
  results = run_children(script, args)
  text = render(results, args, time.perf_counter() - t0)
  print(text)
  if not args.no_write:
    write_section(section, text)
