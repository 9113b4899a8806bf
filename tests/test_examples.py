"""The examples run: examples/train_lm.py (as a user runs it) and the quick-start notebook."""

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TINY = ["--size", "tiny", "--seq-len", "32", "--batch-size", "16", "--lr", "1e-2",
        "--eval-batches", "2", "--sample-bytes", "16", "--platform", "cpu", "--no-progress"]
STEPS, SAVE_EVERY = 24, 12


def run_lm(*args, timeout=300) -> subprocess.CompletedProcess:
  proc = subprocess.run([sys.executable, str(EXAMPLES / "train_lm.py"), *TINY, *args],
                        capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert proc.returncode == 0, f"train_lm.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
  return proc


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """24 steps with checkpoints at 12 and 24."""
  tmp = tmp_path_factory.mktemp("lm")
  proc = run_lm("--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
                "--ckpt-dir", str(tmp / "ckpt"), "--metrics-json", str(tmp / "metrics.json"))
  return tmp, proc.stdout, json.loads((tmp / "metrics.json").read_text())


def test_train_lm_loss_falls_and_reports_memory_and_samples(uninterrupted):
  _, out, m = uninterrupted
  losses = {int(k): v for k, v in m["losses"].items()}
  assert sorted(losses) == list(range(1, STEPS + 1))
  assert losses[1] > 5.0                              # about ln(257): a uniform guess
  assert max(losses[s] for s in range(STEPS - 3, STEPS + 1)) < losses[1] - 1.0
  assert m["eval_loss_after"] < m["eval_loss_before"] - 1.0   # held-out text too
  assert m["n_devices"] == 8 and m["stage"] == 2 and m["tokens_per_s"] > 0
  for row in ("| DP (replicated) |", "| ZeRO-1 |", "| ZeRO-2 |", "| ZeRO-3 |"):
    assert row in out
  assert "XLA's analysis of the compiled step" in out
  assert "sampled text" in out


def test_train_lm_resume_continues_to_the_same_params(uninterrupted, tmp_path):
  """Resuming at step 12 takes the same steps 13-24 as the run that was never stopped."""
  src, _, full = uninterrupted
  ckpt = tmp_path / "ckpt"
  shutil.copytree(src / "ckpt", ckpt)
  assert (ckpt / str(STEPS)).is_dir() and (ckpt / str(SAVE_EVERY)).is_dir()
  shutil.rmtree(ckpt / str(STEPS))   # as if the run had stopped after step 12
  proc = run_lm("--steps", str(STEPS), "--resume", "--ckpt-dir", str(ckpt),
                "--metrics-json", str(tmp_path / "metrics.json"))
  m = json.loads((tmp_path / "metrics.json").read_text())
  assert f"resumed from {ckpt} at step {SAVE_EVERY}" in proc.stdout
  assert m["start_step"] == SAVE_EVERY and m["step"] == STEPS
  resumed = {int(k): v for k, v in m["losses"].items()}
  assert sorted(resumed) == list(range(SAVE_EVERY + 1, STEPS + 1))
  for s, loss in resumed.items():
    assert loss == pytest.approx(full["losses"][str(s)], rel=1e-6, abs=1e-6), s
  assert m["param_checksum"] == pytest.approx(full["param_checksum"], rel=1e-6)
  assert (ckpt / str(STEPS)).is_dir()  # and it saved its own final checkpoint


def test_train_lm_help_lists_every_option(capsys):
  spec = importlib.util.spec_from_file_location("train_lm", EXAMPLES / "train_lm.py")
  train_lm = importlib.util.module_from_spec(spec)
  sys.modules["train_lm"] = train_lm  # flax's dataclasses look their module up
  try:
    spec.loader.exec_module(train_lm)
  finally:
    del sys.modules["train_lm"]
  with pytest.raises(SystemExit) as e:
    train_lm.parse_args(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for opt in ("--stage", "--precision", "--size", "--steps", "--batch-size", "--devices",
              "--resume", "--ckpt-dir"):
    assert opt in out
  defaults = train_lm.parse_args([])
  assert defaults.stage == 2 and defaults.precision == "fp32" and defaults.resume is None


def test_quickstart_notebook_runs_end_to_end():
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
  client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                   resources={"metadata": {"path": str(EXAMPLES)}})
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/markdown", "")
                   for o in outputs)
  assert "largest difference from single-device optax" in text
  assert "MLP: loss" in text and "largest difference from nnx.Optimizer" in text
  assert "| ZeRO-3 |" in text
  images = [o for o in outputs if "image/png" in o.get("data", {})]
  assert images, "the notebook's plot produced no image"


def test_train_nnx_learns_evaluates_and_restores():
  proc = subprocess.run([sys.executable, str(EXAMPLES / "train_nnx.py"), "--steps", "30"],
                        capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, f"train_nnx.py failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
  assert "model state: ['BatchStat', 'RngCount', 'RngKey']" in proc.stdout
  assert "| ZeRO-3 |" in proc.stdout
  assert "restored into a ZeRO-3 step at step 30: the same model" in proc.stdout
