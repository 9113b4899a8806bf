"""Overlap that does not depend on the model's shape (issue 46.4c), compile-only GPUs.

The issue's case: an 8-layer MLP (width 2048, hidden 4096, gelu, residual), 512 rows per GPU,
a stage-3 bf16 step over ``zj.scan(prefetch=1)`` with the default policy, compiled for 8 A100s
(and 2 x 8 with hpZ) got its forward all-gather started after the layer's first matmul and
waited for before the second: no matmul in its window. With the step's own compiler options
(`zero_jax.step.compile_options`, as the step and ``step.jit`` compile) every collective of the
forward and backward layer loops has a matmul of another layer in its window; then a small,
representative subset of ``benchmarks/bench_overlap_sweep.py``'s grid. The 2 x 8 mesh with a
replica axis across hosts (``replica_axis``, hybrid sharding) joined the sweep after the fix:
it was not compiled on the code before it.
"""

import pathlib
import sys

import pytest

from zero_jax.gpu import schedule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_overlap_sweep as sweep  # noqa: E402  pylint: disable=wrong-import-position

ISSUE = ("residual", "none", 2048, 512)  # kind, policy, width, rows per GPU


def compiled_text(gpu, mesh, kind, policy, width, rows):
  """The step's program, compiled with its own options (what ``step`` and ``step.jit`` use)."""
  step = sweep.make_step(gpu, mesh, kind, policy)
  return step.lower(*sweep.inputs(step, width, rows, 8, mesh)).compile().as_text()


# The backward layer loop's collectives, and those of them whose groups cross hosts: the
# re-gather and a reduce-scatter per hop (hpZ: within the host, then across); with a replica
# axis (hybrid), the reduce-scatter within the host, then the all-reduce of its block across.
BACKWARD = {"1x8": ({"all-gather", "reduce-scatter"}, set()),
            "2x8": ({"all-gather", "reduce-scatter"}, {"reduce-scatter"}),
            "2x8-replica": ({"all-gather", "reduce-scatter", "all-reduce"}, {"all-reduce"})}


def check_every_window(text, mesh):
  loops = [l for l in schedule.loops(text) if l.windows]
  assert len(loops) == 2, loops  # the forward and the backward layer loop
  fwd = next(l for l in loops if all(w.op == "all-gather" for w in l.windows))
  bwd = next(l for l in loops if l is not fwd)
  # XLA may combine a layer's per-leaf collectives into one or leave some apart
  ops = [w.op for w in bwd.windows]
  crosses = lambda w: any(len({d // 8 for d in g}) > 1 for g in w.groups or [])
  assert (set(ops), {w.op for w in bwd.windows if crosses(w)}) == BACKWARD[mesh], bwd.windows
  assert not any(crosses(w) for w in fwd.windows), fwd.windows  # gathered within the host
  for loop in loops:
    for w in loop.windows:
      assert w.flops > 0, (loop.name, w.op, w.compute)


@pytest.mark.parametrize("mesh", sweep.MESHES)
def test_the_issues_a100_mlp_has_a_matmul_in_every_loop_window(mesh):
  """Before the fix (commit 02d2db9) the forward loop's gather had no matmul in its window, on
  one host and on two."""
  check_every_window(compiled_text("a100", mesh, *ISSUE), mesh)


# A subset of the sweep: each target, both layer kinds, the three policies, one host and two
# (hpZ, and a replica axis), both ends of the widths and rows; the first two had a bare window
# before the fix.
SUBSET = [("a100", "1x8", "plain", "none", 8192, 4096),
          ("h100", "1x8", "residual", "full", 512, 128),
          ("h200", "2x8", "residual", "full", 8192, 4096),
          ("a100", "2x8", "residual", "none", 512, 128),
          ("h200", "1x8", "plain", "dots", 2048, 512),
          ("h100", "2x8-replica", "residual", "dots", 4096, 1024)]


@pytest.mark.parametrize("case", SUBSET, ids=lambda c: "-".join(map(str, c)))
def test_a_sweep_subset_has_a_matmul_in_every_loop_window(case):
  check_every_window(compiled_text(*case), case[1])
