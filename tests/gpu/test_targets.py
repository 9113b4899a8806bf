"""Compile-only GPU meshes: targets as data, hosts laid out in order, clear errors."""

import jax
import jax.numpy as jnp
import optax
import pytest

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
