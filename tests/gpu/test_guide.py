"""The GPU guides' pages run as pasted, with JAX's CUDA plugin: every python block, those that
need it included (tests/test_docs_snippets.py runs the others where the plugin is missing), and
what they print is checked against the page's output blocks (``ZERO_JAX_UPDATE_OUTPUTS=1``
rewrites them, as in tests/test_docs_snippets.py)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import test_docs_snippets as snippets  # noqa: E402  pylint: disable=import-error,wrong-import-position

GUIDES = ROOT / "docs" / "guides"


def run_page(page: pathlib.Path, tmp_path) -> str:
  """The page's blocks in one interpreter, as a reader pastes them; what they print."""
  text = page.read_text()
  assert len(snippets.python_blocks(text, plugin=True)) > len(
      snippets.python_blocks(text, plugin=False)) >= 2
  assert "<!-- skip:" not in text, f"{page.name}: every block runs in the GPU tier"
  (script,) = snippets.page_scripts(page)   # the page runs in sequence: one script
  path = tmp_path / "page.py"
  path.write_text(script)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-W", "error", str(path)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  stale = snippets.stale_outputs(page, snippets.printed_by_block(proc.stdout),
                                 update=os.environ.get("ZERO_JAX_UPDATE_OUTPUTS") == "1")
  assert not stale, "\n".join(stale)
  return proc.stdout


def test_the_gpu_compile_guide_runs_and_finds_every_window_overlapped(tmp_path):
  out = run_page(GUIDES / "gpu_compile.md", tmp_path)
  assert "overlapped" in out and "EXPOSED" not in out, out


def test_the_planning_guide_runs_plans_and_trains_the_best_on_stand_ins(tmp_path):
  # Before: its first block failed as pasted (a model the test did not run had drifted).
  out = run_page(GUIDES / "planning.md", tmp_path)
  assert "**best**" in out and "| exact |" in out and "LOSSY" not in out, out
