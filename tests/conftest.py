"""Tests run on 8 fake CPU devices (set before the backend starts)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def mesh():
  """The 8-device mesh with one "data" axis (Explicit axis types, as jax.make_mesh makes)."""
  return jax.make_mesh((8,), ("data",))
