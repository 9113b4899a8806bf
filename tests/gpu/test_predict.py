"""The overlap model on XLA:GPU's schedule: what the windows hold decides what is exposed."""

import pytest

from zero_jax import gpu
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
  assert sum(l.exposed for l in ours) < sum(l.exposed for l in xla_default)
