"""Compile-only GPU meshes: targets as data, hosts laid out in order, clear errors."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax import gpu


@pytest.mark.parametrize("key", sorted(gpu.TARGETS))
def test_each_target_compiles_a_step_and_reports_its_memory(key):
  mesh = zj.compile_only_mesh((8,), ("data",), gpu=key)
  assert mesh.devices.flat[0].platform == "gpu"
  step = zj.make_sharded_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1),
                                    mesh=mesh)
  params = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}
  compiled = step.lower(step.abstract_state(params),
                        jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile()
  assert compiled.memory_analysis().argument_size_in_bytes >= 64 * 32 * 4


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_beside_a_model_axis_sums_bf16_on_the_gpu_wire(stage):
  """Only XLA:CPU gets its bfloat16 sums widened beside model axes
  (tests/test_meshes.py): a GPU step keeps its gradient reduce-scatter in bfloat16 (stage
  3's transposed gather; stage 2's with ``comm_dtype=bfloat16``)."""
  mesh = zj.compile_only_mesh((4, 2), ("data", "model"), gpu="h100")
  loss = lambda p, b: jnp.mean(jnp.tanh(b @ p["w1"]) @ p["w2"])
  step = zj.make_sharded_train_step(
      loss, optax.sgd(0.1), mesh=mesh, stage=stage, precision="bf16",
      param_specs={"w1": P(None, "model"), "w2": P("model", None)},
      comm_dtype=jnp.bfloat16 if stage == 2 else None)
  assert not step.spec.comm.bf16_sums_in_f32
  params = {"w1": jax.ShapeDtypeStruct((64, 32), jnp.float32),
            "w2": jax.ShapeDtypeStruct((32, 16), jnp.float32)}
  hlo = step.lower(step.abstract_state(params),
                   jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile().as_text()
  types = [m.group(1) for m in re.finditer(r"= (.*?) reduce-scatter(?:-start)?\(", hlo)]
  assert types and all("bf16[" in t and "f32[" not in t for t in types), types


def test_hosts_are_laid_out_along_the_first_axis():
  mesh = zj.compile_only_mesh((2, 8), ("hosts", "data"), gpu="h100", hosts=2)
  assert [[d.process_index for d in row] for row in mesh.devices] == [[0] * 8, [1] * 8]
  assert len({d.id for d in mesh.devices.flat}) == 16


def test_a_shape_that_does_not_hold_the_cluster_is_refused():
  with pytest.raises(ValueError, match=r"holds 8 devices, but hosts=2 x per_host=8 is 16"):
    zj.compile_only_mesh((8,), ("data",), hosts=2)


def test_an_unknown_gpu_is_refused_naming_the_known_ones():
  with pytest.raises(ValueError, match=r"gpu='v100'.*'a100', 'h100', 'h200'"):
    zj.compile_only_mesh((8,), ("data",), gpu="v100")


def test_the_target_config_states_the_cards_own_figures():
  text = gpu.target_config(gpu.H200)
  assert f"device_memory_size: {gpu.H200.memory_bytes}" in text
  assert "core_count: 132" in text and 'platform_name: "CUDA"' in text
