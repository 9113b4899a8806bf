"""`zero_jax.gpu.timeline` on compiled programs for 2 hosts of 8 compile-only H100s (the tiny
GPT-2-like model of tests/gpu/test_regime.py): its kernels are `predict`'s compute, and its
step is never below the windows' bound of `predict_scheduled`; above it where collectives on
two links wait at different points (hybrid sharding, hpZ), equal where they do not."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_regime  # noqa: E402  pylint: disable=wrong-import-position
from test_regime import CFG, HOSTS  # noqa: E402  pylint: disable=wrong-import-position
from zero_jax.gpu import measure, predict, timeline  # noqa: E402  pylint: disable=wrong-import-position

DEVICE = measure.device_for(bench_regime.network(100), 8, "bf16")


@pytest.fixture(scope="module")
def walked():
  """Per system: (the walk, the windows' bound: compute + what `predict_scheduled` exposes,
  `predict`'s compute)."""
  out = {}
  for system in ("hybrid", "hpZ", "flat", "FSDP flat"):
    text = bench_regime.lower(CFG, HOSTS, 1, system).compile(
        compiler_options=measure.FAST_COMPILE).as_text()
    compute = predict.predict(predict.analyze(text), DEVICE).compute
    bound = compute + sum(l.step_exposed for l in predict.predict_scheduled(text, DEVICE))
    out[system] = (timeline.simulate(text, DEVICE), bound, compute)
  return out


@pytest.mark.parametrize("system", ["hybrid", "hpZ", "flat", "FSDP flat"])
def test_the_walks_kernels_are_predicts_compute(walked, system):
  walk, _, compute = walked[system]
  assert walk.compute == pytest.approx(compute, rel=1e-9)


@pytest.mark.parametrize("system", ["hybrid", "hpZ"])
def test_waits_on_two_links_make_the_walk_longer_than_the_windows_bound(walked, system):
  # hybrid's backward loop keeps the reduce-scatter within the host and the all-reduce across
  # hosts in flight together (hpZ: its two reduce-scatters, with two layers an iteration), and
  # the stream waits for them at different points: 9.8% and 7.7% here.
  walk, bound, _ = walked[system]
  assert walk.step > 1.05 * bound


@pytest.mark.parametrize("system", ["flat", "FSDP flat"])
def test_without_such_waits_the_walk_is_the_windows_bound(walked, system):
  walk, bound, _ = walked[system]
  assert walk.step == pytest.approx(bound, rel=1e-9)
