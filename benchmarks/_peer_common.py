"""What the compile-only GPU benchmarks of many rows share (``bench_peer``, ``bench_regime``).

A row (a tuple of strings and numbers: model, GPU, hosts, system, ...) is compiled once. Its
figures go into a JSON file as they come, keyed by the row joined with ``|``, so an interrupted
run resumes where it stopped (`compile_kept`); its compiled program's text is kept beside, in
``<results>.programs/<slug>.hlo.gz`` (`keep_program`), to be read again after a change to the
reader without compiling (`kept_program`).

Example:
  >>> import pathlib, tempfile
  >>> results = pathlib.Path(tempfile.mkdtemp()) / "rows.json"
  >>> def compile_row(row, programs):
  ...   keep_program(programs, row, f"HloModule {row[0]}")
  ...   return {"peak": 1.0}
  >>> out = compile_kept([("small", 8)], results, compile_row, lambda key, r: None)
  >>> out[("small", "8")]["peak"], kept_program(results.with_suffix(".programs"), ("small", 8))
  (1.0, 'HloModule small')
  >>> calls = []   # a second run compiles nothing: the row is kept
  >>> _ = compile_kept([("small", 8)], results, lambda *a: calls.append(a), print)
  >>> calls
  []
"""

from __future__ import annotations

import gzip
import json
import pathlib
import time
from typing import Callable


def slug(row) -> str:
  """The row as a file name: every character but letters and digits made ``_``."""
  return "".join(c if c.isalnum() else "_" for c in "|".join(map(str, row)))


def keep_program(programs: pathlib.Path, row, text: str) -> None:
  """Keeps the compiled program ``text`` of ``row`` in the folder ``programs`` (gzip)."""
  programs.mkdir(parents=True, exist_ok=True)
  (programs / (slug(row) + ".hlo.gz")).write_bytes(gzip.compress(text.encode()))


def kept_program(programs: pathlib.Path, row) -> str | None:
  """The program text `keep_program` kept for ``row``, or None when there is none."""
  path = programs / (slug(row) + ".hlo.gz")
  return gzip.decompress(path.read_bytes()).decode() if path.exists() else None


def compile_kept(rows, results_path: pathlib.Path, compile_row: Callable,
                 say: Callable[[str, dict], None], *, keep_errors: bool = False) -> dict:
  """Every row's figures: those ``results_path`` holds from an earlier run as they are, the
  others from ``compile_row(row, programs folder)``, each written to ``results_path`` as soon
  as it comes (with the ``seconds`` it took) and passed to ``say(key, figures)``.

  Args:
    rows: the rows to have, in the order to compile them.
    results_path: the JSON file of ``{"a|b|c": figures}``.
    compile_row: compiles a row and returns its figures (a dict).
    say: prints a row's line.
    keep_errors: a row whose compile raises is kept as ``{"error": "Type: first line"}`` (and
      said as FAILED) rather than stopping the run.

  Returns:
    ``{row as a tuple of strings: figures}`` of every row the file holds.
  """
  done = json.loads(results_path.read_text()) if results_path.exists() else {}
  programs = results_path.with_suffix(".programs")
  for row in rows:
    key = "|".join(map(str, row))
    if key in done:
      continue
    t0 = time.perf_counter()
    try:
      done[key] = {**compile_row(row, programs), "seconds": time.perf_counter() - t0}
    except Exception as e:  # pylint: disable=broad-except  (kept, said in the section)
      if not keep_errors:
        raise
      first = (str(e).splitlines() or [""])[0]
      done[key] = {"error": f"{type(e).__name__}: {first[:300]}",
                   "seconds": time.perf_counter() - t0}
    results_path.write_text(json.dumps(done, indent=1))
    if "error" in done[key]:
      print(f"{key:70s} FAILED {done[key]['error']}", flush=True)
    else:
      say(key, done[key])
  return {tuple(k.split("|")): v for k, v in done.items()}
