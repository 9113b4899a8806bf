"""Timing helpers of the benchmarks that set up no devices (``_step_common`` re-exports them).

Example:
  >>> times = interleave({"a": lambda: None, "b": lambda: None}, rounds=3, iters=2)
  >>> ratio_iqr(times, "a", "b")  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import jax
import numpy as np


def interleave(fns: dict[str, Callable[[], None]], *, rounds: int, iters: int) -> dict:
  """Times each ``fn`` (which must block) ``iters`` times per round, interleaved.

  Each ``fn`` is called once first, untimed (compilation, first-touch of buffers).
  Round r runs the variants in an order rotated by r, so none is always first.
  Returns ``{name: [seconds per call, one per round]}``.
  """
  for fn in fns.values():
    fn()
  names = list(fns)
  times = {k: [] for k in names}
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for k in order:
      t0 = time.perf_counter()
      for _ in range(iters):
        fns[k]()
      times[k].append((time.perf_counter() - t0) / iters)
  return times


def steppers(runs: dict, states: dict, batch) -> dict[str, Callable[[], None]]:
  """For `interleave`: ``{name: go}``, where ``go()`` runs one blocking step.

  ``runs[name](state, batch) -> (state, out)``; ``states[name]`` is replaced
  by each step's new state (the steps donate their input).
  """
  def go_for(name):
    def go():
      states[name], out = runs[name](states[name], batch)
      jax.block_until_ready((states[name], out))
    return go
  return {name: go_for(name) for name in runs}


def median_ratio(times: dict, a: str, b: str) -> float:
  """Median over rounds of time[a] / time[b] (paired by round)."""
  return statistics.median(x / y for x, y in zip(times[a], times[b]))


def spread(xs) -> str:
  """Median with the interquartile range, in ms."""
  q = np.percentile(np.array(xs) * 1e3, [25, 50, 75])
  return f"{q[1]:.1f} ({q[0]:.1f}-{q[2]:.1f})"


def ratio_iqr(times: dict, a: str, b: str) -> str:
  r = [x / y for x, y in zip(times[a], times[b])]
  q = np.percentile(r, [25, 50, 75])
  return f"{q[1]:.2f} ({q[0]:.2f}-{q[2]:.2f})"


def table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def with_cpu_time(fns: dict[str, Callable[[], None]], iters: int) -> tuple[dict, dict]:
  """``fns`` wrapped for `interleave` to also record the process's CPU time (all threads).

  Returns ``(wrapped, cpu)``; after ``interleave(wrapped, rounds=r, iters=iters)``,
  ``cpu[name]`` holds the CPU seconds per call, one per round like `interleave`'s times
  (the untimed first call dropped). CPU time counts the work, not the waits: on a loaded
  machine it moves far less than wall time.
  """
  calls: dict = {k: [] for k in fns}
  cpu: dict = {}

  def wrap(name, fn):
    def go():
      t0 = time.process_time()
      fn()
      calls[name].append(time.process_time() - t0)
      rest = calls[name][1:]
      cpu[name] = [sum(rest[i:i + iters]) / iters for i in range(0, len(rest) - iters + 1, iters)]
    return go
  return {k: wrap(k, f) for k, f in fns.items()}, cpu
