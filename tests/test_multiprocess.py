"""Multi-process training: 2 processes x 4 CPU devices against 1 process x 8.

The workers (tests/mp_worker.py) run over gloo on localhost. This process has
8 fake CPU devices (conftest) and computes the references: the same steps on
one process, and plain single-device optax. Every variant runs in one launch
of two workers (each launch pays process start-up and compilation).
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import mp_worker as W
import zero_jax as zj
from zero_jax.processes import distributed as zd
from zero_jax.processes import launch as zl

try:  # zero_jax.checkpoint is written alongside; the checkpoint tests need it
  from zero_jax.checkpoint import CheckpointManager
except ImportError:
  CheckpointManager = None
needs_checkpoint = pytest.mark.skipif(CheckpointManager is None,
                                      reason="zero_jax.checkpoint is not available")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mp_worker.py")
PEER_TIMEOUT = 5.0
# From killing a process to the survivor's exit: the watchdog's timeout, one
# poll interval, and slack for a loaded machine.
EXIT_BOUND_S = PEER_TIMEOUT + 10.0


def _close(a, b, rtol):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * max(np.abs(b).max(), 1e-30))


def _host(tree):
  return {k: np.asarray(v) for k, v in tree.items()}


# ----------------------------------------------------------------- references
@pytest.fixture(scope="module")
def mesh8():
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="module")
def one_process(mesh8, tmp_path_factory):
  """Each variant for 5 steps in this process on 8 devices; a checkpoint of one."""
  ckpt = str(tmp_path_factory.mktemp("ckpt_1p")) if CheckpointManager else None
  out = {}
  for variant in W.VARIANTS:
    step = W.make_step(variant)
    state = step.init(W.init_params(), **W.init_kwargs(variant))
    losses = []
    for t in range(W.STEPS):
      state, m = step(state, W.global_batch(t))
      losses.append(float(m["loss"]))
    out[variant] = {"forward": W.forward_uses(step, state),
                    "params": _host(step.get_params(state)), "loss": np.array(losses)}
    if state.model_state is not None:
      out[variant]["model_state"] = np.asarray(state.model_state["mean"])
    if variant == "stage2_sgd_clip" and ckpt:
      with CheckpointManager(ckpt) as mngr:
        mngr.save(state)
        mngr.wait_until_finished()
      state, _ = step(state, W.global_batch(W.STEPS))
      out["plus_one"] = _host(step.get_params(state))
  out["ckpt"] = ckpt
  return out


@pytest.fixture(scope="module")
def two_processes(one_process, tmp_path_factory):
  """All variants in one launch of 2 processes x 4 devices."""
  out = tmp_path_factory.mktemp("mp")
  start = time.monotonic()
  ckpt = [one_process["ckpt"]] if one_process["ckpt"] else []
  rc = zj.launch_local([sys.executable, WORKER, "parity", str(out)] + ckpt,
                       num_processes=2, devices_per_process=4, timeout=300,
                       log_dir=str(out / "logs"))
  logs = "\n".join((out / "logs" / f"process_{i}.log").read_text()[-4000:] for i in range(2))
  assert rc == 0, f"workers failed (rc {rc}):\n{logs}"
  print(f"2-process launch: {time.monotonic() - start:.1f} s")
  return {"results": [dict(np.load(out / f"parity_{i}.npz")) for i in range(2)],
          "reports": [json.loads((out / f"report_{i}.json").read_text()) for i in range(2)],
          "dir": out}


# ----------------------------------------------------------------- parity
@pytest.mark.parametrize("variant", list(W.VARIANTS))
def test_two_processes_give_the_params_of_one_process_after_5_steps(
    variant, one_process, two_processes):
  ref = one_process[variant]
  for r in two_processes["results"]:
    for k in W.SHAPES:
      _close(r[f"{variant}/{k}"], ref["params"][k], rtol=1e-6)
    _close(r[f"{variant}/loss"], ref["loss"], rtol=1e-6)
    if "model_state" in ref:
      _close(r[f"{variant}/model_state"], ref["model_state"], rtol=1e-6)


@pytest.mark.parametrize("variant", list(W.VARIANTS))
def test_evaluate_and_apply_in_two_processes_equal_one_process(variant, one_process,
                                                               two_processes):
  """Every process gets the same metrics and outputs (test_every_process_gets_the_same_...
  compares them bit for bit), those of one process, and for the exact fp32 variants the
  single-device loss and logits of the same parameters (float rounding: 1e-5, see
  tests/test_evaluate.py)."""
  ref = one_process[variant]["forward"]
  for r in two_processes["results"]:
    _close(r[f"{variant}/eval_loss"], ref["eval_loss"], rtol=1e-6)
    _close(r[f"{variant}/apply"], ref["apply"], rtol=1e-6)
    assert int(r[f"{variant}/eval_step"]) == W.STEPS
  v = W.VARIANTS[variant]
  if v.get("precision") is None and not v.get("extras"):
    p = one_process[variant]["params"]
    _close(ref["eval_loss"], W.loss_fn(p, W.global_batch(W.STEPS)), rtol=1e-5)
    _close(ref["apply"], W.logits(p, W.global_batch(W.STEPS)["x"][:4]), rtol=1e-5)


@pytest.mark.parametrize("variant", [v for v, o in W.VARIANTS.items()
                                     if o.get("precision") is None and not o.get("extras")])
def test_one_process_reference_matches_plain_optax(variant, one_process):
  plain, _ = W.plain_optax(variant)
  for k in W.SHAPES:
    _close(one_process[variant]["params"][k], plain[k], rtol=1e-5)


def test_the_bf16_stage3_variant_runs_the_layout_that_keeps_the_master_as_params():
  """So that the two-process parity above covers that layout (and fails if it moves)."""
  step = W.make_step("bf16_stage3_sgd")
  state = step.init(W.init_params())
  assert state.meta.master_in_params and state.master is None


def test_every_process_gets_the_same_params_and_python_metrics(two_processes):
  r0, r1 = two_processes["results"]
  assert sorted(r0) == sorted(r1)
  for k in r0:
    np.testing.assert_array_equal(r0[k], r1[k], err_msg=k)
  rows = []
  for rep in two_processes["reports"]:
    assert rep["num_devices"] == 8 and rep["local_devices"] == 4
    rows.append(rep["rows"])
    for variant, types in rep["metrics"].items():
      assert types == {"loss": "float", "grad_norm": "float", "grads_finite": "bool",
                       "loss_scale": "float", "skipped_steps": "int",
                       "skipped_in_a_row": "int", "step": "int", "health": "int"}, variant
  assert rows == [[0, 8], [8, 16]]


# ----------------------------------------------------------------- checkpoints
@needs_checkpoint
@pytest.mark.parametrize("variant", [v for v, o in W.VARIANTS.items()
                                     if o.get("hybrid") and not o.get("hpz")])
def test_hybrid_reduce_scatters_and_all_gathers_stay_within_a_process(variant, two_processes):
  """replica_axis across the processes: only the all-reduce of each block crosses them."""
  for rep in two_processes["reports"]:
    groups = [(op, gs) for op, gs, _ in rep["groups"][variant]]
    for op, gs in groups:
      spans = any(len(set(g)) > 1 for g in gs)
      if op in ("reduce-scatter", "all-gather"):
        assert not spans, (op, gs)
    assert any(op == "all-reduce" and any(len(set(g)) > 1 for g in gs) for op, gs in groups)
    assert any(op in ("reduce-scatter", "all-gather") for op, _ in groups)


def test_hpz_stage3_gathers_stay_within_a_process_and_int8_crosses_them(two_processes):
  """hpZ + qwZ + qgZ over 2 processes: the loss's all-gathers (groups of the 4 devices of a
  process) never span processes; what crosses them (the gradient's second hop and the
  refresh of the secondary copy) travels as int8."""
  for rep in two_processes["reports"]:
    colls = rep["groups"]["hpz_qwz_qgz_stage3_adam"]
    crossing = [(op, shape) for op, gs, shape in colls if any(len(set(g)) > 1 for g in gs)]
    gathers = [gs for op, gs, _ in colls if op == "all-gather" and len(gs[0]) == 4]
    assert gathers and all(len(set(g)) == 1 for gs in gathers for g in gs), colls
    assert crossing and all("s8[" in shape or op == "all-reduce" for op, shape in crossing), \
        crossing
    assert {op for op, _ in crossing} >= {"all-to-all", "all-gather"}, crossing


@pytest.fixture(scope="module")
def misuse(tmp_path_factory):
  """One launch of 2 processes for the misuse cases (mp_worker's "misuse" mode)."""
  out = tmp_path_factory.mktemp("misuse")
  rc = zj.launch_local([sys.executable, WORKER, "misuse", str(out)], num_processes=2,
                       devices_per_process=4, timeout=120, log_dir=str(out / "logs"))
  logs = [(out / "logs" / f"process_{i}.log").read_text() for i in range(2)]
  assert rc == 0, logs[0][-3000:]
  return out, logs


def test_a_process_feeding_other_rows_than_its_peers_is_an_error_on_every_process(misuse):
  for i in range(2):
    msg = (misuse[0] / f"rows_{i}.txt").read_text()
    assert "process 0: 2, process 1: 1" in msg and "process_batch_slice" in msg, msg


def test_a_skipped_step_is_warned_on_every_process_at_get_params_and_at_exit(misuse):
  """The metrics span both processes (not fully addressable): each reads its own copy."""
  for i in range(2):
    warned = (misuse[0] / f"warned_{i}.txt").read_text()
    assert "zero_jax: step 0 was skipped because both the loss and the gradient" in warned
    assert misuse[1][i].count("zero_jax: step 0 was skipped") == 1, misuse[1][i][-3000:]


def test_checkpoint_from_one_process_restores_in_two(one_process, two_processes):
  ref = one_process["stage2_sgd_clip"]["params"]
  for r in two_processes["results"]:
    assert int(r["restored/step"]) == W.STEPS
    for k in W.SHAPES:
      np.testing.assert_array_equal(r[f"restored/{k}"], ref[k])
      _close(r[f"restored_plus_one/{k}"], one_process["plus_one"][k], rtol=1e-6)


@needs_checkpoint
def test_checkpoint_from_two_processes_restores_in_one(mesh8, one_process, two_processes):
  step = W.make_step("stage2_sgd_clip")
  with CheckpointManager(two_processes["dir"] / "ckpt_mp") as mngr:
    restored = mngr.restore(step, W.init_params())
  assert int(restored.step) == W.STEPS
  params = step.get_params(restored)
  for k in W.SHAPES:
    np.testing.assert_array_equal(np.asarray(params[k]),
                                  two_processes["results"][0][f"stage2_sgd_clip/{k}"])
  restored, _ = step(restored, W.global_batch(W.STEPS))
  for k, x in step.get_params(restored).items():
    _close(x, one_process["plus_one"][k], rtol=1e-6)


# ----------------------------------------------------------------- a lost peer
def _wait_for(path, text, procs, timeout=180):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if os.path.exists(path) and text in pathlib.Path(path).read_text():
      return
    if any(p.poll() is not None for p in procs):
      break
    time.sleep(0.1)
  for p in procs:
    p.kill()
  raise AssertionError(f"{path} never showed {text!r}:\n{pathlib.Path(path).read_text()[-3000:]}")


def _run_until_failure(tmp_path, extra_args, victim=None):
  """Starts 2 'forever' workers; kills ``victim`` once both passed step 3."""
  logs = tmp_path / "logs"
  survivor_id = 0 if victim is None else 1 - victim
  procs = zl.start_local_processes([sys.executable, WORKER, "forever", str(tmp_path)] +
                                   extra_args, num_processes=2, devices_per_process=4,
                                   peer_timeout_seconds=PEER_TIMEOUT, log_dir=str(logs))
  try:
    if victim is not None:
      for i in range(2):
        _wait_for(logs / f"process_{i}.log", f"process {i} step 3 ", procs)
      procs[victim].kill()
    else:  # the failing process announces itself in its log
      _wait_for(logs / "process_1.log", "injected failure", procs)
    t0 = time.monotonic()
    survivor = procs[survivor_id]
    survivor.wait(timeout=EXIT_BOUND_S + 60)
    elapsed = time.monotonic() - t0
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  text = (logs / f"process_{survivor_id}.log").read_text()
  return survivor.returncode, elapsed, text


def test_survivor_exits_naming_the_killed_peer_within_the_bound(tmp_path):
  code, elapsed, text = _run_until_failure(tmp_path, [], victim=1)
  assert code == zj.LOST_PEER_EXIT_CODE, text[-3000:]
  assert "zero_jax: lost peer process 1 of 2" in text, text[-3000:]
  assert elapsed < EXIT_BOUND_S, (elapsed, text[-3000:])
  print(f"killed process 1: process 0 exited after {elapsed:.1f} s")


def test_survivor_exits_when_the_coordinator_process_is_killed(tmp_path):
  # JAX itself ends the job at once when process 0 (the coordination service)
  # is gone: SIGABRT with a message naming the leader task.
  code, elapsed, text = _run_until_failure(tmp_path, [], victim=0)
  assert code != 0, text[-3000:]
  assert "leader task" in text, text[-3000:]
  assert elapsed < EXIT_BOUND_S, (elapsed, text[-3000:])
  print(f"killed process 0: process 1 exited ({code}) after {elapsed:.1f} s")


def test_survivor_exits_naming_a_peer_that_raised(tmp_path):
  code, elapsed, text = _run_until_failure(tmp_path, ["1"])
  assert code == zj.LOST_PEER_EXIT_CODE, text[-3000:]
  assert "zero_jax: lost peer process 1 of 2" in text, text[-3000:]
  assert "failed with RuntimeError: mp_worker: injected failure" in text, text[-3000:]
  assert elapsed < EXIT_BOUND_S, (elapsed, text[-3000:])


def test_survivor_whose_collective_fails_after_a_peer_raised_names_that_peer(tmp_path):
  # The peer raises and leaves at once: the survivor's next collective fails
  # (connection reset) long before any timeout. Its exception hook sees that the
  # peer had failed first and reports that peer, with the lost-peer exit code.
  code, elapsed, text = _run_until_failure(tmp_path, ["1", "now"])
  assert code == zj.LOST_PEER_EXIT_CODE, text[-3000:]
  assert "zero_jax: lost peer process 1 of 2" in text, text[-3000:]
  assert "failed with RuntimeError: mp_worker: injected failure" in text, text[-3000:]
  assert "stopped with an error that followed" in text, text[-3000:]
  assert elapsed < EXIT_BOUND_S, (elapsed, text[-3000:])


GLOO_READ_TIMEOUT_S = 30.0  # gloo's TCP read timeout in jaxlib 0.10 (not configurable)


def test_with_default_timeouts_a_peer_that_raises_stops_the_job_naming_it(tmp_path, capfd):
  # Default settings throughout: peer_timeout_seconds=60 (poll interval 5 s).
  # A survivor blocked in a collective with the failed peer would be ended by
  # gloo's read timeout (exit 1, a gloo traceback, no zero_jax line) if the
  # watchdog waited longer than that; it waits FAILED_PEER_GRACE_S after seeing
  # the failure, which it sees within one interval, and stops within another.
  assert zd.ENV_PEER_TIMEOUT not in os.environ
  interval = 5.0
  assert zd.FAILED_PEER_GRACE_S + 2 * interval < GLOO_READ_TIMEOUT_S
  logs = tmp_path / "logs"
  t0 = time.monotonic()
  rc = zj.launch_local([sys.executable, WORKER, "forever", str(tmp_path), "1"],
                       num_processes=2, devices_per_process=4, log_dir=str(logs), timeout=120)
  elapsed = time.monotonic() - t0
  err = capfd.readouterr().err
  survivor = (logs / "process_0.log").read_text()
  assert "zero_jax: lost peer process 1 of 2" in survivor, survivor[-3000:]
  assert "failed with RuntimeError: mp_worker: injected failure" in survivor, survivor[-3000:]
  assert "Read timeout" not in survivor, survivor[-3000:]  # the watchdog spoke first
  assert "process 0 exited with code 3" in err, err
  # launch_local reports the process that raised (it ends after the survivor).
  assert rc == 1, err
  assert "process 1 failed first (exited with code 1)" in err, err
  assert elapsed < 60, elapsed
  print(f"default timeouts: the job stopped {elapsed:.1f} s after its start")


# ----------------------------------------------------------------- helpers, one process
def test_metrics_to_host_gives_python_values():
  m = zj.metrics_to_host({"loss": jax.numpy.float32(1.5), "ok": jax.numpy.bool_(True),
                          "n": jax.numpy.int32(3), "v": jax.numpy.ones(2)})
  assert m["loss"] == 1.5 and type(m["loss"]) is float
  assert m["ok"] is True and type(m["n"]) is int
  assert isinstance(m["v"], np.ndarray) and m["v"].shape == (2,)


def test_make_global_batch_with_one_process_is_the_batch(mesh8):
  assert zj.process_batch_slice(16, mesh8) == slice(0, 16)
  b = W.global_batch(0)
  g = zj.make_global_batch(b, mesh8)
  assert g["x"].sharding.spec == jax.sharding.PartitionSpec("data")
  np.testing.assert_array_equal(np.asarray(g["x"]), b["x"])
  assert zj.is_main_process()


def test_make_global_batch_names_the_leaf_with_a_bad_size(mesh8):
  with pytest.raises(ValueError, match=r"local_batch\['y'\] has leading dimension 5"):
    zj.make_global_batch({"x": np.zeros((8, 2)), "y": np.zeros((5, 2))}, mesh8)
  with pytest.raises(ValueError, match="divisible by the 8 devices"):
    zj.process_batch_slice(12, mesh8)


def test_launch_local_reports_the_process_that_failed_first_not_a_lost_peer_stop(capfd):
  # Process 0 stops at once for a lost peer (code 3); process 1, which failed
  # first but waited for its peers, exits later with code 1: the root cause.
  script = ("import os, sys, time\n"
            "if os.environ['ZERO_JAX_PROCESS_ID'] == '0': sys.exit(3)\n"
            "time.sleep(1.0); sys.exit(1)\n")
  rc = zj.launch_local([sys.executable, "-c", script], num_processes=2, grace_seconds=10)
  err = capfd.readouterr().err
  assert rc == 1, err
  assert "process 1 failed first (exited with code 1)" in err, err
  assert "process 0 exited with code 3 (it stopped because it lost a peer)" in err, err


def test_launch_local_reports_the_failed_process(tmp_path, capfd):
  script = "import os, sys; sys.exit(5 if os.environ['ZERO_JAX_PROCESS_ID'] == '1' else 0)"
  rc = zj.launch_local([sys.executable, "-c", script], num_processes=2, grace_seconds=5)
  assert rc == 5
  assert "process 1 exited with code 5" in capfd.readouterr().err
