"""Preemption: a signal to any process of a 2-process job saves the same step on both.

The jobs are 2 processes x 4 CPU devices over gloo: tests/preempt_worker.py (one of
tests/mp_worker.py's small models), started directly or under examples/launch_local.py,
and the LM example under the launcher. JAX's preemption service picks the step; every
process saves it and exits 0. The checkpoints then restore in this process (1 process, 8
devices) and in another 2-process job, and the losses from there on equal those of plain
single-device optax (SGD and Adam) that was never stopped. Every job costs process start-ups
and compilations: they all run at once, in threads, started by one module fixture.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mp_worker as W
import zero_jax as zj
from zero_jax.processes import launch as zl
from zero_jax.checkpoint import preemption

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "preempt_worker.py")
LAUNCH = str(ROOT / "examples" / "launch_local.py")
TRAIN_LM = str(ROOT / "examples" / "train_lm.py")
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
EXIT_BOUND_S = 60.0  # from the signal to every process's exit: inside SLURM's 120 s advice
LM_FLAGS = ["--size", "tiny", "--seq-len", "32", "--batch-size", "16", "--steps", "150",
            "--save-every", "100000", "--eval-batches", "0", "--sample-bytes", "0",
            "--platform", "cpu", "--no-progress", "--log-every", "1"]


# ----------------------------------------------------------------- running jobs
def _text(path) -> str:
  return pathlib.Path(path).read_text(errors="replace") if os.path.exists(path) else ""


def _wait_for(paths, text, procs, timeout=300.0):
  """Until every file in ``paths`` shows ``text``; fails if a process ends first."""
  deadline = time.monotonic() + timeout
  while not all(text in _text(p) for p in paths):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:
        p.kill()
      raise AssertionError(f"never saw {text!r}:\n" + "\n".join(_text(p)[-3000:] for p in paths))
    time.sleep(0.05)


def _finish(procs, logs, started: float) -> float:
  """Waits for every process; the seconds from ``started`` to the last exit."""
  try:
    for p in procs:
      p.wait(timeout=EXIT_BOUND_S + 120)
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
  elapsed = _finish(procs, logs, t0)
  return {"reports": [json.loads((out / f"report_{i}.json").read_text()) for i in range(2)],
          "ckpt": ckpt, "logs": [_text(p) for p in logs], "elapsed": elapsed}


def _sgd_chain(tmp):
  """SIGTERM to process 1; a 2-process resume of that checkpoint, SIGTERM to process 0."""
  first = _job(tmp / "first", "stage2_sgd_clip", victims=(1,))
  shutil.copytree(first["ckpt"], tmp / "second" / "ckpt")
  s = first["reports"][0]["stopped"]["step"]
  second = _job(tmp / "second", "stage2_sgd_clip", "--resume", victims=(0,),
                after=f"step {s + 3}")
  return first, second


def _launched(tmp, argv, *, sigterm_to):
  """``python examples/launch_local.py -n 2 -d 4 ARGV``; SIGTERM once ``sigterm_to(out)``
  names a process (the launcher, or one of its children) to stop."""
  tmp.mkdir(parents=True, exist_ok=True)
  out = tmp / "launcher.log"
  with open(out, "wb") as f:
    launcher = subprocess.Popen([sys.executable, LAUNCH, "-n", "2", "-d", "4", *argv],
                                stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **ENV},
                                cwd=ROOT)
  deadline = time.monotonic() + 300
  while (pid := sigterm_to(launcher, _text(out))) is None:
    assert launcher.poll() is None and time.monotonic() < deadline, _text(out)[-3000:]
    time.sleep(0.05)
  t0 = time.monotonic()
  os.kill(pid, signal.SIGTERM)
  try:
    launcher.wait(timeout=EXIT_BOUND_S + 120)
  except subprocess.TimeoutExpired:
    for child in _children(launcher):  # before they are orphaned
      os.kill(child, signal.SIGKILL)
  elapsed = _finish([launcher], [out], t0)
  return _text(out), elapsed


def _children(launcher) -> dict[int, list[bytes]]:
  """The launcher's child processes: pid -> environment."""
  out = {}
  for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
    try:
      if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == launcher.pid:
        out[int(stat.parent.name)] = (stat.parent / "environ").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
      continue
  return out


def _child(launcher, process_id: int) -> int | None:
  """The pid of the launcher's child with ``ZERO_JAX_PROCESS_ID=process_id``."""
  return next((pid for pid, env in _children(launcher).items()
               if f"ZERO_JAX_PROCESS_ID={process_id}".encode() in env), None)


def _compiling_job(tmp):
  """SIGTERM to the launcher while both processes compile: it passes it on to both."""
  (tmp / "out").mkdir(parents=True)
  both = lambda launcher, out: launcher.pid if out.count(" compiling\n") == 2 else None
  out, elapsed = _launched(tmp, [WORKER, str(tmp / "out"), str(tmp / "ckpt"),
                                 "stage2_sgd_clip", "--hold", "8"], sigterm_to=both)
  return {"reports": [json.loads((tmp / "out" / f"report_{i}.json").read_text())
                      for i in range(2)],
          "ckpt": tmp / "ckpt", "log": out, "elapsed": elapsed}


def _lm_chain(tmp):
  """The issue's run: the LM example on 2 processes, SIGTERM to process 1 once it trains;
  then the command it prints, on 1 process with 8 devices, to the end; and the same run on
  1 process, never stopped."""
  ckpt = tmp / "ckpt"
  flags = [*LM_FLAGS, "--ckpt-dir", str(ckpt), "--metrics-json", str(tmp / "mp.json")]
  training = lambda launcher, out: (_child(launcher, 1) if "compilation included" in out
                                    else None)
  out, elapsed = _launched(tmp, [TRAIN_LM, *flags], sigterm_to=training)
  stops = re.findall(r"preempted: every process stopped at step (\d+), saved in (.*?)\. "
                     r"Resume on any number of processes and devices with: (.*)", out)
  assert len(stops) == 2 and stops[0] == stops[1], out[-5000:]
  s = int(stops[0][0])
  cmd = shlex.split(stops[0][2])  # to the end: the learning-rate schedule spans --steps
  resumed = subprocess.run([sys.executable, *cmd[1:], "--metrics-json", str(tmp / "1p.json")],
                           capture_output=True, text=True, timeout=600, cwd=ROOT,
                           env={**os.environ, **ENV})
  assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
  flags = [*LM_FLAGS, "--ckpt-dir", str(tmp / "ref_ckpt"), "--metrics-json", str(tmp / "ref.json")]
  ref = subprocess.run([sys.executable, TRAIN_LM, *flags], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env={**os.environ, **ENV})
  assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
  return {"out": out, "elapsed": elapsed, "step": s, "dir": stops[0][1], "ckpt": ckpt,
          "resumed": resumed.stdout, "mp": json.loads((tmp / "mp.json").read_text()),
          "1p": json.loads((tmp / "1p.json").read_text()),
          "uninterrupted": json.loads((tmp / "ref.json").read_text())}


def _uses(job: str):
  """Marks a test as checking ``job``: the `jobs` fixture runs the jobs of the tests run."""
  def mark(fn):
    fn.job = job
    return fn
  return mark


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, request):
  """The jobs of the tests being run, started at once (each in a thread); a test waits for
  the one it checks."""
  tmp = tmp_path_factory.mktemp("preempt")
  runs = {
      "sgd": lambda: _sgd_chain(tmp / "sgd"),
      # Process 1 sends itself SIGUSR1 (a watched signal that is not JAX's SIGTERM) every
      # 20 ms from the moment its periodic save of step 6 is under way: the preemption's
      # own save gets them too.
      "storm": lambda: _job(tmp / "storm", "stage1_adam", "--save-every", "3",
                            "--signals", "SIGTERM,SIGUSR1", "--storm-after", "6",
                            victims=(), after="compiling"),
      "compiling": lambda: _compiling_job(tmp / "compiling"),
      "lm": lambda: _lm_chain(tmp / "lm"),
  }
  wanted = {getattr(getattr(item, "function", None), "job", None)
            for item in request.session.items}
  runs = {name: run for name, run in runs.items() if name in wanted}
  with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
    futures = {name: pool.submit(run) for name, run in runs.items()}
    yield futures


# ----------------------------------------------------------------- checks
def _stopped_at(job) -> int:
  """The step where both processes stopped: the same, saved, logged, intact on disk."""
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


def _restore_here_and_continue(variant, ckpt, at, more=2):
  """In this process, on 8 devices: the checkpoint of step ``at`` is the state plain optax
  has after ``at`` steps, and the next steps' losses are plain optax's."""
  ref_params, ref_losses = W.plain_optax(variant, at)
  _, ref_losses = W.plain_optax(variant, at + more)
  step = W.make_step(variant)
  with zj.CheckpointManager(ckpt) as mngr:
    state = mngr.restore(step, W.init_params(), step=at)
  assert int(state.step) == at
  for k, x in step.get_params(state).items():
    np.testing.assert_allclose(np.asarray(x), ref_params[k], rtol=2e-5, atol=2e-6, err_msg=k)
  for t in range(at, at + more):
    state, m = step(state, W.global_batch(t))
    assert float(m["loss"]) == pytest.approx(ref_losses[t + 1], rel=2e-5), t
  return ref_losses


@_uses("sgd")
def test_sigterm_to_process_1_stops_both_at_one_saved_step_that_restores_on_one(jobs):
  first, _ = jobs["sgd"].result()
  s = _stopped_at(first)
  losses = _restore_here_and_continue("stage2_sgd_clip", first["ckpt"], s)
  _check_losses(first["reports"], losses)
  print(f"SIGTERM to process 1: both stopped at step {s}, exited {first['elapsed']:.1f} s later")


@_uses("sgd")
def test_sigterm_to_process_0_of_a_two_process_resume_continues_the_same_run(jobs):
  first, second = jobs["sgd"].result()
  s1, s2 = _stopped_at(first), _stopped_at(second)
  assert [r["start"] for r in second["reports"]] == [s1, s1] and s2 > s1 + 3
  for r in second["reports"]:
    assert min(map(int, r["losses"])) == s1 + 1
  _check_losses(second["reports"], W.plain_optax("stage2_sgd_clip", s2)[1])
  _restore_here_and_continue("stage2_sgd_clip", second["ckpt"], s2)
  print(f"resumed at {s1} on 2 processes, SIGTERM to process 0: stopped at {s2}, exited "
        f"{second['elapsed']:.1f} s later")


@_uses("storm")
def test_signals_during_a_periodic_save_and_during_the_preemption_save_corrupt_nothing(jobs):
  job = jobs["storm"].result()
  assert job["reports"][1]["save_in_flight"] is True  # the first signal came mid-write
  assert "zero_jax: SIGUSR1 received: a preemption notice" in job["logs"][1]
  assert "zero_jax: SIGUSR1 again: the processes are already stopping" in job["logs"][1]
  s = _stopped_at(job)
  with zj.CheckpointManager(job["ckpt"]) as mngr:
    assert mngr.all_steps() == sorted({*range(3, s + 1, 3), s})
  _restore_here_and_continue("stage1_adam", job["ckpt"], 6, more=1)
  losses = _restore_here_and_continue("stage1_adam", job["ckpt"], s, more=1)
  _check_losses(job["reports"], losses)


@_uses("compiling")
def test_sigterm_to_the_launcher_while_compiling_ends_both_with_nothing_to_save(jobs):
  job = jobs["compiling"].result()
  assert "SIGTERM forwarded to processes [0, 1]" in job["log"], job["log"][-3000:]
  assert [r["stopped"] for r in job["reports"]] == [{"step": 0, "saved": False}] * 2
  assert [r["losses"] for r in job["reports"]] == [{}, {}]  # not one step taken
  line = f"preempted before the first step (step 0): nothing to save in {job['ckpt']}"
  assert job["log"].count(line) == 2, job["log"][-3000:]
  # Nothing saved: the manager makes its directory on the first save, so there is none.
  assert not os.path.exists(job["ckpt"]) or not [d for d in os.listdir(job["ckpt"])
                                                   if d[0].isdigit()]
  assert job["elapsed"] < EXIT_BOUND_S


@_uses("lm")
def test_the_lm_example_saves_one_step_on_sigterm_to_process_1_and_resumes_on_8_devices(jobs):
  """The issue's acceptance run: no periodic save due; both processes save the same step,
  print it with the command that resumes, exit 0; the launcher exits 0; that command, on
  one process with 8 devices, starts from exactly the saved parameters, and every loss before
  and after the stop is the loss of a run on one process that was never stopped."""
  job = jobs["lm"].result()
  s = job["step"]
  assert s >= 1 and job["dir"] == str(job["ckpt"]) and job["elapsed"] < EXIT_BOUND_S
  assert job["mp"]["step"] == s and job["mp"]["preempted"] and job["mp"]["saved"]
  assert f"resumed from {job['ckpt']} at step {s}" in job["resumed"]
  one = job["1p"]
  steps = int(LM_FLAGS[LM_FLAGS.index("--steps") + 1])
  assert one["n_devices"] == 8 and one["start_step"] == s and one["step"] == steps
  assert one["start_checksum"] == pytest.approx(job["mp"]["param_checksum"], rel=1e-6)
  assert sorted(map(int, one["losses"])) == list(range(s + 1, steps + 1))
  ref = job["uninterrupted"]["losses"]  # one process, 8 devices, never stopped
  for t, loss in [*job["mp"]["losses"].items(), *one["losses"].items()]:
    # Equal to float rounding (2 processes sum in another order than 1), which Adam carries
    # on and grows: exactly the same up to ten steps after the stop, close after that.
    assert loss == pytest.approx(ref[t], rel=1e-5 if int(t) <= s + 10 else 1e-3), t
  print(f"LM example: SIGTERM to process 1, both saved step {s} and exited "
        f"{job['elapsed']:.1f} s later; resumed on 1 process x 8 devices")


# ----------------------------------------------------------------- one process, in this one
@pytest.fixture
def fresh_watch(monkeypatch):
  """A clean preemption watch; afterwards this process's handlers are what they were."""
  before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
  monkeypatch.setattr(preemption, "_watch", preemption._Watch())
  yield
  for s, h in before.items():
    signal.signal(s, h)


@pytest.fixture(scope="module")
def tiny():
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
  mesh = jax.make_mesh((8,), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh)
  batch = {"x": np.ones((8, 3), np.float32), "y": np.ones((8, 1), np.float32)}
  return step, {"w": np.zeros((3, 1), np.float32)}, batch


def test_one_process_a_watched_signal_stops_at_the_next_check_and_a_storm_harms_nothing(
    tiny, fresh_watch, tmp_path, capfd):
  step, params, batch = tiny
  zj.watch_preemption(signal.SIGUSR1)
  state, stop = step.init(params), threading.Event()

  def storm():  # SIGUSR1 every 5 ms, during the preemption's save too
    while not stop.is_set():
      os.kill(os.getpid(), signal.SIGUSR1)
      time.sleep(0.005)

  mngr = zj.CheckpointManager(tmp_path)
  thread = threading.Thread(target=storm)
  checks = []
  try:
    for i in range(1000):
      checks.append(mngr.reached_preemption(state))
      if checks[-1]:
        written = sorted(os.listdir(tmp_path))  # the write is finished: committed
        later = mngr.reached_preemption(state)  # and every later call says stop
        break
      state, _ = step(state, batch)
      if i == 2:
        thread.start()
        time.sleep(0.05)  # the handler runs in this thread, between two bytecodes
  finally:
    stop.set()
    if thread.is_alive():
      thread.join()
    time.sleep(0.05)  # the last signals' handlers run before the handler goes
    mngr.close()
  assert checks == [False] * 3 + [True] and "3" in written, written
  assert (mngr.preemption.step, mngr.preemption.saved) == (3, True)
  assert signal.getsignal(signal.SIGUSR1) is preemption._on_signal  # until the exit
  assert later
  with pytest.raises(RuntimeError, match="is closed"):  # a closed manager is refused up front
    mngr.reached_preemption(state)
  err = capfd.readouterr().err
  assert "zero_jax: SIGUSR1 received: a preemption notice" in err
  assert "zero_jax: SIGUSR1 again: the processes are already stopping" in err
  with zj.CheckpointManager(tmp_path) as mngr:
    assert mngr.all_steps() == [3]
    back = mngr.restore(step, params)
  np.testing.assert_array_equal(np.asarray(step.get_params(back)["w"]),
                                np.asarray(step.get_params(state)["w"]))


def test_one_process_no_notice_no_stop_and_the_handler_lasts_until_close(tiny, fresh_watch,
                                                                         tmp_path):
  step, params, batch = tiny
  state = step.init(params)
  with zj.CheckpointManager(tmp_path) as mngr:
    for _ in range(3):
      assert not mngr.reached_preemption(state)
      state, _ = step(state, batch)
    assert signal.getsignal(signal.SIGTERM) is preemption._on_signal  # the default: SIGTERM
  assert signal.getsignal(signal.SIGTERM) is not preemption._on_signal
  assert mngr.preemption is None and mngr.all_steps() == []


def test_bad_signals_states_and_threads_are_clear_errors(tiny, fresh_watch, tmp_path):
  with pytest.raises(ValueError, match="SIGKILL cannot be caught"):
    zj.watch_preemption([signal.SIGKILL])
  with pytest.raises(ValueError, match="12345 is not a signal"):
    zj.watch_preemption([12345])
  errors = []
  t = threading.Thread(target=lambda: errors.append(_raised(zj.watch_preemption)))
  t.start()
  t.join()
  assert "must run in the main thread" in str(errors[0])
  step, params, _ = tiny
  with zj.CheckpointManager(tmp_path) as mngr:
    with pytest.raises(TypeError, match="needs the TrainState .* got dict"):
      mngr.reached_preemption(params)


def test_a_watch_the_user_started_lasts_across_managers_and_threads(tiny, fresh_watch,
                                                                    tmp_path):
  """zj.watch_preemption in the main thread, then managers in a training thread: each
  close writes its last checkpoint, the chosen signal stays watched, a notice stops the
  second; a third manager after the stop is refused."""
  step, params, batch = tiny
  zj.watch_preemption([signal.SIGUSR1])
  out, errors = {}, []

  def train():
    try:
      state = step.init(params)
      with zj.CheckpointManager(tmp_path / "a") as a:
        for _ in range(2):
          assert not a.reached_preemption(state)
          state, _ = step(state, batch)
        a.save(state)
      out["after_a"] = signal.getsignal(signal.SIGUSR1)
      with zj.CheckpointManager(tmp_path / "b") as b:
        while not b.reached_preemption(state):
          state, _ = step(state, batch)
          if int(state.step) == 4:
            os.kill(os.getpid(), signal.SIGUSR1)
        out["stopped"] = b.preemption
      with zj.CheckpointManager(tmp_path / "c") as c:
        with pytest.raises(RuntimeError, match=r"already stopped for preemption at step \d+ \(\S*b\)"):
          c.reached_preemption(state)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
  t = threading.Thread(target=train)
  t.start()
  t.join()
  assert not errors, errors
  assert out["after_a"] is preemption._on_signal
  with zj.CheckpointManager(tmp_path / "a") as a:
    assert a.all_steps() == [2]  # the save before close in the thread was committed
  assert out["stopped"].step >= 4 and out["stopped"].saved  # the handler runs in main


def test_a_job_without_jaxs_preemption_service_is_told_how_to_turn_it_on(
    tiny, fresh_watch, tmp_path, monkeypatch):
  """What JAX raises in a multi-process job started with the service off, reworded."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  def service_off(step_id):
    raise RuntimeError("Preemption sync manager has not been initialized.")
  monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", service_off)
  monkeypatch.setattr(preemption.distributed, "is_multi_process", lambda: True)
  step, params, _ = tiny
  with zj.CheckpointManager(tmp_path) as mngr:
    with pytest.raises(RuntimeError, match="Leave jax_enable_preemption_service at its default"):
      mngr.reached_preemption(step.init(params))


def _raised(fn):
  try:
    fn()
  except Exception as e:  # pylint: disable=broad-except
    return e
  return None


@pytest.mark.parametrize("given", ["SIGUSR1", "USR1", "usr1", signal.SIGUSR1, int(signal.SIGUSR1),
                                   ["SIGUSR1", signal.SIGTERM], ("USR1",)],
                         ids=["name", "short_name", "lower_case", "member", "number", "list",
                              "tuple"])
def test_signals_are_taken_by_name_number_member_or_a_list_of_them(fresh_watch, given):
  """Issue 48: ``watch_preemption("SIGUSR1")`` said "'S' is not a signal" (the string was
  iterated)."""
  zj.watch_preemption(given)
  assert signal.getsignal(signal.SIGUSR1) is preemption._on_signal
  os.kill(os.getpid(), signal.SIGUSR1)
  time.sleep(0.05)  # the handler runs in this thread, between two bytecodes
  assert preemption._watch.notice == "SIGUSR1"


@pytest.mark.parametrize("given,error,message", [
    ("SIGFOO", ValueError, r"'SIGFOO' is not a signal name of this platform; pass a "
                           r"signal.Signals member \(signal.SIGUSR1\), its number \(\d+\), its "
                           r"name \('SIGUSR1' or 'USR1', any case\), or a list of these"),
    (["USR1", "TERMINATE"], ValueError, r"'TERMINATE' is not a signal name"),
    ("KILL", ValueError, r"SIGKILL cannot be caught"),
    (1.5, TypeError, r"signals=1.5 \(float\) is not a signal; pass a signal.Signals member"),
    ([None], TypeError, r"None \(NoneType\) is not a signal; pass a signal.Signals member"),
    ([True], TypeError, r"True \(bool\) is not a signal"),
    ([], ValueError, r"signals= is empty"),
], ids=["unknown_name", "unknown_in_list", "uncatchable_name", "float", "none", "bool", "empty"])
def test_bad_signal_names_say_which_forms_are_taken(fresh_watch, given, error, message):
  with pytest.raises(error, match=message):
    zj.watch_preemption(given)
