"""Prints zero_jax's runtime requirements, one per line, from pyproject.toml (what
``pip install -e .`` pulls): ``.ci/run`` installs them into its other venvs ahead of time."""

import pathlib
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
print("\n".join(tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]))
