"""Every fenced ```python block of README.md and docs/**/*.md runs, as a reader pastes it.

Every page of docs/ with python blocks says before its first block how they run (`SEQUENCE` or
`ALONE`): in sequence, the page's blocks run in order in one fresh interpreter (one shared
namespace); alone, each block runs in an interpreter of its own. Nothing is set up for them
(a block that needs 8 CPU devices asks for them itself, as a reader's paste must), they run in an
empty temporary directory, and a warning is an error, as in the test suite. A block preceded by
``<!-- skip: reason -->`` is left out (the page says why), one preceded by
``<!-- needs: cuda-plugin -->`` where JAX's CUDA plugin is not installed (tests/gpu/test_guide.py
runs those blocks with it); one page's failure names the page and the block's first line.

A ```text block that directly follows a python block (nothing but blank lines between) shows
what that block prints, and must match it: the text exactly (line ends stripped; the
temporary directory the blocks run in shows as ``<cwd>``), numbers with a decimal point
printed with as many digits and equal to 1e-3 relative or one unit of their last digit
(print them rounded to what does not vary with the machine: a float's full ``repr`` does),
integers exactly. A number that varies from run to run by more than that and that the block
cannot round (a duration a library prints) shows as ``<varies>``, which matches any one number. Gloo's connection lines
(``[Gloo] Rank 0 is connected to ...``), which the processes of a multi-process block write
in an order that varies and even cut into pieces, are compared apart from the rest: the page
shows as many as the block prints (whole, in any order). Every other ```text block of a page
with python blocks says in a ``<!-- not an output: reason -->`` comment before it that it is
not compared (a shell command's output, an error message quoted), so no output goes
unchecked by mistake. To write an output, put an empty ```text block after the python block
and run ``ZERO_JAX_UPDATE_OUTPUTS=1 python -m pytest tests/test_docs_snippets.py -k <page>``:
it fills in every output block of the pages it runs (check the diff by eye: ``<varies>`` and
the gloo lines are written as printed).

The blocks run with XLA's default compile (not the test suite's quicker kernels); to check the
pages on another instruction set than the machine's, set ``ZERO_JAX_DOCS_XLA_FLAGS`` (e.g.
``--xla_cpu_max_isa=AVX2``): the blocks get it as their ``XLA_FLAGS``.
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
SEQUENCE = "The blocks of this page run in sequence"
ALONE = "Each block of this page runs on its own"
_OUTPUT = re.compile(r"\n*```text[ \t]*\n(?P<out>.*?)^```[ \t]*$", re.M | re.S)
_TEXT = re.compile(r"(?:(?P<said><!--\s*not an output:[^>]*-->)\s*\n)?^```text[ \t]*$", re.M)
VARIES = "<varies>"
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


def output_blocks(text: str, plugin: bool | None = None) -> dict[int, re.Match]:
  """The ```text block right after a python block, by that python block's line number (of
  the blocks `python_blocks` runs)."""
  plugin = cuda_plugin() if plugin is None else plugin
  found = {}
  for m in _FENCE.finditer(text):
    out = _OUTPUT.match(text, m.end() + 1)
    if out and not m.group("skip") and (plugin or not m.group("needs")):
      found[text.count("\n", 0, m.start("code")) + 1] = out
  return found


def unsaid_text_blocks(text: str) -> list[int]:
  """Line numbers of the ```text blocks that are neither the output of a python block (run or
  not) nor marked ``<!-- not an output: reason -->``."""
  outputs = {m.start("out") for m in (_OUTPUT.match(text, f.end() + 1)
                                      for f in _FENCE.finditer(text)) if m}
  return [text.count("\n", 0, m.start()) + 1 for m in _TEXT.finditer(text)
          if not m.group("said") and m.end() + 1 not in outputs]


def run_mode(page: pathlib.Path) -> str | None:
  """`SEQUENCE` or `ALONE`: what the page says before its first python block (None: nothing)."""
  text = page.read_text()
  head = text[:text.index("```python")] if "```python" in text else text
  said = [m for m in (SEQUENCE, ALONE) if m in " ".join(head.split())]
  return said[0] if len(said) == 1 else None


def page_scripts(page: pathlib.Path) -> list[str]:
  """The scripts a reader's pastes make of the page's blocks (one, or one per block), each
  block announced on stderr so a failure names the block it was in, and on stdout so that
  what each block prints can be told apart."""
  rel = page.relative_to(ROOT)
  parts = []
  for line, code in python_blocks(page.read_text()):
    parts.append(f"import sys as _s; print('--- {rel}:{line}', file=_s.stderr, flush=True); "
                 f"print('\\n{_MARK.format(line)}', flush=True); del _s\n{code}")
  return parts if run_mode(page) == ALONE else ["\n".join(parts)]


def printed_by_block(stdout: str) -> dict[int, str]:
  """What each block printed, by its line number (from the marks page_script prints)."""
  pieces = re.split("^" + re.escape(_MARK).replace(r"\{\}", r"(\d+)") + "$", stdout, flags=re.M)
  return {int(line): _tidy(out) for line, out in zip(pieces[1::2], pieces[2::2])}


# gloo's connection lines, which processes write to one pipe at once, each in pieces
# ("[Gloo] Rank ", the rank, " is connected to ", the count, " peer ranks. ", "Expected ... is : ",
# the count, the line end; seen in CI: "... peer ranks. 1Expected ...", another process's count
# between the two): whole, or cut where another process's write came between. The
# literal pieces come out wherever they are; the numbers and line ends between them are left
# as lines of digits (or nothing) among the gloo lines, or, for a message's last count,
# right after them.
_GLOO = re.compile(r"\[Gloo\] Rank ?| ?is connected to ?| ?peer ranks\. ?|Expected number of "
                   r"connected peer ranks is : ?")  # "peer ranks. " and "Expected ..." apart too


def without_gloo(printed: str) -> list[str]:
  """The lines of ``printed`` less gloo's connection lines and their pieces."""
  lines = printed.splitlines(True)
  kept = [_GLOO.sub("", line) for line in lines]
  stray = [not k.strip() or k.strip().isdigit() for k in kept]
  last = max((i for i, (k, line) in enumerate(zip(kept, lines)) if k != line), default=-1)
  owed = len(re.findall(r"ranks is : ?(?!\d)", printed))   # counts that come later
  out = []
  for i, k in enumerate(kept):
    if i <= last and stray[i]:
      continue
    if i > last and owed and k.strip().isdigit():
      owed -= 1
      continue
    owed = 0 if i > last else owed
    out.append(k)
  return out


def _tidy(text: str) -> str:
  return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def gloo_messages(printed: str) -> int:
  """How many of gloo's connection messages ``printed`` holds, whole or in pieces."""
  return printed.count("is connected to")


def same_output(shown: str, printed: str) -> bool:
  """The text equal, and each number equal, to 1e-3 relative or one unit of its last printed
  digit where it has a decimal point, printed with as many digits (integers exactly;
  ``<varies>`` in ``shown`` stands for any one number); gloo's connection lines as many,
  wherever they are."""
  if gloo_messages(shown) != gloo_messages(printed):
    return False
  shown, printed = (_tidy("".join(without_gloo(t))) for t in (shown, printed))
  pattern = re.compile(re.escape(VARIES) + "|" + _NUMBER.pattern)
  if pattern.split(shown) != _NUMBER.split(printed):
    return False
  for a, b in zip(pattern.findall(shown), _NUMBER.findall(printed)):
    if a == VARIES:
      continue
    if "." not in a and "e" not in a:
      if a != b:
        return False
      continue
    digits = re.match(r"-?\d+\.?(\d*)", a).group(1)
    if (len(digits), "e" in a) != (len(re.match(r"-?\d+\.?(\d*)", b).group(1)), "e" in b):
      return False   # printed with another precision: the page shows more or fewer digits
    exp = int(a.split("e")[1]) if "e" in a else 0
    if abs(float(a) - float(b)) > max(1e-3 * abs(float(a)), 1.01 * 10.0 ** (exp - len(digits))):
      return False
  return True


def keep_varies(shown: str, printed: str) -> str:
  """``printed``, with ``<varies>`` kept where ``shown`` has it on a line that is otherwise
  printed alike (the same text between its numbers)."""
  pattern = re.compile(re.escape(VARIES) + "|" + _NUMBER.pattern)
  old, lines = _tidy(shown).splitlines(), printed.splitlines()
  for i, line in enumerate(lines):
    if i < len(old) and VARIES in old[i] and pattern.split(old[i]) == _NUMBER.split(line):
      numbers = iter(pattern.findall(old[i]))
      lines[i] = _NUMBER.sub(lambda n: VARIES if next(numbers) == VARIES else n.group(), line)
  return "\n".join(lines)


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
      edits.append((m.start("out"), m.end("out"), keep_varies(m.group("out"), now) + "\n"
                    if now else ""))
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
  assert same_output("1234.5678", "1235.4321")                             # 1e-3 relative
  assert not same_output("1.080396294593811", "1.0804")   # as many digits as the block prints
  assert same_output("compiled in <varies> s", "compiled in 12 s")
  assert same_output("<varies> s, <varies> ms", "17 s, 0.35 ms")
  assert not same_output("compiled in <varies> s", "compiled in s")
  assert not same_output("<varies> s", "12 s 3")
  assert keep_varies("took <varies> s, 1.5 MiB\nx", "took 17 s, 1.7 MiB\ny") == \
      "took <varies> s, 1.7 MiB\ny"


def test_only_marked_text_blocks_stand_apart_from_python_blocks():
  text = ("```python\nprint(1)\n```\n\n```text\n1\n```\nprose\n\n```text\nstray\n```\n"
          "<!-- not an output: a shell's -->\n```text\n$ ls\n```\n"
          "<!-- needs: cuda-plugin -->\n```python\nprint(2)\n```\n```text\n2\n```\n")
  assert unsaid_text_blocks(text) == [10]
  assert sorted(output_blocks(text, plugin=True)) == [2, 19]
  assert sorted(output_blocks(text, plugin=False)) == [2]


def test_every_page_with_python_is_collected():
  names = {p.relative_to(ROOT).as_posix() for p in PAGES}
  assert "README.md" in names and "docs/getting_started.md" in names
  assert python_blocks((ROOT / "README.md").read_text()), "the README's quick start is gone"


WITH_PYTHON = [p for p in PAGES if python_blocks(p.read_text())]


@pytest.mark.parametrize("page", WITH_PYTHON, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_snippets_run(page, tmp_path):
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
  env.pop("XLA_FLAGS", None)   # XLA's default compile, as a reader's (not conftest.py's)
  if os.environ.get("ZERO_JAX_DOCS_XLA_FLAGS"):
    env["XLA_FLAGS"] = os.environ["ZERO_JAX_DOCS_XLA_FLAGS"]
  stdout = ""
  for i, script in enumerate(page_scripts(page)):
    path, run = tmp_path / f"snippets_{i}.py", tmp_path / f"cwd_{i}"
    path.write_text(script)
    run.mkdir()
    proc = subprocess.run([sys.executable, "-W", "error", str(path)], cwd=run, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"a python block of {page.relative_to(ROOT)} failed (the last '--- file:line' below "
        f"is the block):\n{proc.stderr[-6000:]}\n--- stdout:\n{proc.stdout[-2000:]}")
    printed = proc.stdout.replace(str(run.resolve()), "<cwd>").replace(str(run), "<cwd>")
    stdout += printed
  stale = stale_outputs(page, printed_by_block(stdout),
                        update=os.environ.get("ZERO_JAX_UPDATE_OUTPUTS") == "1")
  assert not stale, ("\n".join(stale) + "\nRefresh with ZERO_JAX_UPDATE_OUTPUTS=1 python -m "
                     "pytest tests/test_docs_snippets.py -k <page>, and read the diff.")


@pytest.mark.parametrize("page", [p for p in WITH_PYTHON if p.parent.name in ("docs", "guides")
                                  and p.name != "pypi_description.md"],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_guide_says_at_its_top_how_its_blocks_run(page):
  assert run_mode(page), (f"{page.relative_to(ROOT)}: say before the first python block either "
                          f"'{SEQUENCE}' or '{ALONE}'")


@pytest.mark.parametrize("page", WITH_PYTHON, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_block_that_prints_shows_its_output(page):
  """Also the blocks that run only with JAX's CUDA plugin (tests/gpu/test_guide.py compares
  their outputs)."""
  text = page.read_text()
  shown = output_blocks(text, plugin=True)
  silent = [line for line, code in python_blocks(text, plugin=True)
            if re.search(r"\bprint\(", code) and line not in shown]
  assert not silent, (f"{page.relative_to(ROOT)}: the blocks at lines {silent} print; follow "
                      f"each with a ```text block of what it prints (an empty one, filled by "
                      f"ZERO_JAX_UPDATE_OUTPUTS=1)")


@pytest.mark.parametrize("page", WITH_PYTHON, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_text_block_is_a_compared_output_or_says_why_not(page):
  """A ```text block away from its python block (prose between) would show an output nothing
  compares: it goes right after the block, or says it is not an output."""
  unsaid = unsaid_text_blocks(page.read_text())
  assert not unsaid, (f"{page.relative_to(ROOT)}: the ```text blocks at lines {unsaid} follow "
                      f"no python block: move each right after the block whose output it shows "
                      f"(prose after it), or precede it with <!-- not an output: why -->")


def test_every_page_that_needs_the_plugin_is_run_by_the_gpu_tier():
  """Its outputs are compared there (tests/gpu/test_guide.py), and nowhere else."""
  gpu_tier = (ROOT / "tests" / "gpu" / "test_guide.py").read_text()
  needing = [p for p in WITH_PYTHON
             if len(python_blocks(p.read_text(), plugin=True)) > len(python_blocks(p.read_text(),
                                                                                 plugin=False))]
  assert needing and [p.name for p in needing if f'"{p.name}"' not in gpu_tier] == []


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


def test_gloo_connection_lines_and_their_fragments_are_left_out():
  printed = ("[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of connected peer "
             "ranks is : 7\nstep 0: loss 0.5\n[Gloo] Rank \n7 is connected to 7 peer ranks. "
             "Expected number of connected peer ranks is : 7\ndone 3.0\n\n")
  assert "".join(without_gloo(printed)) == "step 0: loss 0.5\ndone 3.0\n\n"
  # One message inside the other, before its rank count (seen in CI on 2 processes).
  one = "[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer ranks is : "
  printed = one.format(1) + one.format(0) + "1\n1\nstep 0: loss 0.5\n"
  assert "".join(without_gloo(printed)) == "step 0: loss 0.5\n"
  # Two messages interleaved piece by piece, a count between "peer ranks. " and "Expected"
  # (seen in CI on 2 processes).
  printed = ("[Gloo] Rank [Gloo] Rank 1 is connected to 01 is connected to  peer ranks. "
             "1Expected number of connected peer ranks is :  peer ranks. 1Expected number of "
             "connected peer ranks is : 1\n\n" + one.format(0) + "1\nstep 0: loss 0.5\n")
  assert "".join(without_gloo(printed)) == "step 0: loss 0.5\n"
  assert gloo_messages(printed) == 3


def test_a_page_shows_as_many_gloo_lines_as_its_block_prints_in_any_order():
  line = ("[Gloo] Rank {} is connected to 1 peer ranks. Expected number of connected peer ranks "
          "is : 1\n")
  rest = line.format(1)[len("[Gloo] Rank "):]   # process 1's message, cut by process 0's
  printed = "[Gloo] Rank " + line.format(0) + rest + "step 0: loss 0.5\n"
  assert same_output(line.format(0) + line.format(1) + "step 0: loss 0.5", printed)
  assert not same_output("step 0: loss 0.5", printed)                  # the lines not shown
  assert not same_output(line.format(0) + "step 0: loss 0.5", printed)  # one of two
  assert not same_output(line.format(0) * 2 + "step 1: loss 0.5", printed)
