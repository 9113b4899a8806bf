"""Multi-process training: start-up, host metrics and a peer watchdog.

Every process runs the same script and owns some of the mesh's devices; the step, ``init``,
``get_params`` and checkpoints work unchanged. `initialize_distributed` starts
``jax.distributed`` (gloo collectives on CPU) and a watchdog that makes every survivor exit
with `LOST_PEER_EXIT_CODE`, naming the process, when a peer dies or raises, instead of
hanging in a collective; `metrics_to_host`, `is_main_process` and `print_main` are the host
side. The batch helpers are in `zero_jax.processes.global_batch`, the local launcher in
`zero_jax.processes.launch`; the docs' multi-process guide explains the rest.

Example (each process runs this):
  import jax, optax, zero_jax as zj
  zj.initialize_distributed()       # before any other JAX call
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), mesh=mesh)
  state = step.init(params)         # the same params on every process
  rows = zj.process_batch_slice(global_batch_size, mesh)
  for global_np_batch in loader:
    local = jax.tree.map(lambda x: x[rows], global_np_batch)
    state, metrics = step(state, zj.make_global_batch(local, mesh))
    zj.print_main(zj.metrics_to_host(metrics))
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any

import jax
import numpy as np

from zero_jax import _compat

LOST_PEER_EXIT_CODE = 3
"""Exit status of a process that stops because a peer process was lost."""
FAILED_PEER_GRACE_S = 10.0
"""How long survivors wait, after a peer announced an uncaught exception, for a
lost peer (the likelier cause) to show up before they stop. Below gloo's 30 s
read timeout, so that a survivor blocked in a collective with the failed peer
is stopped by the watchdog (naming the peer, `LOST_PEER_EXIT_CODE`) first."""

# Environment variables set by `launch_local` and read by `initialize_distributed`.
ENV_COORDINATOR = "ZERO_JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "ZERO_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZERO_JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "ZERO_JAX_LOCAL_DEVICE_COUNT"
ENV_PEER_TIMEOUT = "ZERO_JAX_PEER_TIMEOUT"

_KV_PREFIX = "zero_jax/watchdog/"
_watchdog: "_PeerWatchdog | None" = None


# ------------------------------------------------------------------ start-up
def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None, *,
                           local_device_count: int | None = None,
                           cpu_collectives: str = "gloo",
                           peer_timeout_seconds: float | None = 60.0,
                           **jax_kwargs) -> None:
  """Joins this process to a multi-process JAX job and starts the peer watchdog.

  Call it first, before any other JAX call. Arguments left as ``None`` are
  read from the variables `launch_local` sets (``ZERO_JAX_*``), and otherwise
  detected by ``jax.distributed.initialize`` from the cluster environment
  (SLURM, Open MPI, Kubernetes, Cloud TPU; see its documentation); if none of
  these gives the job's processes it raises ``ValueError`` rather than run
  each process alone. ``num_processes=1`` makes it a no-op apart from
  ``local_device_count``, so one script serves both cases.

  Example:
    import zero_jax as zj
    zj.initialize_distributed()                 # SLURM: srun python train.py
    zj.initialize_distributed("10.0.0.1:1234", 2, 0)   # explicit, process 0

  Args:
    coordinator_address: ``"host:port"`` of process 0 (the coordination service).
    num_processes: number of processes in the job.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    local_device_count: number of CPU devices this process exposes (the
      ``jax_num_cpu_devices`` option); ignored by GPU and TPU backends.
    cpu_collectives: cross-process collectives on CPU: ``"gloo"`` or ``"mpi"``.
    peer_timeout_seconds: a peer whose heartbeat is silent this long is lost
      and this process exits with `LOST_PEER_EXIT_CODE` (a peer that raised is
      reported after ``min(peer_timeout_seconds, FAILED_PEER_GRACE_S)``);
      ``None`` disables the watchdog (JAX's own heartbeat still ends the job
      after ``heartbeat_timeout_seconds``). Choose it above the longest pause
      of a healthy process's Python threads (not of its computation: the
      heartbeat runs in a thread).
    **jax_kwargs: passed to ``jax.distributed.initialize`` (for example
      ``initialization_timeout``, ``local_device_ids``,
      ``heartbeat_timeout_seconds``; the latter defaults to
      ``2 * peer_timeout_seconds + 10`` so that the watchdog, whose message
      names the lost peer, speaks first).
  """
  global _watchdog
  env = os.environ
  if coordinator_address is None and env.get(ENV_COORDINATOR):
    coordinator_address = env[ENV_COORDINATOR]
  if num_processes is None and env.get(ENV_NUM_PROCESSES):
    num_processes = int(env[ENV_NUM_PROCESSES])
  if process_id is None and env.get(ENV_PROCESS_ID):
    process_id = int(env[ENV_PROCESS_ID])
  if local_device_count is None and env.get(ENV_LOCAL_DEVICES):
    local_device_count = int(env[ENV_LOCAL_DEVICES])
  if env.get(ENV_PEER_TIMEOUT):
    peer_timeout_seconds = float(env[ENV_PEER_TIMEOUT])
  if local_device_count is not None:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if num_processes == 1:
    return
  if peer_timeout_seconds is not None:
    if not peer_timeout_seconds > 0:
      raise ValueError(f"peer_timeout_seconds must be positive or None, got "
                       f"{peer_timeout_seconds!r}.")
    jax_kwargs.setdefault("heartbeat_timeout_seconds", int(2 * peer_timeout_seconds) + 10)
  try:
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **jax_kwargs)
  except ValueError as e:
    if coordinator_address is None and num_processes is None:
      raise ValueError(
          f"initialize_distributed could not find the job's processes ({e}). Pass "
          f"coordinator_address, num_processes and process_id, start the script with "
          f"launch_local (python examples/launch_local.py -n 2 script.py), or run it "
          f"under a cluster manager that jax.distributed.initialize detects (SLURM: "
          f"srun, Open MPI: mpirun).") from e
    raise
  if jax.process_count() > 1 and peer_timeout_seconds is not None and _watchdog is None:
    _watchdog = _PeerWatchdog(_coordination_client(), jax.process_index(), jax.process_count(),
                              float(peer_timeout_seconds))
    _watchdog.start()


def _coordination_client():
  """The ``jax.distributed`` key-value client (`zero_jax._compat`)."""
  return _compat.coordination_client()


# ------------------------------------------------------------------ host side
def is_main_process() -> bool:
  """Whether this is process 0, the one that prints progress and writes logs.

  Example:
    if zj.is_main_process():
      writer.write(step, zj.metrics_to_host(metrics))
  """
  return jax.process_index() == 0


def print_main(*args, **kwargs) -> None:
  """``print`` on the main process only (flushed); a no-op on the others.

  Example:
    zj.print_main(f"step {i}: loss {m['loss']:.4f}")
  """
  if is_main_process():
    kwargs.setdefault("flush", True)
    print(*args, **kwargs)


def metrics_to_host(metrics) -> Any:
  """The step's metrics as ordinary Python values, on every process.

  Scalars become Python ``float``, ``int`` or ``bool``; other arrays become
  numpy arrays. Call it on every process (it waits for the step; for an
  array that is not replicated it gathers across processes, a collective).

  Example:
    state, metrics = step(state, batch)
    m = zj.metrics_to_host(metrics)  # {'loss': 2.3, 'grads_finite': True, ...}
    zj.print_main(f"loss {m['loss']:.4f}")

  Args:
    metrics: a pytree of arrays, usually the dict returned by the step.

  Returns:
    The same tree with host values.
  """
  def to_host(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      x = multihost_utils.process_allgather(x, tiled=True)
    x = np.asarray(x)
    return x.item() if x.ndim == 0 else x
  return jax.tree.map(to_host, metrics)


def all_processes_agree(ok: bool) -> bool:
  """Whether ``ok`` holds on every process of the job (a collective where there are several)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))


# ------------------------------------------------------------------ preemption
def is_multi_process() -> bool:
  """Whether this process is one of several in a ``jax.distributed`` job.

  Unlike ``jax.process_count()``, starts no backend when ``jax.distributed``
  was not initialized (so it may be called before `initialize_distributed`).
  """
  return jax.distributed.is_initialized() and jax.process_count() > 1


def preemption_sync_point(check: int) -> bool:
  """Whether every process stops at its ``check``-th call (JAX's preemption sync point).

  When any process has a notice, JAX's sync manager gathers every process's
  latest ``check`` in background threads and picks the largest plus one.
  """
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  try:
    return multihost_utils.reached_preemption_sync_point(check)
  except RuntimeError as e:  # the service is off
    raise RuntimeError(
        f"reached_preemption needs JAX's preemption service in a multi-process job ({e}). "
        f"Leave jax_enable_preemption_service at its default (True) when calling "
        f"zj.initialize_distributed().") from e


def publish_preemption_notice() -> None:
  """Tells every process's sync manager of a notice, as JAX's SIGTERM handler does.

  Quietly does nothing if the service refuses (a notice was published already,
  or the coordinator is gone: the watchdog reports that).
  """
  import datetime  # pylint: disable=g-import-not-at-top
  now = datetime.datetime.now(datetime.timezone.utc).isoformat()
  try:
    _coordination_client().key_value_set(_compat.preemption_notice_key(), now)
  except Exception:  # pylint: disable=broad-except
    pass


# ------------------------------------------------------------------ the watchdog
class _PeerWatchdog:
  """Heartbeats through the coordination service; exits when a peer is lost.

  A daemon thread sets ``zero_jax/watchdog/hb/<i>`` to an increasing counter
  every ``interval`` seconds and reads all peers' keys. A peer whose counter
  has not changed for ``timeout`` seconds (measured on this host's clock),
  and that has not announced its exit, is lost. A peer that announced a
  failure (an uncaught exception) is reported after `FAILED_PEER_GRACE_S`
  (or ``timeout``, if shorter), unless a lost peer is found meanwhile (which
  is then the likelier cause). Either way the process prints the verdict,
  announces that it stops, and leaves with `LOST_PEER_EXIT_CODE` through
  ``os._exit``, since a thread blocked in a collective cannot be interrupted.

  The order of the timeouts matters: a survivor blocked in a collective with a
  failed peer also gets an error from the collective itself (gloo gives up
  reading after 30 s, XLA's CPU collectives do not let us change that); the
  grace is shorter, so that the watchdog speaks first. Should the survivor's
  own error come first all the same, its exception hook sees that a peer had
  already failed, and reports that peer and exits the same way.
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout: float):
    self.client = client
    self.me = process_id
    self.n = num_processes
    self.timeout = timeout
    self.interval = min(max(timeout / 10, 0.2), 5.0)
    self.grace = min(timeout, FAILED_PEER_GRACE_S)
    self.peers = [i for i in range(num_processes) if i != process_id]
    self.failure: str | None = None  # this process's uncaught exception, if any
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="zero_jax-peer-watchdog",
                                    daemon=True)
    self._info: dict[int, str] = {}
    self._status: dict[int, str] = {}  # peer -> "ok", "error: ..." or "stopped: ..."
    self._leaving = threading.Lock()
    self._left = False

  def start(self):
    self.client.key_value_set(f"{_KV_PREFIX}info/{self.me}",
                              f"host {socket.gethostname()}, pid {os.getpid()}",
                              allow_overwrite=True)
    self._previous_hook = sys.excepthook
    sys.excepthook = self._excepthook
    atexit.register(self._at_exit)
    self._thread.start()

  def _name(self, i: int) -> str:
    info = self._info.get(i)
    return f"process {i} of {self.n}" + (f" ({info})" if info else "")

  def _die(self, code: int, message: str):
    with self._leaving:  # one verdict: the thread's or the exception hook's, not both
      first, self._left = not self._left, True
    if not first:
      time.sleep(3600)  # the other one is exiting the process
    self._publish("exit", "stopped: " + message[:300])  # so that a failed peer stops waiting
    try:
      sys.stdout.flush()
    except Exception:  # pylint: disable=broad-except
      pass
    os.write(2, (f"\nzero_jax: {message}\n").encode())
    if self.me == 0:
      self._let_failed_peers_leave()
    os._exit(code)  # pylint: disable=protected-access

  def _let_failed_peers_leave(self, wait: float = 2.0):
    """Process 0 hosts the coordination service, whose end aborts every other
    process (SIGABRT): give the peers that failed a moment to exit with their
    own status first (they leave as soon as they see that this one stops)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
      self._read_statuses()
      try:
        gone = {int(k.rpartition("/")[2]) for k, _ in
                self.client.key_value_dir_get(f"{_KV_PREFIX}gone/")}
      except Exception:  # pylint: disable=broad-except
        return
      if set(self._failed()) <= gone:
        return
      time.sleep(0.1)

  def _failed(self) -> list[int]:
    """Peers that announced an uncaught exception."""
    return [i for i in self.peers if self._status.get(i, "").startswith("error: ")]

  def _failures(self, failed: list[int]) -> str:
    return "; ".join(f"{self._name(i)} failed with {self._status[i][7:]}" for i in failed)

  def _read_statuses(self) -> None:
    """Reads the peers' announcements now (the thread reads them every interval)."""
    try:
      for key, value in self.client.key_value_dir_get(_KV_PREFIX):
        what, _, idx = key[len(_KV_PREFIX):].rpartition("/")
        if what == "info":
          self._info[int(idx)] = value
        elif what == "exit" and int(idx) != self.me:
          self._status[int(idx)] = value
    except Exception:  # pylint: disable=broad-except
      pass  # the coordinator is gone; the thread reports that

  def _excepthook(self, kind, value, tb):
    if self._left:  # the watchdog is stopping the process: this error follows from that
      self._die(LOST_PEER_EXIT_CODE, "")
    own = "".join(traceback.format_exception_only(kind, value)).strip()
    self._read_statuses()
    failed = self._failed()
    if failed:  # a peer failed first: this error (a collective's, likely) follows from it
      self._previous_hook(kind, value, tb)
      first = own.splitlines()[0][:300] if own else kind.__name__
      self._die(LOST_PEER_EXIT_CODE,
                f"lost peer {self._failures(failed)}. Process {self.me} stopped with an error "
                f"that followed ({first}) and exits with code {LOST_PEER_EXIT_CODE}; restart "
                f"the job (from the last checkpoint).")
    self.failure = own
    self._publish("exit", "error: " + own[:500])
    self._previous_hook(kind, value, tb)

  def _publish(self, what: str, value: str):
    try:
      self.client.key_value_set(f"{_KV_PREFIX}{what}/{self.me}", value, allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass  # the coordinator is gone; the thread reports that

  def _at_exit(self):
    if self.failure is None:  # a normal exit: tell the peers, stop watching
      self._publish("exit", "ok")
      self._stop.set()
      return
    # This process failed. Peers blocked in a collective with it may never reach
    # JAX's shutdown barrier, so wait (the thread may find a lost peer and exit)
    # until every peer is also leaving, or give up after the timeout; then leave
    # with the status of an uncaught exception, without that barrier.
    deadline = time.monotonic() + self.timeout + 2 * self.interval
    while time.monotonic() < deadline:
      self._read_statuses()
      if all(i in self._status for i in self.peers):
        self._publish("gone", "1")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # pylint: disable=protected-access
      time.sleep(0.2)
    self._die(1, f"process {self.me} of {self.n} failed ({self.failure}); its peers did not "
                 f"stop within {self.timeout:g} s, so it exits without waiting for them.")

  def _run(self):
    start = time.monotonic()
    seen = {i: (None, start) for i in self.peers}  # peer -> (counter, when it last changed)
    last_contact = start
    failed_since: float | None = None
    counter = 0
    while not self._stop.wait(self.interval):
      now = time.monotonic()
      counter += 1
      try:
        self.client.key_value_set(f"{_KV_PREFIX}hb/{self.me}", str(counter), allow_overwrite=True)
        entries = self.client.key_value_dir_get(_KV_PREFIX)
        last_contact = now
      except Exception as e:  # pylint: disable=broad-except
        if not jax.distributed.is_initialized():  # jax.distributed.shutdown() was called
          return
        if now - last_contact > self.timeout:
          self._die(LOST_PEER_EXIT_CODE,
                    f"lost the coordinator, process 0 of {self.n}: no answer from the JAX "
                    f"coordination service for {now - last_contact:.1f} s ({e}). Process "
                    f"{self.me} exits with code {LOST_PEER_EXIT_CODE}.")
        continue
      for key, value in entries:
        what, _, idx = key[len(_KV_PREFIX):].rpartition("/")
        i = int(idx)
        if what == "info":
          self._info[i] = value
        elif what == "exit" and i != self.me:
          self._status[i] = value
        elif what == "hb" and i in seen and seen[i][0] != value:
          seen[i] = (value, now)
      if self._stop.is_set():
        return
      lost = [i for i in self.peers
              if i not in self._status and now - seen[i][1] > self.timeout]
      failed = self._failed()
      if lost:
        names = ", ".join(f"{self._name(i)}: no heartbeat for {now - seen[i][1]:.1f} s"
                          for i in lost)
        also = f"; {self._failures(failed)}" if failed else ""
        self._die(LOST_PEER_EXIT_CODE,
                  f"lost peer {names} (peer_timeout_seconds={self.timeout:g}){also}. Process "
                  f"{self.me} exits with code {LOST_PEER_EXIT_CODE} instead of waiting for it "
                  f"in a collective; restart the job (from the last checkpoint).")
      if failed and failed_since is None:
        failed_since = now
      if failed and now - failed_since > self.grace:
        silent = [f"{self._name(i)} (no heartbeat for {now - seen[i][1]:.1f} s)"
                  for i in self.peers if i not in self._status
                  and now - seen[i][1] > 3 * self.interval]
        also = f"; silent meanwhile: {', '.join(silent)}" if silent else ""
        self._die(LOST_PEER_EXIT_CODE,
                  f"lost peer {self._failures(failed)}{also}. Process {self.me} exits with "
                  f"code {LOST_PEER_EXIT_CODE} instead of waiting for it in a collective; "
                  f"restart the job (from the last checkpoint).")
