"""GPUs without a GPU: targets as data, compile-only meshes, and what their programs show.

The flow of the family: `targets` (the cards' figures and compile-only meshes of them).
"""

from zero_jax.gpu.targets import (A100, H100, H200, TARGETS, Target, compile_only_mesh,
                                  get_target)
from zero_jax.gpu.targets import target_config
