"""Bigger than one device: peak host memory and speed of init, export and import.

A stage-3 SGD state on 8 CPU devices, parameters of 2048x2048 float32 leaves (256 MB and
1 GB models by default; half the leaves exported transposed, as Flax kernels go to
PyTorch's layout). Every measurement runs in its own fresh process (one variant's
allocations cannot hide in another's peak); variants are interleaved over ``--reps``
rounds, and each figure is the median (IQR in brackets).

Peak extra host memory is the peak resident set during the operation (VmHWM, reset
through ``/proc/self/clear_refs`` after ``malloc_trim`` just before it) minus the resident
set at its start, in units of the model's bytes. On CPU the 8 devices' buffers are host
memory: the arrays an operation creates count (an init's state is 1x the model with SGD).

Variants:
  * init, eager: ``step.init(params)`` of host numpy arrays;
  * init, split arrays: ``step.init`` of jax arrays already split over the data axis;
  * init, from a function: ``step.init(lambda: params)`` where ``step.init`` takes one;
  * export: ``zj.export_safetensors``; baseline: ``step.get_params`` to the host, then
    ``safetensors.numpy.save_file`` (what a gather-then-save export does);
  * import: ``zj.load_safetensors`` alone, and then ``step.init``; baseline:
    ``safetensors.numpy.load_file`` then ``step.init``.

Usage: python benchmarks/bench_bigger.py [--sizes-mb 256 1024] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_checkpoint import _reset_peak, _status, machine  # pylint: disable=g-import-not-at-top
N_DEVICES = 8
LEAF = (2048, 2048)
# Variants left out above --replicating-up-to-mb: today's step.init places every leaf
# replicated before splitting it, and the baselines gather: about 10x the model in host memory.
REPLICATING = {"init_eager", "init_split", "export_lib", "import_zj", "import_lib"}


def _measure(fn) -> tuple:
  start = _reset_peak()
  t0 = time.perf_counter()
  out = fn()
  import jax  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(out)
  return out, time.perf_counter() - t0, _status("VmHWM") - start


def child(variant: str, work: pathlib.Path, size_mb: int) -> dict:
  import jax
  jax.config.update("jax_num_cpu_devices", N_DEVICES)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from safetensors.numpy import load_file, save_file
  import zero_jax as zj

  n = max(1, size_mb * 2**20 // (4 * LEAF[0] * LEAF[1]))
  names = [f"layers.{i}.kernel" for i in range(n)]
  like = {k: jax.ShapeDtypeStruct(LEAF, jnp.float32) for k in names}
  model = n * 4 * LEAF[0] * LEAF[1]
  mesh = jax.make_mesh((N_DEVICES,), ("data",))
  step = zj.make_sharded_train_step(lambda p, b: 0.0, optax.sgd(0.1), mesh=mesh, stage=3)
  rename = lambda name: (name, int(name.split(".")[1]) % 2 == 1)
  split = NamedSharding(mesh, P("data"))

  def split_params():  # each device computes its own block
    return jax.jit(lambda: {k: jnp.full(LEAF, i, jnp.float32) for i, k in enumerate(names)},
                   out_shardings={k: split for k in names})()

  def state():  # a state made from split arrays by a jitted init, without replicated copies
    abstract = step.abstract_state(like)
    shardings = jax.tree.map(lambda s: s.sharding, abstract)
    zeros = jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract),
                    out_shardings=shardings)()
    return jax.block_until_ready(zeros.replace(params=split_params()))

  out = {"model": model}
  if variant == "prepare":
    zj.export_safetensors(step, state(), work / f"model{size_mb}", rename=rename)
    return out
  if variant == "init_eager":
    params = {k: np.full(LEAF, i, np.float32) for i, k in enumerate(names)}
    _, out["s"], out["peak"] = _measure(lambda: step.init(params))
  elif variant == "init_split":
    params = jax.block_until_ready(split_params())
    _, out["s"], out["peak"] = _measure(lambda: step.init(params))
  elif variant == "init_fn":
    try:
      _, out["s"], out["peak"] = _measure(lambda: step.init(split_params))
    except Exception as e:  # pylint: disable=broad-except
      out["unsupported"] = f"{type(e).__name__}: {str(e)[:200]}"
  elif variant.startswith("export"):
    st = state()
    d = work / f"{variant}-{os.getpid()}"
    if variant == "export_zj":
      fn = lambda: zj.export_safetensors(step, st, d, rename=rename)
    else:
      def fn():
        host = {rename(k)[0]: np.ascontiguousarray(v.T if rename(k)[1] else v)
                for k, v in jax.device_get(step.get_params(st)).items()}
        d.mkdir()
        save_file(host, str(d / "model.safetensors"), metadata={"format": "pt"})
    _, out["s"], out["peak"] = _measure(fn)
  elif variant.startswith("import"):
    path = work / f"model{size_mb}"
    if variant == "import_zj":
      fn = lambda: step.init(zj.load_safetensors(path, like, step=step, rename=rename))
    elif variant == "import_zj_load":
      fn = lambda: zj.load_safetensors(path, like, step=step, rename=rename)
    else:
      def fn():
        host = load_file(str(path / "model.safetensors"))
        return step.init({k: host[rename(k)[0]].T if rename(k)[1] else host[rename(k)[0]]
                          for k in names})
    _, out["s"], out["peak"] = _measure(fn)
  return out


def run_child(variant: str, work: pathlib.Path, size_mb: int) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, __file__, "--child", variant, "--work", str(work),
                         "--size-mb", str(size_mb)], env=env, capture_output=True, text=True,
                        timeout=900)
  if proc.returncode != 0:
    raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_iqr(xs, fmt) -> str:
  if len(xs) < 2:
    return fmt(xs[0])
  q = statistics.quantiles(xs, n=4)
  return f"{fmt(statistics.median(xs))} [{fmt(q[0])}-{fmt(q[2])}]"


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes-mb", type=int, nargs="+", default=[256, 1024])
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--replicating-up-to-mb", type=int, default=256,
                  help="run the variants that hold 8 copies only up to this size")
  ap.add_argument("--child")
  ap.add_argument("--work")
  ap.add_argument("--size-mb", type=int)
  args = ap.parse_args()
  if args.child:
    print(json.dumps(child(args.child, pathlib.Path(args.work), args.size_mb)))
    return
  variants = ["init_eager", "init_split", "init_fn", "export_zj", "export_lib", "import_zj_load",
              "import_zj", "import_lib"]
  runs: dict = {}
  t_start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="bench_bigger_", dir=os.environ.get("BENCH_TMP")) as d:
    work = pathlib.Path(d)
    for size in args.sizes_mb:
      run_child("prepare", work, size)
      todo = [v for v in variants
              if v not in REPLICATING or size <= args.replicating_up_to_mb]
      for _ in range(args.reps):
        for v in todo:
          runs.setdefault((size, v), []).append(run_child(v, work, size))
  elapsed = time.perf_counter() - t_start
  print(json.dumps({f"{s} {v}": r for (s, v), r in runs.items()}), file=sys.stderr)
  write(args, runs, elapsed)


LABELS = {"init_eager": "init, eager (host numpy arrays)",
          "init_split": "init from arrays split over the data axis",
          "init_fn": "init from a function (`step.init(lambda: ...)`)",
          "export_zj": "export: `zj.export_safetensors`",
          "export_lib": "export: `get_params` to the host + `safetensors.numpy.save_file`",
          "import_zj_load": "import: `zj.load_safetensors` alone (the split arrays: +1x)",
          "import_zj": "import: `zj.load_safetensors` + `step.init`",
          "import_lib": "import: `safetensors.numpy.load_file` + `step.init`"}


INIT_NOTE = (
    "The init rows and the import-then-init rows measure this branch's `step.init`, which "
    "places every leaf replicated over the data axes before splitting it (each device briefly "
    "holds the whole model: about +8x), from host arrays and from split arrays alike; "
    "`load_safetensors` itself stays at the +1x of the arrays it returns. The \"gather\" "
    "export baseline is `get_params`, whose result is replicated on every device. Rerun with "
    "`--replicating-up-to-mb 1024` once `step.init` keeps split arrays where they are.")


def write(args, runs, elapsed):
  header = "| | " + " | ".join(f"{s} MB: peak extra host memory | {s} MB: MB/s"
                                for s in args.sizes_mb) + " |"
  rows = []
  for v, label in LABELS.items():
    cells = []
    for size in args.sizes_mb:
      rs = runs.get((size, v))
      if not rs:
        cells += ["not run (about 10x the model in host memory)", "-"]
      elif "unsupported" in rs[0]:
        cells += ["not supported by this `step.init`", "-"]
      else:
        model = rs[0]["model"]
        cells.append(_median_iqr([r["peak"] / model for r in rs], lambda x: f"+{x:.2f}x"))
        rate = [model / 2**20 / r["s"] for r in rs]
        cells.append(_median_iqr(rate, lambda x: f"{x:,.0f}") if v[:6] in ("export", "import")
                     else "-")
    rows.append(f"| {label} | " + " | ".join(cells) + " |")
  lines = [
      "## Bigger than one device: init, export and import",
      "",
      f"Measured on {machine()}. A stage-3 SGD state of 2048x2048 float32 leaves (half of "
      f"them written transposed). Each figure is the median of {args.reps} interleaved runs "
      f"[IQR], each run in a fresh process; peak extra host memory is VmHWM during the "
      f"operation minus the resident set at its start (reset through /proc/self/clear_refs "
      f"after malloc_trim), in units of the model's bytes; the 8 CPU devices' buffers are "
      f"host memory, so the arrays an operation creates count (the state itself is +1x). "
      f"MB/s: model bytes over the operation's wall time (written to or read from "
      f"the page cache of a local disk). Targets: init at most +1.5x, export at most "
      f"+0.5x, import then init at most +1.5x. Script run time {elapsed:.0f} s.",
      "",
      header,
      "|---|" + "---:|" * (2 * len(args.sizes_mb)),
      *rows,
      "",
      INIT_NOTE,
  ]
  text = "\n".join(lines)
  print(text)
  from _report import write_section  # pylint: disable=g-import-not-at-top
  write_section("bigger", text)


if __name__ == "__main__":
  main()
