"""Tests and docstring examples run on 8 fake CPU devices (set before the backend starts).

Root-level so that both ``pytest`` (tests/) and ``pytest --doctest-modules zero_jax``
get the same devices.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
