"""The GPU compile guide's snippets run with JAX's CUDA plugin, the blocks that need it included
(tests/test_docs_snippets.py runs the others where the plugin is missing)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import test_docs_snippets as snippets  # noqa: E402  pylint: disable=import-error,wrong-import-position

GUIDE = ROOT / "docs" / "guides" / "gpu_compile.md"


def test_the_guides_plugin_blocks_run_and_find_every_window_overlapped(tmp_path):
  text = GUIDE.read_text()
  assert len(snippets.python_blocks(text, plugin=True)) > len(
      snippets.python_blocks(text, plugin=False)) >= 2
  script = tmp_path / "guide.py"
  (text_of_script,) = snippets.page_scripts(GUIDE)   # the page runs in sequence: one script
  script.write_text(text_of_script)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
  proc = subprocess.run([sys.executable, "-W", "error", str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "overlapped" in proc.stdout and "EXPOSED" not in proc.stdout, proc.stdout
