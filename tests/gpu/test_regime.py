"""What the "regime" rows (benchmarks/bench_regime.py, BENCHMARKS.md "regime") rely on, pinned
on a tiny GPT-2-like model over 2 hosts of 8 compile-only H100s: zero_jax's hybrid and hpZ
steps send across hosts exactly ZeRO++'s share per GPU, less than GSPMD's flat FSDP and HSDP,
ZeRO++'s int8 hops across hosts about half of it, and the flat step a ring over every GPU per
pass, as GSPMD's flat FSDP."""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import _lm  # noqa: E402  pylint: disable=wrong-import-position
import bench_regime  # noqa: E402  pylint: disable=wrong-import-position
from zero_jax.gpu import measure, predict  # noqa: E402  pylint: disable=wrong-import-position

HOSTS = 2
CFG = _lm.GPTConfig("tiny", vocab=512, d_model=64, layers=2, heads=2, seq_len=64)
PARAMS = CFG.n_params()   # 136,960: a multiple of 16, so no leaf's padding changes the count


def _stacked_params() -> int:
  """Parameters in the layer stack (``stacked=_lm.in_blocks``)."""
  shapes = jax.eval_shape(lambda k: _lm.family(CFG).init(CFG, k), jax.random.key(0))
  sizes = jax.tree_util.tree_flatten_with_path(shapes)[0]
  return sum(x.size for path, x in sizes if _lm.in_blocks(path, x))


@pytest.fixture(scope="module")
def across():
  """Bytes each GPU sends across hosts per step, per system (400 Gb/s per host: the bytes do
  not depend on the network)."""
  device = measure.device_for(bench_regime.network(400), 8, "bf16")
  out = {}
  for system in ("flat", "hybrid", "hpZ", bench_regime.LOSSY, "FSDP flat", "HSDP"):
    text = bench_regime.lower(CFG, HOSTS, 1, system).compile(
        compiler_options=measure.FAST_COMPILE).as_text()
    out[system] = measure.sent_bytes(predict.analyze(text), device)[1]
  return out


def test_hybrid_and_hpz_send_zeropps_share_across_hosts(across):
  # hybrid: each GPU's 1/8 of the bf16 gradient all-reduced over a ring of the hosts,
  # 2 (h-1)/h of it. hpZ: the same 1/8 reduce-scattered across the hosts ((h-1)/h of it) and
  # the secondary copy's bf16 refresh gathered back ((h-1)/h): the same bytes. Beside them
  # only the loss and gradient-norm scalars (a few bytes of 34,240) cross.
  share = 2 * (HOSTS - 1) / HOSTS * (2 * PARAMS / 8)
  assert across["hybrid"] == pytest.approx(share, rel=1e-3)
  assert across["hpZ"] == pytest.approx(share, rel=1e-3)


def test_gspmds_flat_fsdp_and_hsdp_send_more_across_hosts(across):
  # Flat FSDP's gathers and reduce-scatters are rings over all 16 GPUs, each leaving every
  # host once: each GPU carries 1/8 of what it sends, three rings of the model's bf16 bytes
  # (forward and backward gathers, the reduce-scatter) against hpZ's two.
  assert across["FSDP flat"] > 2 * across["hpZ"], across
  assert across["HSDP"] > across["hybrid"], across


def test_int8_hops_across_hosts_halve_the_bytes(across):
  # int8 values plus one float32 scale per 256: (1 + 4/256) / 2 of bf16's bytes, and a little
  # padding of the blocks.
  assert across[bench_regime.LOSSY] == pytest.approx(
      across["hpZ"] * (1 + 4 / 256) / 2, rel=0.05), across


def test_flat_sends_one_ring_over_every_gpu_per_pass(across):
  # Each pass is a ring over all 16 GPUs that leaves each host once, so each GPU carries 1/8 of
  # the (n-1)/n of the bf16 bytes it sends: three passes for the layer stack (forward gather,
  # backward re-gather, reduce-scatter), two for the other leaves (gathered once a step and
  # kept for the backward). GSPMD's flat FSDP re-gathers those too: a little more.
  n, stacked = 8 * HOSTS, _stacked_params()
  passes = 3 * stacked + 2 * (PARAMS - stacked)
  assert across["flat"] == pytest.approx(passes * 2 * (n - 1) / n / 8, rel=1e-3), across
  assert across["hpZ"] < across["flat"] < across["FSDP flat"], across
