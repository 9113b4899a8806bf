"""Preemption: a signal to any process stops every process at the same step, saved.

Spot machines, SLURM time limits and Kubernetes evictions end a job with a signal (SIGTERM)
to one or more of its processes and a short grace period. `watch_preemption` makes chosen
signals a *notice* instead of a kill; `CheckpointManager.reached_preemption(state)`, called by
every process once per step, returns False until the notice has reached every process, then
True at the same call on all of them, after saving that step and waiting for the write.

How the processes agree on the step:

- Several processes: JAX's preemption sync point
  (``jax.experimental.multihost_utils.reached_preemption_sync_point``).
  ``jax.distributed.initialize`` starts a sync manager whose C++ handler catches SIGTERM
  (in any thread, even during a compilation) and tells the coordination service; background
  threads on every process then publish how many checks their process has made and all
  stop at the check after the largest count. JAX's manager listens to SIGTERM only: for the
  other signals watched, a Python handler publishes the same notice.
- One process: a Python handler records the notice, and the next check stops.

The handlers only record: a second signal during the save interrupts nothing (the
checkpoint is complete or absent, as always), and the save is waited for before
``reached_preemption`` returns.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from typing import Iterable

import numpy as np

from zero_jax.processes import distributed
from zero_jax.step.state import TrainState


@dataclasses.dataclass(frozen=True)
class Preemption:
  """Where a job stopped for a preemption notice (`CheckpointManager.preemption`).

  Attributes:
    step: the step of the state at which every process stopped.
    saved: whether a checkpoint of ``step`` is on disk (written at the notice,
      or already there); False when no step had been taken (``step`` is 0).
    directory: the checkpoint directory.
  """
  step: int
  saved: bool
  directory: str

  def __str__(self) -> str:
    if not self.saved:
      return (f"preempted before the first step (step {self.step}): nothing to save in "
              f"{self.directory}")
    return f"preempted: every process stopped at step {self.step}, saved in {self.directory}"


class _Watch:
  """The process's notice: which signals are watched, what arrived, how many checks ran."""

  def __init__(self):
    self.replaced: dict[int, object] = {}  # signal -> the handler ours replaced
    self.notice: str | None = None          # name of the first signal received here
    self.published = False                  # the notice was offered to the other processes
    self.checker = None                     # the manager whose reached_preemption runs
    self.checks = 0                         # calls of reached_preemption so far
    self.stopped: Preemption | None = None
    self.asked = False                      # watch_preemption was called: it lasts


_watch = _Watch()


def _say(text: str) -> None:
  """One line on stderr, safe inside a signal handler (no buffered ``print``)."""
  os.write(2, f"zero_jax: {text}\n".encode())


def _on_signal(signum, frame) -> None:  # pylint: disable=unused-argument
  name = signal.Signals(signum).name
  if _watch.notice is not None:
    _say(f"{name} again: the processes are already stopping at the step they agree on; "
         f"the save is not interrupted and the checkpoint will be complete or absent.")
    return
  _watch.notice = name
  _say(f"{name} received: a preemption notice. Every process stops at the next step all of "
       f"them reach, saves it and ends (CheckpointManager.reached_preemption).")
  if distributed.is_multi_process():
    _publish()


def _publish() -> None:
  """Offers the notice to every process once (refused when a peer's came first: fine)."""
  _watch.published = True
  distributed.publish_preemption_notice()


_FORMS = (f"a signal.Signals member (signal.SIGUSR1), its number ({int(signal.SIGUSR1)}), "
          f"its name ('SIGUSR1' or 'USR1', any case), or a list of these")


def _as_signal(s) -> signal.Signals:
  """``s`` (a `signal.Signals`, a number or a name with or without ``SIG``) as a signal."""
  if isinstance(s, str):
    name = s.strip().upper()
    name = name if name.startswith("SIG") else "SIG" + name
    if name not in signal.Signals.__members__:
      raise ValueError(f"watch_preemption: {s!r} is not a signal name of this platform; pass "
                       f"{_FORMS}: e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT.")
    sig = signal.Signals[name]
  elif isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)):
    raise TypeError(f"watch_preemption: {s!r} ({type(s).__name__}) is not a signal; pass "
                    f"{_FORMS}.")
  else:
    try:
      sig = signal.Signals(int(s))
    except ValueError:
      raise ValueError(f"watch_preemption: {s!r} is not a signal of this platform; pass "
                       f"{_FORMS}.") from None
  if sig in (signal.SIGKILL, signal.SIGSTOP):
    raise ValueError(f"watch_preemption: {sig.name} cannot be caught; a preemption notice is "
                     f"a signal such as SIGTERM, SIGUSR1 or SIGINT.")
  return sig


def _as_signals(signals) -> list[signal.Signals]:
  """The signals of ``watch_preemption(signals)``: one signal, or an iterable of them."""
  if isinstance(signals, (str, int, np.integer)):
    return [_as_signal(signals)]
  try:
    given = list(signals)
  except TypeError:
    raise TypeError(f"watch_preemption: signals={signals!r} ({type(signals).__name__}) is "
                    f"not a signal; pass {_FORMS}.") from None
  if not given:
    raise ValueError(f"watch_preemption: signals= is empty; pass {_FORMS} (default: SIGTERM).")
  return [_as_signal(s) for s in given]


def watch_preemption(signals: int | str | Iterable[int | str] = (signal.SIGTERM,)) -> None:
  """From now on, ``signals`` are a preemption notice instead of a kill.

  A notice on any process makes `CheckpointManager.reached_preemption` return
  True on every process at the same step, once that step is saved. Call this
  early (after `initialize_distributed`, before restoring and compiling), so
  that a notice during start-up is caught too; ``reached_preemption`` calls it
  with the default at its first call otherwise. A watch started here lasts until
  the process exits (each later manager checks it); one that
  ``reached_preemption`` started ends when its manager is closed in the main
  thread (the previous handlers are back). Once a manager has stopped the job,
  further notices are only reported until the process exits, so that a repeated
  one cannot turn the clean exit into a kill, and another manager's
  ``reached_preemption`` raises.

  In a multi-process job JAX itself treats SIGTERM as a notice from
  ``jax.distributed.initialize`` on (its handler is kept); other signals get a
  Python handler that tells every process, as JAX's does. Call it from the main
  thread (Python runs signal handlers there).

  Example:
    >>> import os, signal, tempfile, jax, jax.numpy as jnp, optax, zero_jax as zj
    >>> zj.watch_preemption([signal.SIGUSR1])  # e.g. SLURM's --signal=USR1@120
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh)
    >>> state = step.init({"w": jnp.ones((3, 1))})
    >>> with zj.CheckpointManager(tempfile.mkdtemp()) as mngr:
    ...   for i in range(1000):
    ...     if mngr.reached_preemption(state):   # every process, every step
    ...       break
    ...     state, metrics = step(state, {"x": jnp.ones((8, 3))})
    ...     if i == 2:
    ...       os.kill(os.getpid(), signal.SIGUSR1)  # as a scheduler would
    >>> mngr.preemption.step, mngr.preemption.saved
    (3, True)

  Args:
    signals: the signal, or signals, that give notice (default: SIGTERM, what
      SLURM and Kubernetes send): `signal.Signals` members, numbers or names
      (``"SIGUSR1"``, or ``"USR1"`` as SLURM's ``--signal=USR1@120`` writes it).

  Raises:
    ValueError: a signal cannot be caught (SIGKILL, SIGSTOP) or does not exist.
    TypeError: a signal is neither a number nor a name.
    RuntimeError: called from another thread than the main thread.
  """
  sigs = _as_signals(signals)
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("watch_preemption (and the first reached_preemption) must run in the "
                       "main thread, where Python delivers signals; call "
                       "zj.watch_preemption() there before starting the training thread.")
  _install(sigs)
  _watch.asked = True


def _install(sigs) -> None:
  jax_has_sigterm = distributed.is_multi_process()
  for sig in sigs:
    if sig in _watch.replaced or (sig == signal.SIGTERM and jax_has_sigterm):
      continue
    _watch.replaced[sig] = signal.signal(sig, _on_signal)


def reached(mngr, state: TrainState) -> bool:
  """`CheckpointManager.reached_preemption` (see there)."""
  if not isinstance(state, TrainState):
    raise TypeError(f"reached_preemption needs the TrainState returned by step.init or "
                    f"step(...), got {type(state).__name__}.")
  if _watch.stopped is not None:  # every later call: the job has stopped
    if mngr is not _watch.checker:
      raise RuntimeError(f"this process already stopped for preemption at step "
                         f"{_watch.stopped.step} ({_watch.stopped.directory}); it should "
                         f"exit, not train on with another CheckpointManager.")
    return True
  if _watch.checker is None:
    if not _watch.replaced:
      if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the first reached_preemption runs in a thread other than the "
                           "main thread, where Python delivers signals: call "
                           "zj.watch_preemption() in the main thread before starting the "
                           "training thread.")
      _install([signal.SIGTERM])
    _watch.checker = mngr
  _watch.checks += 1
  if distributed.is_multi_process():
    if _watch.notice is not None and not _watch.published:  # noticed before initialize
      _publish()
    agreed = distributed.preemption_sync_point(_watch.checks)
  else:
    agreed = _watch.notice is not None
  if not agreed:
    return False
  step = int(state.step)
  if step > 0:
    mngr.save(state)  # False when an intact checkpoint of this step is there already
  mngr.wait_until_finished()
  _watch.stopped = mngr.preemption = Preemption(step, step > 0, os.fspath(mngr.directory))
  return True


def release(mngr) -> None:
  """Stops watching if ``mngr`` is the manager that checked (its ``close``), unless it
  stopped the job: then the process is about to exit, and a repeated notice must not
  turn that clean exit into a kill."""
  global _watch
  if _watch.checker is not mngr or _watch.stopped is not None:
    return
  if _watch.notice is not None:
    _say(f"a preemption notice ({_watch.notice}) arrived after the last reached_preemption "
         f"check; {os.fspath(mngr.directory)} holds what was saved before it.")
  if _watch.asked or threading.current_thread() is not threading.main_thread():
    _watch.checker = None  # the watch the user started lasts; the next manager checks it
    return
  for sig, previous in _watch.replaced.items():
    signal.signal(sig, previous)
  checks, _watch = _watch.checks, _Watch()
  _watch.checks = checks  # JAX's sync manager wants a count that never goes back
