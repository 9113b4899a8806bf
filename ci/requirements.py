"""Prints zero_jax's runtime requirements, one per line, from pyproject.toml (what
``pip install -e .`` pulls), and those of the extras named as arguments (``python3
ci/requirements.py examples``): ``.ci/run`` installs them into its other venvs ahead of time."""

import pathlib
import sys
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
project = tomllib.loads(PYPROJECT.read_text())["project"]
extras = [r for name in sys.argv[1:] for r in project["optional-dependencies"][name]]
print("\n".join(project["dependencies"] + extras))
