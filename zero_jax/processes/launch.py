"""Trying a multi-process job on one machine: n local CPU processes over gloo.

`launch_local` starts ``n`` copies of a script, each with a few CPU devices
and the ``ZERO_JAX_*`` variables that `zero_jax.initialize_distributed`
reads, waits for them, and reports the process that failed first (not a
survivor that stopped because its peer was lost). ``python
examples/launch_local.py`` wraps it for the command line.

Example:
  import sys, zero_jax as zj
  zj.launch_local([sys.executable, "train.py"], num_processes=2, devices_per_process=4)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Sequence

from zero_jax.processes.distributed import (ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES,
                                  ENV_PEER_TIMEOUT, ENV_PROCESS_ID, LOST_PEER_EXIT_CODE)


def free_port() -> int:
  """A TCP port on localhost that the OS reports free (bind to port 0)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_local_processes(argv: Sequence[str], *, num_processes: int = 2,
                          devices_per_process: int = 4, peer_timeout_seconds: float | None = None,
                          env: dict | None = None, log_dir: str | None = None,
                          **popen_kwargs) -> list[subprocess.Popen]:
  """Starts ``num_processes`` copies of ``argv`` wired into one CPU JAX job.

  Each child gets the ``ZERO_JAX_*`` variables that `initialize_distributed`
  reads (coordinator on a free localhost port, its process id, its CPU device
  count) and ``JAX_PLATFORMS=cpu``. The caller waits for them; `launch_local`
  does that with a watchdog.

  Args:
    argv: the command, e.g. ``[sys.executable, "train.py", "--steps", "10"]``.
    num_processes: how many processes.
    devices_per_process: CPU devices each one exposes.
    peer_timeout_seconds: overrides the children's watchdog timeout.
    env: extra environment variables for every child.
    log_dir: if given, process ``i`` writes its stdout and stderr to
      ``log_dir/process_<i>.log``.
    **popen_kwargs: passed to ``subprocess.Popen`` (e.g. ``stdout=``).

  Returns:
    The ``subprocess.Popen`` objects, in process-id order.
  """
  port = free_port()
  procs = []
  for i in range(num_processes):
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env.update({
        ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(num_processes),
        ENV_PROCESS_ID: str(i), ENV_LOCAL_DEVICES: str(devices_per_process),
        "JAX_PLATFORMS": "cpu"})
    if peer_timeout_seconds is not None:
      child_env[ENV_PEER_TIMEOUT] = str(peer_timeout_seconds)
    if log_dir is None:
      procs.append(subprocess.Popen(list(argv), env=child_env, **popen_kwargs))
      continue
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"process_{i}.log"), "wb") as log:
      procs.append(subprocess.Popen(list(argv), env=child_env, stdout=log,
                                    stderr=subprocess.STDOUT, **popen_kwargs))
  return procs


def _describe(code: int) -> str:
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  if code == LOST_PEER_EXIT_CODE:
    return f"exited with code {code} (it stopped because it lost a peer)"
  return f"exited with code {code}"


def _root_cause(failures: list[tuple[int, int]]) -> tuple[int, int]:
  """The failure the others followed: the first (in the order they ended) that is
  not a stop for a lost peer (`LOST_PEER_EXIT_CODE`), else the first."""
  return next((f for f in failures if f[1] != LOST_PEER_EXIT_CODE), failures[0])


def _wait_for(procs, grace_seconds: float, timeout: float | None) -> list[tuple[int, int]]:
  """Waits as `launch_local` says; ``(process id, code)`` in the order they ended."""
  start, failed_at, ended = time.monotonic(), None, []
  while len(ended) < len(procs):
    now = time.monotonic()
    for i, p in enumerate(procs):
      if p.poll() is not None and all(i != j for j, _ in ended):
        ended.append((i, p.returncode))
        if p.returncode != 0 and failed_at is None:
          failed_at = now
          print(f"zero_jax.launch_local: process {i} {_describe(p.returncode)}; the others "
                f"have {grace_seconds:g} s to stop.", file=sys.stderr, flush=True)
    late = failed_at is not None and now - failed_at > grace_seconds
    if len(ended) < len(procs) and (late or (timeout is not None and now - start > timeout)):
      print(f"zero_jax.launch_local: terminating processes "
            f"{[i for i, p in enumerate(procs) if p.poll() is None]}.", file=sys.stderr,
            flush=True)
      break
    time.sleep(0.1)
  return ended


def _forward_sigterm(procs):
  """Passes SIGTERM on to the processes still running (a preemption notice: they save
  and exit); returns what puts the previous handler back."""
  if threading.current_thread() is not threading.main_thread():
    return lambda: None  # Python handles signals in the main thread only

  def forward(signum, frame):  # pylint: disable=unused-argument
    live = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in live:
      procs[i].send_signal(signum)
    os.write(2, f"zero_jax.launch_local: SIGTERM forwarded to processes {live}; waiting for "
                f"them to save and exit.\n".encode())

  previous = signal.signal(signal.SIGTERM, forward)
  return lambda: signal.signal(signal.SIGTERM, previous)


def launch_local(argv: Sequence[str], *, num_processes: int = 2, devices_per_process: int = 4,
                 grace_seconds: float = 90.0, timeout: float | None = None,
                 **kwargs) -> int:
  """Runs ``argv`` as a ``num_processes``-process CPU job on this machine.

  Waits for all processes. When one fails, the others get ``grace_seconds``
  to stop on their own (their watchdogs report the lost peer) and are then
  terminated. Prints the process that failed first, the root cause, and how
  every process ended: a process that raised exits only after its peers have
  stopped (with `LOST_PEER_EXIT_CODE`), so the order in which they end does
  not tell which one failed first, but the exit codes do. A SIGTERM to the
  launcher (a preemption notice) is passed on to every process, which saves
  and exits (`CheckpointManager.reached_preemption`); it then returns 0 if
  they all exited 0.

  Example:
    import sys, zero_jax as zj
    zj.launch_local([sys.executable, "train.py"], num_processes=2,
                    devices_per_process=4)

  Args:
    argv: the command every process runs; it calls `initialize_distributed`.
    num_processes: how many processes.
    devices_per_process: CPU devices each one exposes.
    grace_seconds: how long survivors may take to stop after a failure.
    timeout: terminate everything after this many seconds (None: no limit).
    **kwargs: passed to `start_local_processes` (``peer_timeout_seconds``,
      ``env``, ``log_dir``, ``Popen`` options).

  Returns:
    0 if every process succeeded, else the exit status of the process that
    failed first (128 + signal number for a signal): the first to end with a
    status other than `LOST_PEER_EXIT_CODE`, if any.
  """
  procs = start_local_processes(argv, num_processes=num_processes,
                                devices_per_process=devices_per_process, **kwargs)
  ended = []
  restore = _forward_sigterm(procs)
  try:
    ended = _wait_for(procs, grace_seconds, timeout)
  finally:
    restore()
    for p in procs:
      if p.poll() is None:
        p.terminate()
    for p in procs:
      try:
        p.wait(5)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
  failures = [(i, c) for i, c in ended if c != 0]
  terminated = [(i, p.returncode) for i, p in enumerate(procs) if all(i != j for j, _ in ended)]
  if not failures and not terminated:
    return 0
  first, code = _root_cause(failures or terminated)
  summary = ", ".join(f"process {i} {_describe(p.returncode)}" +
                      (" (terminated by launch_local)" if (i, p.returncode) in terminated else "")
                      for i, p in enumerate(procs))
  print(f"zero_jax.launch_local: process {first} failed first ({_describe(code)}); all: "
        f"{summary}.", file=sys.stderr, flush=True)
  return 128 - code if code < 0 else code
