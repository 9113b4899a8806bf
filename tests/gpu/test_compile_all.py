"""Every kind of step zero_jax builds compiles for H100s, one host of 8 and two hosts of 8:
every collective an async start/done pair, the collectives the design expects, and no host
transfer. A combination that cannot compile for compile-only GPUs is refused at build time."""

import collections
import re

import pytest

from zero_jax.comm import hlo
from zero_jax.gpu import schedule

from _compile_cases import CASES, compile_case, lower_case  # pylint: disable=import-error

# Async collectives per step (the MLP's three leaves move in one bucket): stages 1-2
# reduce-scatter the gradient and all-gather the updated parameters; stage 3 gathers in the
# forward pass and again in the backward (rematerialised), one gather with gather_once; qgZ
# turns the reduce-scatter into an all-to-all of integers (and a qwZ gather's int8 values
# are gathered once: the backward pass reuses them); a replica axis adds the gradient's
# all-reduce across replicas (and its scalars'); hpZ gathers within the host from its
# secondary copy, reduces in two hops and refreshes the copy after the update; the tensor-
# parallel mesh moves the model-split leaves' blocks (collective-permutes, a gather over
# "model"). Every step all-reduces its scalars (the loss, the gradient's norm) once. A layer
# scan gathers in its forward and backward loops and reduce-scatters in the backward one:
# with prefetch, two layers an iteration (each loop's collectives twice) and the end layers
# outside; without, XLA peels one backward iteration out of its loop.
EXPECTED = {
    "stage1": {"reduce-scatter": 1, "all-gather": 1, "all-reduce": 1},
    "stage2": {"reduce-scatter": 1, "all-gather": 1, "all-reduce": 1},
    "stage3": {"all-gather": 2, "reduce-scatter": 1, "all-reduce": 1},
    "bf16": {"all-gather": 2, "reduce-scatter": 1, "all-reduce": 1},
    "fp16_dynamic": {"reduce-scatter": 1, "all-gather": 1, "all-reduce": 1},
    "accum_local": {"reduce-scatter": 1, "all-gather": 1, "all-reduce": 1},
    "accum_sharded": {"all-gather": 2, "reduce-scatter": 1, "all-reduce": 1},
    "gather_once": {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 1},
    "replica_axis": {"all-gather": 2, "reduce-scatter": 1, "all-reduce": 3},
    "param_specs": {"collective-permute": 2, "all-gather": 3, "reduce-scatter": 1,
                    "all-reduce": 2},
    "hpz": {"all-gather": 3, "reduce-scatter": 2, "all-reduce": 2},
    "int8": {"all-gather": 1, "all-to-all": 1, "all-reduce": 1},
    "int4": {"all-gather": 1, "all-to-all": 1, "all-reduce": 1},
    "scan_prefetch0": {"all-gather": 3, "reduce-scatter": 2, "all-reduce": 1},
    "scan_prefetch1": {"all-gather": 7, "reduce-scatter": 3, "all-reduce": 1},
    "nnx": {"all-gather": 2, "reduce-scatter": 1, "all-reduce": 1},
    "linen": {"reduce-scatter": 1, "all-gather": 1, "all-reduce": 1},
}
# On two hosts: hybrid sharding reduces and gathers within each host and all-reduces the
# gradient block and the loss across (the gradient norm's sum stays within the host: each
# host holds the whole gradient); hpZ gathers within the host and crosses it to reduce the
# gradient's second hop, to refresh its secondary copy and for the scalars.
CROSSING = {"replica_axis": {"all-reduce": 2},
            "hpz": {"reduce-scatter": 1, "all-gather": 1, "all-reduce": 2}}
COMPILED = [n for n in CASES if n != "offload"]


def async_collectives(text) -> collections.Counter:
  comps = hlo._computations(text)  # pylint: disable=protected-access
  return collections.Counter(
      re.sub(r"-start$", "", i.op) for lines in comps.values()
      for i in filter(None, map(hlo.parse_instruction, lines)) if i.op.endswith("-start"))


def host_transfers(text) -> list:
  """Lines that place a buffer in host memory (memory space 5) or move one there."""
  return [l for l in text.splitlines()
          if "S(5)" in l or re.search(r'custom_call_target="(MoveToHost|MoveToDevice)"', l)]


@pytest.mark.parametrize("hosts", [1, 2], ids=["8", "2x8"])
@pytest.mark.parametrize("name", COMPILED)
def test_each_step_compiles_for_gpus_with_async_collectives_only(name, hosts):
  text = compile_case(name, hosts).as_text()
  assert not schedule.synchronous(text)
  assert dict(async_collectives(text)) == EXPECTED[name]
  assert not host_transfers(text)
  if hosts == 2 and name in CROSSING:  # which collectives leave the host (devices 8-15)
    crossing = collections.Counter(c.op for c in hlo.collectives(text)
                                   if any(len({d // 8 for d in g}) > 1 for g in c.groups or ()))
    assert dict(crossing) == CROSSING[name]
  if name.startswith("scan"):  # the layer loops: a gather forward, a gather and a reduce back
    loops = [[w.op for w in l.windows] for l in schedule.loops(text) if l.windows]
    k = 2 if name == "scan_prefetch1" else 1  # layers an iteration
    assert sorted(map(sorted, loops)) == [["all-gather"] * k,
                                          ["all-gather"] * k + ["reduce-scatter"] * k]


@pytest.mark.parametrize("hosts", [1, 2], ids=["8", "2x8"])
def test_offload_on_compile_only_gpus_is_refused_at_build_time_saying_what_to_do(hosts):
  """Compile-only devices list no memory kinds: JAX would drop ``pinned_host`` silently."""
  with pytest.raises(ValueError, match=r"cannot be compiled on compile-only devices.*"
                                       r"memory_report\(\.\.\., offload='optimizer'\)"):
    lower_case("offload", hosts)
