"""The package as users get it: metadata, sdist and wheel contents, and an install of the wheel."""

import importlib.util
import os
import pathlib
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
  requires = [l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Requires-Dist")]
  core = sorted(r.split(">")[0].split("[")[0] for r in requires if "extra ==" not in r)
  assert core == ["etils", "flax", "jax", "numpy", "optax", "orbax-checkpoint"]
  assert any(r.startswith("tqdm") and 'extra == "examples"' in r for r in requires)
  assert any(r.startswith("chex") and 'extra == "test"' in r for r in requires)


def test_sdist_holds_tests_examples_docs_and_benchmarks(dist):
  sdist, _ = dist
  with tarfile.open(sdist) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
  for f in ("LICENSE", "CHANGELOG.md", "README.md", "conftest.py", "tests/conftest.py",
            "tests/test_train_step.py", "examples/train_lm.py", "docs/memory.png",
            "benchmarks/bench_step.py", "ci/constraints-lowest.txt", "zero_jax/py.typed"):
    assert f in names, f
  assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


def test_wheel_installs_into_a_fresh_venv_and_imports(dist, tmp_path):
  """Installed without the checkout on the path; dependencies from this environment."""
  _, wheel = dist
  env = tmp_path / "venv"
  venv.create(env, with_pip=True)
  py = env / "bin" / "python"
  site = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 text=True).strip()
  clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # no checkout on the path
  subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                 check=True, timeout=300, cwd=tmp_path, env=clean)
  # jax & co. from this environment, after the venv's own site-packages (.pth lines are
  # appended to sys.path, and that directory's own .pth files, an editable zero_jax's
  # among them, are not read).
  deps = [p for p in sys.path if p.endswith("site-packages")]
  pathlib.Path(site, "deps.pth").write_text("\n".join(deps) + "\n")
  code = ("import zero_jax as zj, pathlib; f = pathlib.Path(zj.__file__);"
          "print(zj.__version__, f.parent.parent == pathlib.Path(%r), (f.parent / 'py.typed').is_file(),"
          " zj.DamagedCheckpointError.__name__)" % site)
  out = subprocess.check_output([py, "-c", code], text=True, cwd=tmp_path, env=clean,
                                timeout=300)
  assert out.split() == [zj.__version__, "True", "True", "DamagedCheckpointError"]


def test_lower_bounds_are_the_versions_the_lower_bounds_job_pins():
  """pyproject.toml's lower bounds and ci/constraints-lowest.txt cannot drift apart."""
  import tomllib
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  lower = {}
  for d in deps:
    name, _, version = d.partition(">=")
    lower[name.split("[")[0].strip()] = version.split(",")[0].strip()
  pins = dict(line.split("==") for line in (ROOT / "ci" / "constraints-lowest.txt").read_text()
              .splitlines() if line and not line.startswith("#"))
  assert all(lower.values()), f"every core dependency needs a lower bound: {deps}"
  assert {k: pins.get(k) for k in lower} == lower
  assert pins["jaxlib"] == pins["jax"]
