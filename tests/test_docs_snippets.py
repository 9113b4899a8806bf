"""Every fenced ```python block of README.md and docs/**/*.md runs, as a user would paste it.

The blocks of one page run in order in one fresh interpreter (one shared namespace), on 8 CPU
devices, in an empty temporary directory. A block preceded by ``<!-- skip: reason -->`` is left
out (the page says why), one preceded by ``<!-- needs: cuda-plugin -->`` where JAX's CUDA
plugin is not installed (tests/gpu/test_guide.py runs those blocks with it); one page's
failure names the page and the block's first line.

A ```text block that directly follows a python block (nothing but blank lines between) shows
what that block prints, and must match it: the text exactly (line ends stripped), numbers with
a decimal point to 1e-3 relative or one unit of their last printed digit. To write an output,
put an empty ```text block after the python block and run
``ZERO_JAX_UPDATE_OUTPUTS=1 python -m pytest tests/test_docs_snippets.py -k <page>``: it fills
in every output block of the pages it runs.
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
_FENCE = re.compile(r"(?:(?:(?P<skip><!--\s*skip:[^>]*-->)|(?P<needs><!--\s*needs:\s*"
                    r"cuda-plugin\s*-->))\s*\n)?^(?P<fence>```+)python[ \t]*\n"
                    r"(?P<code>.*?)^(?P=fence)[ \t]*$", re.M | re.S)
_PRELUDE = 'import jax\njax.config.update("jax_num_cpu_devices", 8)\n'
_OUTPUT = re.compile(r"\n*```text[ \t]*\n(?P<out>.*?)^```[ \t]*$", re.M | re.S)
_MARK = "<<<zero_jax snippet {}>>>"
_NUMBER = re.compile(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?")


def cuda_plugin() -> bool:
  """Whether JAX's CUDA plugin is installed (the GPU compile tier's venv has it)."""
  try:
    import jax_plugins.xla_cuda12  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    return True
  except ImportError:
    return False


def python_blocks(text: str, plugin: bool | None = None) -> list[tuple[int, str]]:
  """(line number, code) of each fenced python block not marked ``<!-- skip: ... -->``; one
  marked ``<!-- needs: cuda-plugin -->`` only where JAX's CUDA plugin is installed (or
  ``plugin`` says so)."""
  plugin = cuda_plugin() if plugin is None else plugin
  return [(text.count("\n", 0, m.start("code")) + 1, m.group("code"))
          for m in _FENCE.finditer(text)
          if not m.group("skip") and (plugin or not m.group("needs"))]


def output_blocks(text: str) -> dict[int, re.Match]:
  """The ```text block right after a python block, by that python block's line number."""
  found = {}
  for m in _FENCE.finditer(text):
    out = _OUTPUT.match(text, m.end() + 1)
    if out and not m.group("skip") and (cuda_plugin() or not m.group("needs")):
      found[text.count("\n", 0, m.start("code")) + 1] = out
  return found


def page_script(page: pathlib.Path) -> str:
  """The page's blocks, each announced on stderr so a failure names the block it was in, and
  on stdout so that what each block prints can be told apart."""
  rel = page.relative_to(ROOT)
  parts = [_PRELUDE]
  for line, code in python_blocks(page.read_text()):
    parts.append(f"import sys as _s; print('--- {rel}:{line}', file=_s.stderr, flush=True); "
                 f"print('\\n{_MARK.format(line)}', flush=True)\n")
    parts.append(code)
  return "\n".join(parts)


def printed_by_block(stdout: str) -> dict[int, str]:
  """What each block printed, by its line number (from the marks page_script prints)."""
  pieces = re.split("^" + re.escape(_MARK).replace(r"\{\}", r"(\d+)") + "$", stdout, flags=re.M)
  return {int(line): _tidy(out) for line, out in zip(pieces[1::2], pieces[2::2])}


def _tidy(text: str) -> str:
  return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def same_output(shown: str, printed: str) -> bool:
  """The text equal, and each number equal, to 1e-3 relative or one unit of its last printed
  digit where it has a decimal point (integers exactly)."""
  shown, printed = _tidy(shown), _tidy(printed)
  if _NUMBER.split(shown) != _NUMBER.split(printed):
    return False
  for a, b in zip(_NUMBER.findall(shown), _NUMBER.findall(printed)):
    if "." not in a and "e" not in a:
      if a != b:
        return False
      continue
    digits = re.match(r"-?\d+\.?(\d*)", a).group(1)
    exp = int(a.split("e")[1]) if "e" in a else 0
    if abs(float(a) - float(b)) > max(1e-3 * abs(float(a)), 1.01 * 10.0 ** (exp - len(digits))):
      return False
  return True


def stale_outputs(page: pathlib.Path, printed: dict[int, str], update: bool = False) -> list[str]:
  """The output blocks of ``page`` that differ from what their python block printed (with
  ``update``, rewritten with it instead)."""
  text = page.read_text()
  stale, edits = [], []
  for line, m in output_blocks(text).items():
    now = printed.get(line, "")
    if not same_output(m.group("out"), now):
      stale.append(f"{page.relative_to(ROOT)}:{line}: the page shows\n{m.group('out')}"
                   f"but the block prints\n{now}\n")
      edits.append((m.start("out"), m.end("out"), now + "\n" if now else ""))
  if update and edits:
    for start, end, new in reversed(edits):
      text = text[:start] + new + text[end:]
    page.write_text(text)
  return [] if update else stale


def test_the_extractor_finds_blocks_and_honours_skip():
  text = ("a\n```python\nx = 1\n```\n<!-- skip: needs a GPU -->\n```python\ny = 2\n```\n"
          "```bash\nls\n```\n````python\nz = '```'\n````\n")
  assert python_blocks(text) == [(3, "x = 1\n"), (13, "z = '```'\n")]
  needs = "<!-- needs: cuda-plugin -->\n```python\nw = 3\n```\n"
  assert python_blocks(needs, plugin=False) == []
  assert python_blocks(needs, plugin=True) == [(3, "w = 3\n")]


def test_an_output_block_is_the_text_block_right_after_a_python_block():
  text = ("```python\nprint(1)\n```\n\n```text\n1\n```\nprose\n```python\nx = 2\n```\nprose\n"
          "```text\nnot an output\n```\n")
  assert {line: m.group("out") for line, m in output_blocks(text).items()} == {2: "1\n"}


def test_outputs_are_split_by_block_and_compared_with_a_tolerance_on_decimals():
  stdout = ("\n" + _MARK.format(3) + "\nloss 0.1234\nstep 50\n\n" + _MARK.format(9) + "\n\n"
            + _MARK.format(12) + "\n[1.5e-07]  \n")
  assert printed_by_block(stdout) == {3: "loss 0.1234\nstep 50", 9: "", 12: "[1.5e-07]"}
  assert same_output("loss 0.1234\nstep 50\n", "loss 0.1235\nstep 50")
  assert not same_output("loss 0.1234\nstep 50", "loss 0.1237\nstep 50")   # 3 in the last digit
  assert not same_output("loss 0.1234\nstep 50", "loss 0.1234\nstep 51")   # integers exactly
  assert not same_output("loss 0.1234", "error 0.1234")
  assert not same_output("loss 0.1234", "loss 0.1234\nmore")
  assert same_output("[1.5e-07]", "[1.6e-07]") and not same_output("[1.5e-07]", "[1.8e-07]")
  assert same_output("1234.5678", "1235.4")                                # 1e-3 relative


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
  stale = stale_outputs(page, printed_by_block(proc.stdout),
                        update=os.environ.get("ZERO_JAX_UPDATE_OUTPUTS") == "1")
  assert not stale, ("\n".join(stale) + "\nRefresh with ZERO_JAX_UPDATE_OUTPUTS=1 python -m "
                     "pytest tests/test_docs_snippets.py -k <page>, and read the diff.")


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
