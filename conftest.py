"""Tests and docstring examples run on 8 fake CPU devices (set before the backend starts).

Root-level so that both ``pytest`` (tests/) and ``pytest --doctest-modules zero_jax``
get the same devices.

Compiling is most of the suite's time (its programs are small), so two settings cut it. Neither
changes the math a program does; the first changes how its kernels round, so that two
different programs agree to the bit less often than under XLA's default compile:

* XLA:CPU's kernels are generated the quicker way (``XLA_FLAGS``): LLVM's optimisation turned
  down and the older elemental emitter instead of the MLIR fusion emitters (together half the
  suite's compile time). XLA's own HLO passes, fusion, scheduling and buffer assignment still
  run. A test that pins two different programs to the same bits compiles them with XLA's
  default (the ``full_compile`` fixture, or tests/_compile.py).
* One compilation cache on disk is shared by the session's processes (the pytest-xdist
  workers and every process a test starts inherit it), so a program that several tests
  compile is compiled once. It lives in a temporary folder, removed at the end.

Set ``ZERO_JAX_TEST_FULL_COMPILE=1`` to test with XLA's default compile instead.
"""

import atexit
import os
import shutil
import tempfile

if not os.environ.get("ZERO_JAX_TEST_FULL_COMPILE"):
  _FAST = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
           "--xla_cpu_use_fusion_emitters=false")
  if _FAST not in os.environ.get("XLA_FLAGS", ""):  # not again in the processes it starts
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST}".strip()
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the first process: it owns the cache
    _cache = tempfile.mkdtemp(prefix="zero_jax_test_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
