"""The one writer of a checkpoint directory: writable, locked, finished at exit.

Any number of managers may read a directory, one may write it: its first ``save`` checks
that the directory is writable and takes ``<directory>/.zero_jax.lock`` (an exclusive
``flock`` naming its holder, dropped by the kernel when the holder dies) on the primary
process, until ``close()``. Pending saves finish when the interpreter exits, and a failed
one is reported naming its step (`save_failed`). Object stores have no file locks. The
checkpoints guide has the details.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import socket
import sys
import uuid

from zero_jax import _compat

try:
  import fcntl
except ImportError:  # not POSIX
  fcntl = None

LOCK_NAME = ".zero_jax.lock"
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class DirectoryInUseError(RuntimeError):
  """Another `CheckpointManager` (process or object) is writing the directory."""


def abs_path(directory) -> str:
  """``directory`` as an absolute path (URLs such as ``gs://...`` as given)."""
  s = os.fspath(directory)
  return s if "://" in s else os.path.abspath(s)


def is_local(directory) -> bool:
  return "://" not in os.fspath(directory)


def _unwritable(directory: str, e: OSError) -> OSError:
  """``e`` (keeping its class, e.g. PermissionError) with a message naming ``directory``."""
  if disk_full(e):
    return OSError(errno.ENOSPC, f"the checkpoint directory {directory} is not writable: the "
                                 f"disk is full (no space left on the device). Free space or "
                                 f"choose a directory on another disk.")
  return type(e)(e.errno, f"the checkpoint directory {directory} is not writable: "
                          f"{e.strerror or e} ({e.filename or directory}). Choose a directory "
                          f"this process can create files and directories in.")


def check_directory(directory: str) -> None:
  """Raises NotADirectoryError when ``directory``, or a folder above it, is a file."""
  path = directory
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)  # the nearest that exists
  if os.path.exists(path) and not os.path.isdir(path):
    where = "is a file" if path == directory else f"is below {path}, which is a file"
    raise NotADirectoryError(errno.ENOTDIR, f"the checkpoint directory {directory} {where}, "
                                            f"not a directory. Choose another path.")


def make_directory(directory: str) -> None:
  """Creates ``directory`` (and its parents); raises an OSError naming it if it cannot."""
  check_directory(directory)
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    raise _unwritable(directory, e) from e


def writable_problem(directory: str) -> OSError | None:
  """None if a directory and a file can be created in ``directory``, else the error.

  Creating them is the only test that holds for root too (``os.access`` and
  permission bits do not: root ignores them, but not a read-only mount).
  """
  probe = os.path.join(directory, f".zero_jax-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  try:
    os.mkdir(probe)
    try:
      with open(os.path.join(probe, "f"), "wb") as f:
        f.write(b"0")
    finally:  # what was made goes, whatever failed (a full disk fails the write)
      shutil.rmtree(probe, ignore_errors=True)
  except OSError as e:
    return _unwritable(directory, e)
  return None


def check_writable(directory: str) -> None:
  """Raises an OSError naming ``directory`` unless files can be created in it."""
  error = writable_problem(directory)
  if error is not None:
    raise error


# ------------------------------------------------------------------- the lock
def _me() -> dict:
  return {"pid": os.getpid(), "host": socket.gethostname(),
          "since": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": " ".join(sys.argv)[:200]}


def _running(pid) -> bool:
  """Whether a process with this pid runs on this host."""
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (OSError, TypeError, ValueError):
    return True  # exists (owned by another user), or unknown: assume it runs
  return True


class DirectoryLock:
  """The write lock of one checkpoint directory (see the module docstring)."""

  def __init__(self, directory: str):
    self.directory = directory
    self.path = os.path.join(directory, LOCK_NAME)
    self._fd: int | None = None

  def _read_holder(self, fd: int) -> dict | None:
    try:
      os.lseek(fd, 0, os.SEEK_SET)
      holder = json.loads(os.read(fd, 4096).decode() or "null")
      return holder if isinstance(holder, dict) else None
    except (OSError, ValueError):
      return None

  def _in_use(self, holder: dict | None) -> DirectoryInUseError:
    if holder is None:
      who = "another process"
    else:
      same = holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()
      who = (f"process {holder.get('pid')} on host {holder.get('host')} (since "
             f"{holder.get('since')}: {holder.get('command')})" +
             (", that is this process: another CheckpointManager object" if same else ""))
    return DirectoryInUseError(
        f"the checkpoint directory {self.directory} is being written by {who}, which holds "
        f"{self.path}. Two managers saving into one directory would delete each other's "
        f"checkpoints (max_to_keep) and saves in progress. Close the other manager first "
        f"(mngr.close(), or leave its `with` block), or save into another directory. "
        f"Reading (restore, all_steps) needs no lock.")

  def acquire(self) -> None:
    """Takes the lock; raises DirectoryInUseError naming the holder, or OSError."""
    if self._fd is not None:
      return
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise _unwritable(self.directory, e) from e
    try:
      self._lock(fd)
      os.ftruncate(fd, 0)
      os.pwrite(fd, json.dumps(_me()).encode(), 0)
    except BaseException:
      os.close(fd)
      raise
    self._fd = fd

  def _lock(self, fd: int) -> None:
    if fcntl is not None:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
      except BlockingIOError:
        raise self._in_use(self._read_holder(fd)) from None
      except OSError as e:
        if e.errno not in _NO_FLOCK:
          raise
    holder = self._read_holder(fd)  # no flock here: the recorded holder decides
    if holder is None:
      return
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and pid != os.getpid() and not _running(pid):
      return  # stale: its process is gone
    raise self._in_use(holder)

  def release(self) -> None:
    """Gives the lock up (also done by the kernel when the process ends)."""
    if self._fd is None:
      return
    fd, self._fd = self._fd, None
    try:
      os.ftruncate(fd, 0)  # no holder named: a later writer without flock may take it
    except OSError:
      pass
    os.close(fd)  # closing the descriptor releases the flock


# ---------------------------------------------------------------- at exit
_pending: dict[int, object] = {}  # managers that saved and are not closed yet
_hook_registered = False


def disk_full(e: BaseException) -> bool:
  """Whether ``e`` (or an error it was raised from) says the disk is full: ``ENOSPC`` or
  ``EDQUOT``, or TensorStore's ``RESOURCE_EXHAUSTED`` text (``os_error_code=28``), anywhere
  in its message (TensorStore puts the reason after a long path)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    text = str(e)
    if "No space left" in text or "os_error_code='28'" in text or "Disk quota" in text:
      return True
    e = e.__cause__ or e.__context__
  return False


def save_failed(directory, step: int | None, e: BaseException) -> OSError:
  """The error a failed save is reported with: its step, why (a full disk named as such)."""
  full = disk_full(e)
  why = "the disk is full (no space left on the device)" if full else \
      f"{type(e).__name__}: {first_line(e)}"
  what = f"the checkpoint of step {step}" if step is not None else "a checkpoint"
  fix = "Free space or choose another directory" if full else "Fix the cause"
  err = OSError(errno.ENOSPC if full else getattr(e, "errno", None),
                f"saving {what} into {directory} failed: {why}. That step is not saved (its "
                f"temporary directory was removed); earlier checkpoints are intact. {fix}, "
                f"then save again.")
  return err


def first_line(e: BaseException) -> str:
  """``"KindOfError: its first line"``, for messages that quote an error."""
  lines = str(e).strip().splitlines()
  return type(e).__name__ + (": " + lines[0][:400] if lines else "")


def _finish_all() -> None:
  """Closes every pending manager; a save that fails ends the process with code 1."""
  for mngr in list(_pending.values()):
    try:
      mngr.close()
    except Exception as e:  # pylint: disable=broad-except
      sys.stdout.flush()
      os.write(2, (f"\nzero_jax: a checkpoint save into {mngr.directory} failed while the "
                   f"process was exiting: {first_line(e)}\n").encode())
      os._exit(1)  # pylint: disable=protected-access


def finish_at_exit(mngr) -> None:
  """Has ``mngr.close()`` (which waits for its saves) run when the interpreter exits.

  Python shuts ``concurrent.futures``' thread pools down, which Orbax's
  background write runs on, before it calls ``atexit`` functions; so the hook
  is one of ``threading``'s exit functions, which run before that, in the main
  thread (in reverse order of registration: after the pools' hook).
  """
  global _hook_registered
  if not _hook_registered:
    _compat.register_before_thread_pools_exit(_finish_all)
    _hook_registered = True
  _pending[id(mngr)] = mngr


def forget_at_exit(mngr) -> None:
  """Undoes `finish_at_exit` (``mngr`` was closed)."""
  _pending.pop(id(mngr), None)
