"""One process of the preemption tests (started by tests/test_preemption.py).

Trains one of tests/mp_worker.py's variants until told to stop: every step it asks
``mngr.reached_preemption(state)``, and a preemption notice on any process makes every
process save the same step and leave with status 0. Its report, ``OUT/report_<i>.json``,
holds the losses of the steps it took and where it stopped.

  python tests/preempt_worker.py OUT CKPT VARIANT [options]

  --resume          continue from the latest checkpoint in CKPT
  --hold S          before the first step: compile the step ahead, then wait S seconds
  --save-every N    a periodic (asynchronous) save every N steps
  --signals A,B     the signals that give notice (default SIGTERM)
  --storm-after N   after the periodic save of step N, this process sends itself the last
                    of --signals every 20 ms until it exits: during that save and the next
  --pace S          seconds between steps (so that the test can act between them)
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mp_worker as W  # noqa: E402


def _parse(argv):
  p = argparse.ArgumentParser()
  p.add_argument("out")
  p.add_argument("ckpt")
  p.add_argument("variant", choices=tuple(W.VARIANTS))
  p.add_argument("--resume", action="store_true")
  p.add_argument("--hold", type=float, default=0.0)
  p.add_argument("--save-every", type=int, default=0)
  p.add_argument("--storm-after", type=int, default=None)
  p.add_argument("--signals", default="SIGTERM")
  p.add_argument("--pace", type=float, default=0.05)
  p.add_argument("--max-steps", type=int, default=3000)  # ends a job that never stops
  return p.parse_args(argv)


def _storm(sig):
  """``sig`` to this process every 20 ms, from a thread, until the process ends."""
  def run():
    while True:
      os.kill(os.getpid(), sig)
      time.sleep(0.02)
  threading.Thread(target=run, daemon=True).start()


def main(argv):
  args = _parse(argv)
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  zj.initialize_distributed()
  signals = [getattr(signal, s) for s in args.signals.split(",")]
  zj.watch_preemption(signals)
  import jax  # pylint: disable=g-import-not-at-top
  me = jax.process_index()
  step = W.make_step(args.variant)
  rows = zj.process_batch_slice(W.GLOBAL_BATCH, step)
  batch = lambda t: zj.make_global_batch(jax.tree.map(lambda x: x[rows], W.global_batch(t)),
                                         step)
  mngr = zj.CheckpointManager(args.ckpt, max_to_keep=None)
  state = mngr.restore(step, W.init_params()) if args.resume else step.init(W.init_params())
  start = int(state.step)
  report = {"process": me, "start": start, "devices": jax.device_count(), "losses": {},
            "save_in_flight": None}
  print(f"process {me} compiling", flush=True)
  if args.hold:
    step.lower(state, batch(start)).compile()
    time.sleep(args.hold)
  for t in range(start, args.max_steps):
    if mngr.reached_preemption(state):
      break
    state, metrics = step(state, batch(t))
    report["losses"][t + 1] = zj.metrics_to_host(metrics)["loss"]
    print(f"process {me} step {t + 1}", flush=True)
    if args.save_every and (t + 1) % args.save_every == 0:
      mngr.save(state)
      if args.storm_after == t + 1:
        _storm(signals[-1])  # the save is still being written: its directory is not there yet
        report["save_in_flight"] = not os.path.isdir(os.path.join(args.ckpt, str(t + 1)))
    time.sleep(args.pace)
  p = mngr.preemption
  report.update(stopped=None if p is None else {"step": p.step, "saved": p.saved})
  with open(os.path.join(args.out, f"report_{me}.json"), "w") as f:
    json.dump(report, f)
  mngr.close()
  print(f"process {me}: {p}", flush=True)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main(sys.argv[1:])
