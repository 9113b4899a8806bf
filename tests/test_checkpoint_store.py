"""The checkpoint storage seam: the manager's save/restore/damage behaviour on each store.

`OrbaxStore` (the default) and `DirectoryStore` (plain ``.npz``) pass the same tests:
an exact round trip onto another number of devices and stage, bf16 with a master copy,
keys in the state, ``max_to_keep``, and damage (a truncated or deleted file) named and
skipped with a warning, or refused when asked for by step.
"""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from zero_jax.checkpoint.store import DirectoryStore, OrbaxStore

STORES = {"orbax": OrbaxStore, "directory": DirectoryStore}


def loss_fn(p, b, *, rng):
  noise = 0.0 * jax.random.normal(rng, b["x"].shape)  # the key travels; the numbers do not depend on it
  return jnp.mean(((b["x"] + noise) @ p["w"] + p["b"] - b["y"]) ** 2)


def params():
  r = np.random.default_rng(0)
  return {"w": r.normal(size=(9, 5)).astype(np.float32), "b": np.zeros(5, np.float32)}


def batch(i):
  r = np.random.default_rng(20 + i)
  return {"x": r.normal(size=(16, 9)).astype(np.float32),
          "y": r.normal(size=(16, 5)).astype(np.float32)}


def make(n, stage, precision="fp32"):
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
  return zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=stage,
                                    precision=precision)


def run(step, state, steps):
  for i in steps:
    state, _ = step(state, batch(i))
  return state


def host(tree):
  return jax.tree.map(np.asarray, tree)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_round_trip_onto_another_mesh_and_stage_continues_exactly(tmp_path, store, precision):
  a = make(8, 2, precision)
  state = run(a, a.init(params(), rng=jax.random.key(3)), range(2))
  with zj.CheckpointManager(tmp_path, store=STORES[store], async_save=False) as mngr:
    mngr.save(state)
    b = make(4, 3) if precision == "fp32" else make(8, 2, precision)  # bf16: same mesh
    restored = mngr.restore(b, params(), rng=jax.random.key(0))
  assert int(restored.step) == 2
  np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(state.rng))
  want, got = run(a, state, [2, 3]), run(b, restored, [2, 3])
  for k, v in host(a.get_params(want)).items():
    np.testing.assert_allclose(host(b.get_params(got))[k], v, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("store", STORES)
def test_max_to_keep_and_listing(tmp_path, store):
  step = make(8, 2)
  state = step.init(params(), rng=jax.random.key(3))
  with zj.CheckpointManager(tmp_path, store=STORES[store], max_to_keep=2,
                            async_save=False) as mngr:
    for i in range(3):
      state = run(step, state, [i])
      mngr.save(state)
    assert mngr.all_steps() == [2, 3]
    assert mngr.metadata()["step"] == 3


def _largest_file(step_dir: pathlib.Path) -> pathlib.Path:
  files = [p for p in step_dir.rglob("*") if p.is_file() and "record" not in p.name]
  return max(files, key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_newest_step_is_named_skipped_or_refused(tmp_path, store, damage):
  step = make(8, 2)
  state = step.init(params(), rng=jax.random.key(3))
  with zj.CheckpointManager(tmp_path, store=STORES[store], async_save=False) as mngr:
    for i in range(2):
      state = run(step, state, [i])
      mngr.save(state)
  victim = _largest_file(tmp_path / "2")
  if damage == "truncate":
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
  else:
    os.remove(victim)
  with zj.CheckpointManager(tmp_path, store=STORES[store]) as mngr:
    assert mngr.all_steps() == [1]
    with pytest.warns(zj.DamagedCheckpointWarning, match=r"step 2 .* is damaged"):
      restored = mngr.restore(step, params(), rng=jax.random.key(0))
    assert int(restored.step) == 1
    with pytest.raises(zj.DamagedCheckpointError, match=r"step 2"):
      mngr.restore(step, params(), rng=jax.random.key(0), step=2)
