"""The package as users get it: metadata, sdist and wheel contents, and an install of the wheel."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import venv
import zipfile

import pytest

import zero_jax as zj
from zero_jax import checkpoint

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_error_classes_are_exported_and_are_the_ones_raised():
  for name in ("DamagedCheckpointError", "DamagedCheckpointWarning", "DirectoryInUseError"):
    assert name in zj.__all__
    assert getattr(zj, name) is getattr(checkpoint, name)
  for name in zj.__all__:
    assert hasattr(zj, name), name
  assert len(set(zj.__all__)) == len(zj.__all__)


def _need(*modules):
  missing = [m for m in modules if importlib.util.find_spec(m) is None]
  if missing and not os.environ.get("CI"):
    pytest.skip(f"{missing} not installed (pip install -e '.[test]'); CI requires them")
  assert not missing, f"{missing} missing in CI: they are in the [test] extra"


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
  """An sdist and a wheel built from this checkout (the wheel from the sdist, as PyPI's would be)."""
  _need("build", "twine")
  out = tmp_path_factory.mktemp("dist")
  proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
  return sdist, wheel


def test_twine_accepts_the_metadata(dist):
  proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist)],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout + proc.stderr


def test_wheel_holds_the_package_license_and_metadata(dist):
  _, wheel = dist
  assert wheel.name == f"zero_jax-{zj.__version__}-py3-none-any.whl"   # one version, one place
  with zipfile.ZipFile(wheel) as z:
    names = set(z.namelist())
    info = f"zero_jax-{zj.__version__}.dist-info"
    meta = z.read(f"{info}/METADATA").decode()
  assert "zero_jax/py.typed" in names and "zero_jax/__init__.py" in names
  assert f"{info}/licenses/LICENSE" in names
  assert not {n.split("/")[0] for n in names} - {"zero_jax", info}   # no tests/ or examples/
  assert "License-Expression: Apache-2.0" in meta
  assert "Project-URL" not in meta   # no public repository or docs site to point at (yet)
  assert "Description-Content-Type: text/markdown" in meta
  assert meta.split("\n\n", 1)[1].strip() == _long_description().strip()
  requires = [l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Requires-Dist")]
  core = sorted(r.split(">")[0].split("[")[0] for r in requires if "extra ==" not in r)
  assert core == ["etils", "flax", "jax", "numpy", "optax", "orbax-checkpoint", "safetensors"]
  assert any(r.startswith("tqdm") and 'extra == "examples"' in r for r in requires)
  assert any(r.startswith("chex") and 'extra == "test"' in r for r in requires)


def _long_description() -> str:
  import tomllib
  readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
  return (ROOT / readme["file"]).read_text()


def test_the_long_description_has_no_relative_link_and_no_install_from_pypi():
  """A package index shows it away from the repository: a relative link or image breaks there.
  zero_jax is not on PyPI, so no page tells users to `pip install zero_jax`."""
  text = _long_description()
  links = re.findall(r"\]\(\s*<?([^)\s>]+)|(?:src|href)=[\"']([^\"']+)", text)
  relative = [a or b for a, b in links if not re.match(r"https://", a or b)]
  assert not relative, f"{relative}: relative links break on a package index"
  for page in (ROOT / "README.md", ROOT / "docs" / "getting_started.md"):
    for t in (text, page.read_text()):
      assert not re.search(r"pip install\s+(-\S+\s+)*['\"]?zero[_-]jax\b", t, re.I), page
  tested = sum(_install_blocks(), [])
  assert set(sum(_install_blocks("docs/getting_started.md"), [])) <= set(tested), (
      "docs/getting_started.md's install lines must be README.md's (the ones the tests run)")


def test_sdist_holds_tests_examples_docs_and_benchmarks(dist):
  sdist, _ = dist
  with tarfile.open(sdist) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  for f in ("LICENSE", "CHANGELOG.md", "README.md", "conftest.py", "tests/conftest.py",
            "tests/test_train_step.py", "examples/train_lm.py", "docs/memory.png",
            "benchmarks/bench_step.py", "ci/constraints-lowest.txt", "zero_jax/py.typed"):
    assert f in names, f
  assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def _install_blocks(page: str = "README.md") -> list[list[str]]:
  """The commands of each block of a page's "Install" section, without their comments."""
  text = (ROOT / page).read_text()
  section = text[text.index("## Install"):].split("\n## ", 1)[0]
  blocks = re.findall(r"^```bash\n(.*?)^```", section, re.M | re.S)
  return [[l.split("  #")[0].strip() for l in b.splitlines() if l.strip()] for b in blocks]


def test_readme_install_lines_work_in_a_fresh_venv(dist, tmp_path):
  """Each line of the README's Install section, run in a fresh venv from the unpacked sdist
  (a clone without .git); zero_jax's dependencies come from this environment (PIP_NO_DEPS),
  and the GPU line is checked to name an extra that jax has."""
  from importlib import metadata
  sdist, _ = dist
  with tarfile.open(sdist) as t:
    t.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
  src = tmp_path / sdist.name.removesuffix(".tar.gz")
  env = tmp_path / "venv"
  venv.create(env, with_pip=True)
  py = env / "bin" / "python"
  site = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 text=True).strip()
  # jax & co. from this environment, after the venv's own site-packages (.pth lines are
  # appended to sys.path, and that directory's own .pth files, an editable zero_jax's
  # among them, are not read).
  deps = [p for p in sys.path if p.endswith("site-packages")]
  pathlib.Path(site, "deps.pth").write_text("\n".join(deps) + "\n")
  shell = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},   # no checkout on the path
           "PATH": f"{env / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(env),
           "PIP_NO_DEPS": "1", "PIP_QUIET": "1"}
  code = ("import zero_jax as zj, pathlib; f = pathlib.Path(zj.__file__).parent;"
          "print(zj.__version__, f.parent, (f / 'py.typed').is_file(),"
          " zj.DamagedCheckpointError.__name__)")
  blocks = _install_blocks()
  assert blocks[0][0] == "pip install -e ." and "python -m build" in blocks[1][0], blocks
  # The wheel's block first: with the same version installed editable, pip would keep that one.
  for line in blocks[1] + blocks[0] + sum(blocks[2:], []):
    if "cuda" in line:
      extras = re.findall(r"jax\[(\w+)\]", line)
      assert extras and set(extras) <= set(metadata.metadata("jax").get_all("Provides-Extra")), line
      continue
    proc = subprocess.run(["bash", "-c", line], cwd=src, env=shell, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (f"README install line failed: {line}\n"
                                  f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if not re.search(r"pip install (-e |\S+\.whl)", line):
      continue
    out = subprocess.check_output([py, "-c", code], text=True, cwd=tmp_path, env=shell,
                                  timeout=300).split()
    where = pathlib.Path(site) if "whl" in line else src   # the wheel's copy, or the source's
    assert out == [zj.__version__, str(where), "True", "DamagedCheckpointError"], (line, out)


def _lower_bounds() -> dict[str, str]:
  """pyproject.toml's core dependencies: name -> lower bound ('' where there is none)."""
  import tomllib
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  lower = {}
  for d in deps:
    name, _, version = d.partition(">=")
    lower[name.split("[")[0].strip()] = version.split(",")[0].strip()
  return lower


def test_lower_bounds_are_the_versions_the_lower_bounds_job_pins():
  """pyproject.toml's lower bounds and ci/constraints-lowest.txt cannot drift apart."""
  lower = _lower_bounds()
  pins = dict(line.split("==") for line in (ROOT / "ci" / "constraints-lowest.txt").read_text()
              .splitlines() if line and not line.startswith("#"))
  assert all(lower.values()), f"every core dependency needs a lower bound: {lower}"
  assert {k: pins.get(k) for k in lower} == lower
  assert pins["jaxlib"] == pins["jax"]


def test_readme_and_changelog_state_pyprojects_lower_bounds():
  """One source of truth: every 'jax 0.10.0'-style version the README or the unreleased
  CHANGELOG section names is pyproject.toml's lower bound, and the README names the four."""
  lower = _lower_bounds()
  names = "|".join(sorted(map(re.escape, lower), key=len, reverse=True))
  changelog = (ROOT / "CHANGELOG.md").read_text()
  unreleased = changelog[changelog.index("## [Unreleased]"):].split("\n## [", 1)[0]
  stated = {}
  for where, text in (("README.md", (ROOT / "README.md").read_text()),
                      ("CHANGELOG.md's [Unreleased] section", unreleased)):
    stated[where] = re.findall(rf"(?<![\w-])({names})\s+v?(\d+(?:\.\d+)+)", text)
    wrong = {f"{n} {v}": lower[n] for n, v in stated[where] if v != lower[n]}
    assert not wrong, f"{where} states versions that are not pyproject.toml's lower bounds: {wrong}"
  named = {n for n, _ in stated["README.md"]}
  assert {"jax", "flax", "optax", "orbax-checkpoint"} <= named, named
