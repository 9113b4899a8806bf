"""GPUs without a GPU: targets as data, compile-only meshes, and what their programs show.

The family's files in the order work flows through them: `targets` (the cards' figures and
compile-only meshes of them), `candidates` (the planner's search space, pruned by the memory
formulas), `measure` (one candidate compiled for a target and read), `schedule` (what XLA:GPU
scheduled inside each async collective's window), `predict` (how much communication a compiled
program leaves exposed on a target: a prediction, not a measurement), `plan` (`zero_jax.plan`:
the fastest candidate that fits).
"""

from zero_jax.gpu.targets import (A100, H100, H200, TARGETS, Target, compile_only_mesh,
                                  get_target, target_config)
from zero_jax.gpu.plan import Candidate, Plan
