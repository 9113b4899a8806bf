"""Every fenced ```python block of README.md and docs/**/*.md runs, as a user would paste it.

The blocks of one page run in order in one fresh interpreter (one shared namespace), on 8 CPU
devices, in an empty temporary directory. A block preceded by ``<!-- skip: reason -->`` is left
out (the page says why); one page's failure names the page and the block's first line.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
PAGES = [p for p in PAGES if "_build" not in p.parts and "_autosummary" not in p.parts]
_FENCE = re.compile(r"(?P<skip><!--\s*skip:[^>]*-->\s*\n)?^(?P<fence>```+)python[ \t]*\n"
                    r"(?P<code>.*?)^(?P=fence)[ \t]*$", re.M | re.S)
_PRELUDE = 'import jax\njax.config.update("jax_num_cpu_devices", 8)\n'


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(line number, code) of each fenced python block not marked ``<!-- skip: ... -->``."""
  return [(text.count("\n", 0, m.start("code")) + 1, m.group("code"))
          for m in _FENCE.finditer(text) if not m.group("skip")]


def page_script(page: pathlib.Path) -> str:
  """The page's blocks, each announced on stderr so a failure names the block it was in."""
  rel = page.relative_to(ROOT)
  parts = [_PRELUDE]
  for line, code in python_blocks(page.read_text()):
    parts.append(f"import sys as _s; print('--- {rel}:{line}', file=_s.stderr, flush=True)\n")
    parts.append(code)
  return "\n".join(parts)


def test_the_extractor_finds_blocks_and_honours_skip():
  text = ("a\n```python\nx = 1\n```\n<!-- skip: needs a GPU -->\n```python\ny = 2\n```\n"
          "```bash\nls\n```\n````python\nz = '```'\n````\n")
  assert python_blocks(text) == [(3, "x = 1\n"), (13, "z = '```'\n")]


def test_every_page_with_python_is_collected():
  names = {p.relative_to(ROOT).as_posix() for p in PAGES}
  assert "README.md" in names and "docs/getting_started.md" in names
  assert python_blocks((ROOT / "README.md").read_text()), "the README's quick start is gone"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_snippets_run(page, tmp_path):
  script = tmp_path / "snippets.py"
  script.write_text(page_script(page))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
  env.pop("XLA_FLAGS", None)
  run = tmp_path / "cwd"
  run.mkdir()
  proc = subprocess.run([sys.executable, str(script)], cwd=run, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, (
      f"a python block of {page.relative_to(ROOT)} failed (the last '--- file:line' below is "
      f"the block):\n{proc.stderr[-6000:]}\n--- stdout:\n{proc.stdout[-2000:]}")


def _missing_names(text: str) -> list[str]:
  import zero_jax
  return [n for n in zero_jax.__all__ if not re.search(rf"\b{re.escape(n)}\b", text)]


def test_every_public_name_is_in_the_readme():
  assert not _missing_names((ROOT / "README.md").read_text()), (
      "name these in README.md's 'API at a glance'")


def test_every_public_name_is_in_the_api_reference():
  assert not _missing_names((ROOT / "docs" / "api.md").read_text()), (
      "add these to an autosummary list in docs/api.md")


def test_relative_links_point_at_files():
  """Every link of README.md and the docs to a file of the repository names one that exists."""
  broken = []
  for page in PAGES:
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      path = target.split("#")[0]
      if path and "://" not in path and not (page.parent / path).exists():
        broken.append(f"{page.relative_to(ROOT)}: {target}")
  assert not broken, broken


def test_every_option_of_the_step_is_in_the_options_table():
  import inspect
  import zero_jax
  text = (ROOT / "docs" / "getting_started.md").read_text()
  table = text[text.index("## All the options"):]
  options = [p.name for p in inspect.signature(zero_jax.make_sharded_train_step).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
  missing = [o for o in options if f"`{o}`" not in table]
  assert not missing, (f"make_sharded_train_step options {missing} have no row in the 'All the "
                       "options' table of docs/getting_started.md (add one, linking its guide)")
