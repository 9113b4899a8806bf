"""XLA's default compile, for tests that pin two different programs to the same bits.

The root conftest.py generates XLA:CPU's kernels the quicker way (see its docstring). Two programs
that compute the same values in a different order or fusion then round differently more often
than the default compile lets them, so a test that asserts bit-for-bit equality of two
*different* programs compiles both with ``FULL_COMPILE`` (what a user's ``jax.jit`` gets).
"""

import os

# Whether the root conftest.py's quicker compile is on (ZERO_JAX_TEST_FULL_COMPILE=1: off).
QUICK_COMPILE = not os.environ.get("ZERO_JAX_TEST_FULL_COMPILE")
FULL_COMPILE = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                "xla_cpu_use_fusion_emitters": True}


def rerun_with_full_compile(request) -> None:
  """Runs the calling test again in a fresh pytest process with XLA's default compile
  everywhere (eager operations included, which ``FULL_COMPILE`` per compile cannot reach), and
  fails with its output if that run fails."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  env = {**os.environ, "ZERO_JAX_TEST_FULL_COMPILE": "1"}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "-p", "no:xdist", request.node.nodeid], cwd=request.config.rootpath,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
