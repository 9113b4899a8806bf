"""GPUs without a GPU: targets as data, compile-only meshes, and what their programs show.

The family's files in the order work flows through them: `targets` (the cards' figures and
compile-only meshes of them), `candidates` (the planner's search space, its fallbacks, and the
memory formulas that prune it), `measure` (one candidate compiled for a target and read),
`program` (what an HLO program does: loops, matmuls, memory-bound kernels, collectives),
`links` (how long one collective takes on a target's links, within and across hosts),
`predict` (how long a program takes on a target, and how much communication it leaves
exposed: a prediction, not a measurement), `schedule` (what XLA:GPU scheduled inside each
async collective's window) and `timeline` (the compiled schedule walked kernel by kernel, the
links shared by the collectives on them), `search` (how the planner ranks candidates and settles whether
anything fits), `plan` (`zero_jax.plan`: the fastest candidate that fits).
"""

from zero_jax.gpu.targets import (A100, DGX_A100_GBPS, DGX_H100_GBPS, H100, H200, TARGETS,
                                  Target, compile_only_mesh, get_target, target_config,
                                  with_network)
from zero_jax.gpu.plan import Candidate, Plan
