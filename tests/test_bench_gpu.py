"""benchmarks/bench_gpu.py: its smoke mode runs (each XLA flag set in its own process, stages 2
and 3, every prefetch schedule this zero_jax has) and leaves BENCHMARKS.md alone; its MFU's
flop count agrees with the matmuls the program executes."""

import pathlib
import subprocess
import sys

import jax
import optax
import pytest

import zero_jax as zj
from zero_jax.gpu import predict as overlap

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import _lm  # noqa: E402
import bench_gpu  # noqa: E402


def test_smoke_mode_runs_every_flag_set_and_stage_and_writes_no_benchmarks(tmp_path):
  before = (ROOT / "BENCHMARKS.md").read_text()
  out = tmp_path / "gpu.md"
  proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--smoke",
                         "--out", str(out)], capture_output=True, text=True, timeout=600,
                        cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert (ROOT / "BENCHMARKS.md").read_text() == before
  text = out.read_text()
  assert "### XLA defaults" in text and "--xla_gpu_enable_latency_hiding_scheduler=true" in text
  schedules = ("prefetch 0", "prefetch 1") if _lm.has_prefetch() else ("prefetch 0",)
  rows = [line for line in text.splitlines() if line.startswith("| smoke |")]
  assert {(line.split(" | ")[2], line.split(" | ")[3]) for line in rows} >= {
      (s, p) for s in ("2", "3") for p in schedules}
  assert "Error" not in text and "n/a (peak unknown)" in text  # CPU: no peak, no failure
  assert ("zj.scan" if _lm.has_prefetch() else "jax.lax.scan + zj.gather only") in text


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12), ("cpu", None)])
def test_peak_flops_by_device_kind(kind, peak):
  assert bench_gpu.peak_flops(kind, None) == peak
  assert bench_gpu.peak_flops(kind, 100.0) == 100e12


def test_model_flops_are_the_executed_matmuls_less_the_recomputation(mesh):
  cfg = _lm.GPTConfig("t", vocab=40, d_model=16, layers=3, heads=2, seq_len=8)
  rows = 16
  params = jax.eval_shape(lambda k: _lm.init_gpt(cfg, k), jax.random.key(0))
  tokens = rows // 8 * cfg.seq_len  # per device
  d, t = cfg.d_model, cfg.seq_len

  def executed(policy):
    step = zj.make_sharded_train_step(_lm.make_gpt_loss(cfg, 0, policy), optax.sgd(0.1),
                                      mesh=mesh, stage=3, stacked=_lm.in_blocks)
    text = step.lower(step.abstract_state(params), _lm.gpt_batch_shape(cfg, rows)).as_text(
        dialect="hlo")
    return overlap.analyze(text).total_flops()

  # Recomputing each block (nothing_saveable), the backward pass runs its forward pass again
  # but its last matmul (the MLP's down projection, 8 d^2 a token), whose output only feeds
  # the next block; keeping what lax.scan keeps (the default), nothing.
  recomputed = cfg.layers * (16 * d * d + 4 * t * d)
  model = _lm.model_flops_per_token(cfg) * tokens
  assert executed(jax.checkpoint_policies.nothing_saveable) == model + recomputed * tokens
  assert executed(None) == model
