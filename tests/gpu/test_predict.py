"""The overlap model on XLA:GPU's schedule: what the windows hold decides what is exposed."""

import pytest

from zero_jax import gpu
from zero_jax.comm import hlo
from zero_jax.gpu import predict

from test_schedule import LIMIT, lowered  # pylint: disable=import-error


def test_a_device_from_a_target_has_the_targets_figures():
  d = predict.device_from_target(gpu.A100, devices_per_host=4)
  assert (d.peak_flops, d.hbm_bandwidth, d.intra.bandwidth, d.cross.bandwidth) == (
      gpu.A100.peak_flops, gpu.A100.hbm_bandwidth, gpu.A100.intra_bandwidth,
      gpu.A100.cross_bandwidth) and d.devices_per_host == 4
  assert predict.H100_SXM.peak_flops == gpu.H100.peak_flops


@pytest.mark.parametrize("name", ["one host"])
def test_the_default_compile_hides_what_a_limit_of_one_leaves_exposed(name):
  low = lowered(name)
  device = predict.H100_SXM
  ours = predict.predict_scheduled(low.compile().as_text(), device)
  xla_default = predict.predict_scheduled(
      low.compile(compiler_options={LIMIT: 1}).as_text(), device)
  loops = lambda p: [l for l in p if l.name != "ENTRY" and l.windows]
  for loop in loops(ours):  # every window holds compute, so each costs less than its ring
    assert all(w.compute > 0 and w.exposed < w.comm for w in loop.windows), loop
  bwd = lambda p: max(loops(p), key=lambda l: len(l.windows))
  assert any(w.compute == 0 and w.exposed == w.comm > 0 for w in bwd(xla_default).windows)
  # In flight together, two collectives share the link and the matmuls of their windows: they
  # hide no more than one beside an empty window does when the matmuls are shorter than
  # either (equal here), never less. (Before, each hid behind the whole of the same matmul,
  # which flattered the program that overlaps more: strictly less was asserted.)
  assert sum(l.exposed for l in ours) <= sum(l.exposed for l in xla_default) * (1 + 1e-12)


def test_a_layer_loop_inside_the_micro_batch_loop_counts_once_per_micro_batch():
  # Before: a nested loop's figure counted its own trips only, so with 4 micro-batches the
  # layer loops' exposed time per step was a quarter of what the program does.
  import jax, jax.numpy as jnp, optax  # pylint: disable=import-outside-toplevel,multiple-imports
  import zero_jax as zj  # pylint: disable=import-outside-toplevel
  from test_schedule import LAYERS, WIDTH, loss_fn  # pylint: disable=import-error
  mesh = zj.compile_only_mesh((8,), ("data",))
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), mesh=mesh, stage=3,
                                    stacked=True, precision="bf16", grad_accum_steps=4)
  params = {"layers": {k: jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32)
                       for k in ("up", "down")}}
  text = step.lower(step.abstract_state(params), jax.ShapeDtypeStruct(
      (4 * 16 * 8, WIDTH), jnp.float32)).compile().as_text()
  loops = predict.predict_scheduled(text, predict.H100_SXM)[1:]  # [0]: outside the loops
  comps = hlo._computations(text)  # pylint: disable=protected-access
  micro = [l for l in loops if any(" while(" in line for line in comps[l.name])]
  layer = [l for l in loops if l not in micro and l.windows]
  assert len(micro) == 1 and micro[0].runs == 1
  # XLA peels the first micro-batch out of the loop: its layer loops run once, the others
  # once per iteration of the micro-batch loop; a forward and a backward per micro-batch.
  assert sum(l.runs for l in layer) == 2 * 4, [(l.name, l.trips, l.runs) for l in loops]
  assert all(l.step_exposed == l.runs * l.exposed for l in layer)


def test_an_async_collective_counts_the_bytes_it_returns_not_its_operands_too():
  # Before: a GPU program's all-gather-start / reduce-scatter-start is typed (operands,
  # results), and analyze counted both: a reduce-scatter 9x its result, times (n-1) on the
  # wire, so the planner's bytes sent and step times overcounted communication.
  from test_schedule import LAYERS, WIDTH  # pylint: disable=import-error
  low = lowered("one host")
  moved = {}
  for kind, text in (("lowered", low.as_text(dialect="hlo")), ("gpu", low.compile().as_text())):
    program = predict.analyze(text)

    def total(loop, op):
      return loop.trips * (sum(t.nbytes for t in loop.transfers if t.op == op)
                           + sum(total(l, op) for l in loop.loops))
    moved[kind] = {op: total(program, op) for op in ("all-gather", "reduce-scatter")}
  assert moved["gpu"] == moved["lowered"]
  layer = 2 * WIDTH * WIDTH * 2   # up and down, bf16
  assert moved["gpu"]["reduce-scatter"] == LAYERS * layer / 8
