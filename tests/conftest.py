"""Shared fixtures; the 8 fake CPU devices are set up by the root conftest.py."""

import jax
import pytest


@pytest.fixture(scope="session")
def mesh():
  """The 8-device mesh with one "data" axis (Explicit axis types, as jax.make_mesh makes)."""
  return jax.make_mesh((8,), ("data",))


@pytest.fixture(autouse=True)
def _deliver_pending_warnings():
  """After each test, the health warnings its steps left pending are raised, so a warning a
  test does not expect fails that test (pyproject's filterwarnings), not a later one whose
  CheckpointManager.save or step object's deletion would deliver it."""
  yield
  from zero_jax.step import monitor  # pylint: disable=g-import-not-at-top
  monitor.deliver()


@pytest.fixture
def full_compile(monkeypatch):
  """The steps a test builds compile with XLA's default (tests/_compile.py), not the root
  conftest.py's quicker kernels: for a test that pins two different programs to the same
  bits, as users compile them."""
  from _compile import FULL_COMPILE  # pylint: disable=g-import-not-at-top
  from zero_jax.step import compile_options  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(compile_options, "COMPILER_OPTIONS",
                      {**compile_options.COMPILER_OPTIONS, **FULL_COMPILE})
