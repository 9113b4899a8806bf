"""benchmarks/bench_peer.py's reading of a program: the layer loops' memory-bound bytes per
layer are the same whether XLA runs one layer an iteration or unrolls the loop by two
(``xla_gpu_enable_while_loop_double_buffering``, which NVIDIA's flags set)."""

import pathlib
import sys

from zero_jax.gpu.program import Loop

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
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
