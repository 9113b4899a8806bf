"""XLA's default compile, for tests that pin two different programs to the same bits.

The root conftest.py generates XLA:CPU's kernels the quicker way (see its docstring). Two programs
that compute the same values in a different order or fusion then round differently more often
than the default compile lets them, so a test that asserts bit-for-bit equality of two
*different* programs compiles both with ``FULL_COMPILE`` (what a user's ``jax.jit`` gets).
"""

FULL_COMPILE = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
                "xla_cpu_use_fusion_emitters": True}
