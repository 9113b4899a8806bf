"""The GPU compile tier: steps compiled for compile-only H100/H200/A100 meshes, no GPU needed.

These tests need JAX's CUDA plugin (``.ci/run`` installs it in its own venv, ``.venv-gpu``);
where it is missing they are skipped, and the tier's CI job fails on any skip
(``ZERO_JAX_GPU_TIER=1`` turns a missing plugin into an error).
"""

import os

import jax
import pytest


def _plugin_present() -> bool:
  try:
    import jax_plugins.xla_cuda12  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    return True
  except ImportError:
    return False


if _plugin_present():
  # The root conftest.py shares a compilation cache among the suite's processes, but a program
  # compiled for compile-only devices cannot be read back from it ("PjRtCompiler must be
  # constructed with a Client"): off for this process and the ones its tests start.
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  jax.config.update("jax_enable_compilation_cache", False)


def pytest_collection_modifyitems(config, items):
  if _plugin_present():
    return
  if os.environ.get("ZERO_JAX_GPU_TIER") == "1":
    raise pytest.UsageError("ZERO_JAX_GPU_TIER=1 but JAX's CUDA plugin is not installed: "
                            "pip install jax-cuda12-plugin jax-cuda12-pjrt == jax's version.")
  skip = pytest.mark.skip(reason="needs JAX's CUDA plugin (the GPU compile tier's venv)")
  for item in items:
    if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
      item.add_marker(skip)
