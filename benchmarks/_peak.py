"""A process's peak resident memory, measured from a point on (Linux ``/proc/self``)."""

from __future__ import annotations

import ctypes
import gc


def status(field: str) -> int:
  """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``, ...) in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def reset_peak() -> int:
  """Resets the peak resident set (``VmHWM``) to the current one; returns the current one.

  Memory that glibc keeps after earlier frees (it would be reused without
  showing in the resident set) is first handed back, so the peak counts every
  page the operation touches.
  """
  gc.collect()
  ctypes.CDLL("libc.so.6").malloc_trim(0)
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
  return status("VmRSS")
