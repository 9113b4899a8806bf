"""zero_jax's stage 3 beside GSPMD FSDP (as MaxText writes it) on the program XLA:GPU compiles
for 8 H100s, GPT-2 small's shapes (benchmarks/bench_peer.py, whose figures BENCHMARKS.md
"peer" holds): keeping what the backward pass needs (``zj.scan(policy=everything_saveable)``,
no recomputed layer), zero_jax runs no more matmuls than GSPMD keeping its activations, sends
no more bytes, and overlaps every in-loop collective with a matmul with no flag set."""

import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_peer  # noqa: E402  pylint: disable=wrong-import-position


def test_keeping_activations_zero_jax_runs_no_more_gemms_and_sends_no_more_than_gspmd():
  cfg = bench_peer.MODELS["small"]
  options = bench_peer.measure.FAST_COMPILE
  ours = bench_peer.lower_zero_jax(cfg, "h100", 1, {"stage": 3},
                                   jax.checkpoint_policies.everything_saveable)
  peer = bench_peer.lower_gspmd(cfg, "h100", 1, (("data",), ("data",)), None)
  ours, peer = (bench_peer.read(x.compile(compiler_options=options).as_text(), "h100")
                for x in (ours, peer))
  assert ours["gemms"] <= peer["gemms"], (ours["gemms"], peer["gemms"])
  assert ours["tflops"] <= peer["tflops"] * 1.001, (ours["tflops"], peer["tflops"])
  assert ours["intra"] + ours["cross"] <= peer["intra"] + peer["cross"], (ours, peer)
  assert ours["overlapped"] == ours["in_loop"] > 0, ours
