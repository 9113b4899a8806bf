"""benchmarks/bench_peer.py's reading of a program: the layer loops' memory-bound bytes per
layer are the same whether XLA runs one layer an iteration or unrolls the loop by two
(``xla_gpu_enable_while_loop_double_buffering``, which NVIDIA's flags set). And the rows it
keeps and resumes from (`_peer_common`, shared with bench_regime.py)."""

import json
import pathlib
import sys

import pytest

from zero_jax.gpu.program import Loop

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import _peer_common  # noqa: E402  pylint: disable=wrong-import-position
import bench_peer  # noqa: E402  pylint: disable=wrong-import-position


def loop(name, trips, elementwise=0.0, loops=()):
  return Loop(name, trips, (), (), tuple(loops), elementwise)


def test_an_unrolled_layer_loop_counts_two_layers_an_iteration():
  # 12 layers; per layer 100 bytes forward, 200 backward. One layer an iteration: the forward
  # loop runs 11 (the last layer outside it), the backward 10.
  plain = loop("entry", 1, loops=[loop("fwd", 11, 100.0), loop("bwd", 10, 200.0)])
  # Unrolled by two: 5 iterations each, two layers' bytes an iteration (one layer peeled).
  unrolled = loop("entry", 1, loops=[loop("fwd", 5, 200.0), loop("bwd", 5, 400.0)])
  assert bench_peer.layer_loops(plain, 12) == (11 * 100 + 10 * 200, 21)
  assert bench_peer.layer_loops(unrolled, 12) == (5 * 200 + 5 * 400, 20)
  per_layer = lambda p: (lambda b, n: b / n)(*bench_peer.layer_loops(p, 12))
  assert per_layer(unrolled) == 150.0 and abs(per_layer(plain) - 150.0) < 3  # the same layer
  # a loop nested in a micro-batch loop counts once per micro-batch
  nested = loop("entry", 1, loops=[loop("micro", 4, loops=[loop("fwd", 11, 100.0)])])
  assert bench_peer.layer_loops(nested, 12) == (4 * 11 * 100, 44)


# ------------------------------------------------------------ rows kept (_peer_common)


def test_kept_rows_resume_and_a_failed_compile_is_kept_only_when_asked(tmp_path, capsys):
  # bench_peer and bench_regime resume from their results file: a row it holds is not
  # compiled again, and each row is written as soon as it comes.
  results = tmp_path / "rows.json"
  calls = []

  def compile_row(row, programs):
    calls.append(row)
    if row[0] == "bad":
      raise RuntimeError("XLA said no\nsecond line")
    _peer_common.keep_program(programs, row, f"program of {row[0]}")
    return {"peak": float(row[1])}

  said = []
  out = _peer_common.compile_kept([("a", 1), ("bad", 2), ("b", 3)], results, compile_row,
                                  lambda key, r: said.append(key), keep_errors=True)
  assert calls == [("a", 1), ("bad", 2), ("b", 3)] and said == ["a|1", "b|3"]
  assert out[("bad", "2")]["error"] == "RuntimeError: XLA said no"
  assert "bad|2" in capsys.readouterr().out  # said as FAILED
  assert out[("b", "3")]["peak"] == 3.0 and out[("b", "3")]["seconds"] >= 0
  programs = results.with_suffix(".programs")
  assert _peer_common.kept_program(programs, ("a", 1)) == "program of a"
  assert _peer_common.kept_program(programs, ("bad", 2)) is None
  # the second run compiles only the row it lacks
  again = _peer_common.compile_kept([("a", 1), ("c", 4)], results, compile_row, print)
  assert calls[3:] == [("c", 4)] and set(again) == {("a", "1"), ("bad", "2"), ("b", "3"),
                                                     ("c", "4")}
  # without keep_errors (bench_peer) a failed compile stops the run, the rows before it kept
  results.unlink()
  with pytest.raises(RuntimeError, match="XLA said no"):
    _peer_common.compile_kept([("a", 1), ("bad", 2)], results, compile_row, print)
  assert list(json.loads(results.read_text())) == ["a|1"]
