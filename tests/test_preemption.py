"""Preemption: a signal to any process of a 2-process job saves the same step on both.

Each job is 2 processes x 4 CPU devices over gloo (tests/preempt_worker.py, or the LM
example under examples/launch_local.py). JAX's preemption service picks the step; every
process saves it and exits 0. The checkpoints then restore in this process (1 process, 8
devices) and in a second 2-process job, and the losses from there on equal a plain
single-device optax run's. A job costs a process start-up and a compilation, so each
one serves several checks.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import mp_worker as W
import zero_jax as zj
from zero_jax import launch as zl
from zero_jax.checkpoint import preemption

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "preempt_worker.py")
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
EXIT_BOUND_S = 60.0  # from the signal to every process's exit: well inside a 120 s grace


# ----------------------------------------------------------------- helpers
def _text(path) -> str:
  return pathlib.Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def _wait_for(paths, text, procs, timeout=240.0):
  """Until every file in ``paths`` shows ``text``; fails if a process ends first."""
  deadline = time.monotonic() + timeout
  while not all(text in _text(p) for p in paths):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:
        p.kill()
      raise AssertionError(f"never saw {text!r}:\n" + "\n".join(_text(p)[-3000:] for p in paths))
    time.sleep(0.05)


def _finish(procs, started: float, logs) -> float:
  """Waits for every process (bounded); the seconds from ``started`` to the last exit."""
  try:
    for p in procs:
      p.wait(timeout=EXIT_BOUND_S + 60)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  codes = [p.returncode for p in procs]
  assert codes == [0] * len(procs), (codes, "\n".join(_text(p)[-3000:] for p in logs))
  return time.monotonic() - started


def _job(tmp, variant, *flags, victims=(1,), after="step 4"):
  """A 2-process worker job; SIGTERM to ``victims`` once both logged ``after``."""
  out, ckpt = tmp / "out", tmp / "ckpt"
  out.mkdir(parents=True, exist_ok=True)
  logs = [tmp / "logs" / f"process_{i}.log" for i in range(2)]
  procs = zl.start_local_processes([sys.executable, WORKER, str(out), str(ckpt), variant,
                                    *flags], num_processes=2, devices_per_process=4,
                                   env=ENV, log_dir=str(tmp / "logs"))
  _wait_for(logs, after, procs)
  t0 = time.monotonic()
  for v in victims:
    procs[v].send_signal(signal.SIGTERM)
  elapsed = _finish(procs, t0, logs)
  reports = [json.loads((out / f"report_{i}.json").read_text()) for i in range(2)]
  return {"reports": reports, "ckpt": ckpt, "logs": [_text(p) for p in logs],
          "elapsed": elapsed}


def _stopped_at(job) -> int:
  """The step where both processes stopped; checks that they agree and saved it."""
  (r0, r1), logs = job["reports"], job["logs"]
  assert r0["stopped"] == r1["stopped"] and r0["stopped"]["saved"], (r0, r1)
  s = r0["stopped"]["step"]
  for log in logs:
    assert f"preempted: every process stopped at step {s}, saved in {job['ckpt']}" in log, log
  assert job["elapsed"] < EXIT_BOUND_S, job["elapsed"]
  with zj.CheckpointManager(job["ckpt"]) as mngr:
    assert s in mngr.all_steps()
  return s


def _check_losses(reports, ref_losses):
  for r in reports:
    assert r["losses"], r
    for t, loss in r["losses"].items():
      assert loss == pytest.approx(ref_losses[int(t)], rel=2e-5), (t, r["process"])


def _restore_here_and_continue(variant, ckpt, at, ref_params, ref_losses, more=2):
  """This process, 8 devices: the checkpoint of ``at`` is the reference's state."""
  step = W.make_step(variant)
  with zj.CheckpointManager(ckpt) as mngr:
    state = mngr.restore(step, W.init_params(), step=at)
  assert int(state.step) == at
  for k, x in step.get_params(state).items():
    np.testing.assert_allclose(np.asarray(x), ref_params[k], rtol=2e-5, atol=2e-6, err_msg=k)
  for t in range(at, at + more):
    state, m = step(state, W.global_batch(t))
    assert float(m["loss"]) == pytest.approx(ref_losses[t + 1], rel=2e-5), t


# ----------------------------------------------------------------- SGD: stop, restore, resume
@pytest.fixture(scope="module")
def sgd_jobs(tmp_path_factory):
  """SIGTERM to process 1; then a 2-process resume of that checkpoint, SIGTERM to process 0."""
  first = _job(tmp_path_factory.mktemp("to_process_1"), "stage2_sgd_clip", victims=(1,))
  tmp = tmp_path_factory.mktemp("to_process_0")
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.copytree(first["ckpt"], tmp / "ckpt")
  start = _stopped_at(first)
  second = _job(tmp, "stage2_sgd_clip", "--resume", victims=(0,), after=f"step {start + 3}")
  return first, second


def test_sigterm_to_process_1_stops_both_at_one_saved_step_that_restores_here(sgd_jobs):
  first, _ = sgd_jobs
  s = _stopped_at(first)
  params, losses = W.plain_optax("stage2_sgd_clip", s + 2)
  _check_losses(first["reports"], losses)
  ref_params, _ = W.plain_optax("stage2_sgd_clip", s)
  _restore_here_and_continue("stage2_sgd_clip", first["ckpt"], s, ref_params, losses)
  print(f"SIGTERM to process 1: both stopped at step {s}, exited {first['elapsed']:.1f} s later")


def test_sigterm_to_process_0_of_a_two_process_resume_continues_the_same_run(sgd_jobs):
  first, second = sgd_jobs
  s1, s2 = _stopped_at(first), _stopped_at(second)
  assert [r["start"] for r in second["reports"]] == [s1, s1] and s2 > s1 + 3
  ref_params, losses = W.plain_optax("stage2_sgd_clip", s2)
  _check_losses(second["reports"], losses)   # the resumed steps: as if never stopped
  for r in second["reports"]:
    assert min(map(int, r["losses"])) == s1 + 1
  with zj.CheckpointManager(second["ckpt"]) as mngr:
    state = mngr.restore(W.make_step("stage2_sgd_clip"), W.init_params())
  assert int(state.step) == s2
  print(f"resumed at {s1} on 2 processes, SIGTERM to process 0: stopped at {s2}, exited "
        f"{second['elapsed']:.1f} s later")
