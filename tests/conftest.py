"""Shared fixtures; the 8 fake CPU devices are set up by the root conftest.py."""

import jax
import pytest


@pytest.fixture(scope="session")
def mesh():
  """The 8-device mesh with one "data" axis (Explicit axis types, as jax.make_mesh makes)."""
  return jax.make_mesh((8,), ("data",))
