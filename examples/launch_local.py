"""Multi-process zero_jax on one machine: n processes with a few CPU devices each.

  python examples/launch_local.py                      # the demo below: 2 processes x 4 devices
  python examples/launch_local.py -n 4 -d 2            # the demo on 4 processes x 2 devices
  python examples/launch_local.py -n 2 -d 4 train.py --lr 1e-3   # your own script

Every process runs the same script; ``zj.initialize_distributed()`` joins them
into one JAX job over gloo collectives (the launcher passes the coordinator
address, process id and device count in ``ZERO_JAX_*`` variables). On a
cluster, start the same script with your scheduler instead (``srun python
train.py`` on SLURM): ``zj.initialize_distributed()`` detects the job there.

If a process dies or raises, the others print a ``zero_jax:`` line naming it
and exit with ``zj.LOST_PEER_EXIT_CODE`` (3) instead of hanging; the launcher
then names the process that failed first, reports how every process ended,
and returns the first one's exit status. A SIGTERM to the launcher is passed on to every
process (a preemption notice: with ``mngr.reached_preemption(state)`` in its loop each one
saves the same step and exits 0), and the launcher then exits 0.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = "--worker"  # the demo's own processes are started with it


def demo(steps: int = 30, global_batch: int = 64):
  """What every process of the demo runs: a small MLP regression, ZeRO-2."""
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  zj.initialize_distributed()  # first, before any other JAX call
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  zj.print_main(f"{jax.process_count()} processes, {jax.local_device_count()} devices each, "
                f"{jax.device_count()} on the mesh")

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - b["y"]) ** 2)

  # The same parameters on every process: initialise them from the same seed.
  rng = np.random.default_rng(0)
  params = {"w1": rng.normal(size=(16, 33)).astype(np.float32) / 4,
            "b1": np.zeros(33, np.float32),
            "w2": rng.normal(size=(33, 4)).astype(np.float32) / 6,
            "b2": np.zeros(4, np.float32)}
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=2)
  state = step.init(params)

  # This process's rows of every global batch. A real loader reads only these
  # rows (e.g. its shard of the files); the demo makes the global batch and slices it.
  rows = zj.process_batch_slice(global_batch, mesh)
  true_w = np.random.default_rng(1).normal(size=(16, 4)).astype(np.float32)
  for t in range(steps):
    x = np.random.default_rng(100 + t).normal(size=(global_batch, 16)).astype(np.float32)
    local = {"x": x[rows], "y": np.sin(x @ true_w)[rows]}
    state, metrics = step(state, zj.make_global_batch(local, mesh))
    m = zj.metrics_to_host(metrics)  # Python floats and bools, on every process
    if t % 5 == 0 or t == steps - 1:
      zj.print_main(f"step {t:3d}  loss {m['loss']:.5f}  grad_norm {m['grad_norm']:.4f}")
  final = step.get_params(state)  # full, replicated: readable on every process
  zj.print_main(f"done: |w1| = {float(np.linalg.norm(np.asarray(final['w1']))):.4f}")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("-n", "--num-processes", type=int, default=2,
                 help="processes to start, each one JAX process of the job "
                      "(default: %(default)s)")
  p.add_argument("-d", "--devices-per-process", type=int, default=4,
                 help="fake CPU devices of each process (default: %(default)s)")
  p.add_argument("--peer-timeout", type=float, default=None,
                 help="seconds without a peer's heartbeat before the others stop "
                      "(default: zj.initialize_distributed's, 60)")
  p.add_argument("script", nargs="?",
                 help="the Python script every process runs (default: this file's own demo, a "
                      "small MLP trained with ZeRO-2 for 30 steps)")
  p.add_argument("args", nargs=argparse.REMAINDER,
                 help="the script's own arguments, passed on as given")
  return p


def main(argv=None):
  opts = build_parser().parse_args(argv)
  import zero_jax as zj  # after the flags: --help answers without importing JAX
  command = [sys.executable, opts.script, *opts.args] if opts.script else [
      sys.executable, os.path.abspath(__file__), WORKER]
  return zj.launch_local(command, num_processes=opts.num_processes,
                         devices_per_process=opts.devices_per_process,
                         peer_timeout_seconds=opts.peer_timeout)


def is_worker() -> bool:
  """Whether this process is one the demo started (not a user's ``--worker`` flag)."""
  if sys.argv[1:] != [WORKER]:
    return False
  from zero_jax.processes import distributed as zd  # pylint: disable=g-import-not-at-top
  return os.environ.get(zd.ENV_PROCESS_ID) is not None


if __name__ == "__main__":
  if is_worker():
    demo()
  else:
    sys.exit(main())
