"""Checkpoints: save on one mesh, restore on another size or stage, continue exactly.

The parent (this pytest process, 8 CPU devices) trains 3 steps of several
runs, saves each asynchronously and goes straight on to step 6 (the
uninterrupted run, which also donates the buffers being written). One fresh
child process (`_child_restore`, meshes over the first M of its 8 devices)
restores every checkpoint onto other mesh sizes and stages and trains steps
4-6; its results must equal the single-device optax reference (or, for a run
whose random keys depend on the device count, the parent's own uninterrupted
run). The same child first loads an exported parameter set with plain
Orbax/Flax code before zero_jax is imported. A second child is killed with
SIGKILL in the middle of a save.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pathlib
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import flax
import flax.linen as nn
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import zero_jax as zj
from zero_jax.step.signature import optimizer_signature

ROOT = pathlib.Path(__file__).resolve().parent.parent
GLOBAL_BATCH = 24  # divisible by every mesh size used: 1, 2, 3, 4, 8
LR = 1e-2


class MLP(nn.Module):
  """Uneven leaves (9 over 8 devices, a scalar) so padding changes with N."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(9)(x))
    temperature = self.param("temperature", nn.initializers.ones, ())
    return nn.Dense(3)(h) * temperature


MODEL = MLP()
_r = np.random.RandomState(0)
BATCHES = [{"x": _r.randn(GLOBAL_BATCH, 5).astype(np.float32),
            "y": _r.randn(GLOBAL_BATCH, 3).astype(np.float32)} for _ in range(6)]
X_EVAL = _r.randn(7, 5).astype(np.float32)
MODEL_STATE = {"count": np.zeros((), np.int32), "ema": np.zeros((5,), np.float32)}


def init_params():
  return jax.tree.map(np.asarray, MODEL.init(jax.random.key(0), X_EVAL)["params"])


def loss_fn(params, batch):
  return jnp.mean((MODEL.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def loss_fn_rng(params, batch, *, model_state, rng):
  """Dropout from the step's key, and a model state updated every step."""
  out = MODEL.apply({"params": params}, batch["x"])
  keep = jax.random.bernoulli(rng, 0.75, out.shape)
  loss = jnp.mean((jnp.where(keep, out / 0.75, 0.0) - batch["y"]) ** 2)
  new_ms = {"count": model_state["count"] + 1,
            "ema": 0.9 * model_state["ema"] + 0.1 * batch["x"].mean(0)}
  return loss, new_ms


OPTIMIZERS = {"adam": lambda: optax.adam(LR), "sgd": lambda: optax.sgd(0.1),
              "adamw": lambda: optax.adamw(LR, weight_decay=0.1)}

# name: how the run that is saved at step 3 is built (optimizer, mesh size, stage,
# precision, with rng and model state), and the (mesh size, stage) it is restored onto.
SOURCES = {
    "adam8": dict(opt="adam", n=8, stage=2, precision="fp32", rng=False),
    "adam4": dict(opt="adam", n=4, stage=2, precision="fp32", rng=False),
    "sgd8s3": dict(opt="sgd", n=8, stage=3, precision="fp32", rng=False),
    "rng8": dict(opt="adamw", n=8, stage=2, precision="fp32", rng=True),
    "fp16s3": dict(opt="adam", n=8, stage=3, precision="fp16", rng=False),
}
TARGETS = {
    "adam8": [(4, 2), (1, 2), (8, 3), (3, 3)],   # 8->4, 8->1, stage 2->3, both at once
    "adam4": [(8, 2)],                           # 4->8
    "sgd8s3": [(4, 2), (2, 3)],                  # stage 3->2 with 8->4; 8->2
    "rng8": [(8, 3)],                            # keys fold in the device index: same N
    "fp16s3": [(4, 2)],                          # master copy, loss scale, 3->2, 8->4
}
CASES = [(src, m, s) for src, targets in TARGETS.items() for m, s in targets]


def mesh_of(m: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:m]), ("data",))


def make_step(src: str, m: int, stage: int):
  cfg = SOURCES[src]
  return zj.make_sharded_train_step(
      loss_fn_rng if cfg["rng"] else loss_fn, OPTIMIZERS[cfg["opt"]](), mesh=mesh_of(m),
      stage=stage, precision=cfg["precision"])


def init_kwargs(src: str) -> dict:
  if SOURCES[src]["rng"]:
    return {"model_state": MODEL_STATE, "rng": jax.random.key(42)}
  return {}


def logical(step, state) -> dict:
  """Host copies of everything in a state, in logical (unpadded) views."""
  meta = state.meta
  out = {"step": np.asarray(state.step)}
  for k, v in jax.tree_util.tree_flatten_with_path(step.get_params(state))[0]:
    out["params" + jax.tree_util.keystr(k)] = np.asarray(v, np.float32)
  o_paths = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  for (k, v), l in zip(o_paths, meta.opt_layouts):  # padding is trailing: slice it off
    out["opt" + jax.tree_util.keystr(k)] = np.asarray(v)[tuple(slice(0, d) for d in l.shape)]
  for name in ("loss_scale", "model_state"):
    for k, v in jax.tree_util.tree_flatten_with_path(getattr(state, name))[0]:
      out[name + jax.tree_util.keystr(k)] = np.asarray(v)
  if state.rng is not None:
    out["rng"] = np.asarray(jax.random.key_data(state.rng))
  return out


@functools.lru_cache(maxsize=None)
def reference(opt_name: str, steps: int) -> dict:
  """Plain single-device optax, keyed like `logical`."""
  opt = OPTIMIZERS[opt_name]()
  params = jax.device_put(init_params(), jax.devices()[0])
  opt_state = opt.init(params)

  @jax.jit
  def update(p, s, b):
    g = jax.grad(loss_fn)(p, b)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  for b in BATCHES[:steps]:
    params, opt_state = update(params, opt_state, b)
  out = {"step": np.asarray(steps, np.int32)}
  for k, v in jax.tree_util.tree_flatten_with_path(params)[0]:
    out["params" + jax.tree_util.keystr(k)] = np.asarray(v)
  for k, v in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
    out["opt" + jax.tree_util.keystr(k)] = np.asarray(v)
  return out


def assert_close(got: dict, want: dict, rtol: float, what: str):
  keys = [k for k in want if not k.startswith(("loss_scale", "rng", "model_state"))]
  assert set(keys) <= set(got), f"{what}: missing {set(keys) - set(got)}"
  for k in keys:
    a, b = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
    assert a.shape == b.shape, f"{what} {k}: shape {a.shape} != {b.shape}"
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err <= rtol, f"{what} {k}: relative error {err:.2e} > {rtol:.0e}"


# ---------------------------------------------------------------- children
def _child_env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  return env


# Plain user code: loads an export with Orbax and Flax only, before zero_jax exists.
_PLAIN_LOAD = r"""
import sys, jax, jax.numpy as jnp, numpy as np, flax.linen as nn, orbax.checkpoint as ocp
jax.config.update("jax_num_cpu_devices", 8)
class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(9)(x))
    return nn.Dense(3)(h) * self.param("temperature", nn.initializers.ones, ())
export, x, out = sys.argv[1], np.load(sys.argv[2]), sys.argv[3]
params = ocp.StandardCheckpointer().restore(export)                    # numpy, no target
abstract = jax.eval_shape(MLP().init, jax.random.key(0), x)["params"]  # onto one device
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract)
params2 = ocp.StandardCheckpointer().restore(export, abstract)
assert "zero_jax" not in sys.modules
np.savez(out, plain=np.asarray(MLP().apply({"params": params}, x)),
         targeted=np.asarray(MLP().apply({"params": params2}, x)))
"""


def _child_restore(work: pathlib.Path):
  """Restores every case onto its (mesh size, stage) and trains steps 4-6."""
  results = {}
  for src, m, stage in CASES:
    step = make_step(src, m, stage)
    kw = init_kwargs(src)
    with zj.CheckpointManager(work / src) as mngr:
      state = mngr.restore(step, init_params(), **kw)
    tag = f"{src}/{m}/{stage}"
    for k, v in logical(step, state).items():
      results[f"{tag}/at3/{k}"] = v
    for b in BATCHES[3:]:
      state, metrics = step(state, b)
    for k, v in logical(step, state).items():
      results[f"{tag}/at6/{k}"] = v
  np.savez(work / "child.npz", **results)


def _child_kill(work: pathlib.Path):
  """Trains from step 3 to 6 and saves; the parent kills it before the save commits."""
  from orbax.checkpoint._src.path import atomicity
  step = make_step("adam8", 8, 2)
  with zj.CheckpointManager(work / "killed", max_to_keep=1) as mngr:
    state = mngr.restore(step, init_params())
    for b in BATCHES[3:]:
      state, _ = step(state, b)
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def stalled_finalize(self):
      if self._final_path.name == "6":  # every array written; only the commit is left
        (work / "in_save").write_text(str(self._tmp_path))
        await asyncio.sleep(600)
      return await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = stalled_finalize
    mngr.save(state)
    mngr.wait_until_finished()


# ----------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def steps():
  """One compiled step per source run (reused by the in-process tests)."""
  return {src: make_step(src, cfg["n"], cfg["stage"]) for src, cfg in SOURCES.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, steps):
  """Saves every source run at step 3 (async) and continues it to step 6."""
  work = tmp_path_factory.mktemp("ckpt")
  at3, at6 = {}, {}
  for src in SOURCES:
    step = steps[src]
    state = step.init(init_params(), **init_kwargs(src))
    for b in BATCHES[:3]:
      state, _ = step(state, b)
    at3[src] = logical(step, state)
    mngr = zj.CheckpointManager(work / src, max_to_keep=2)
    assert mngr.save(state)
    for b in BATCHES[3:]:  # donates the state while Orbax may still be writing it
      state, _ = step(state, b)
    at6[src] = logical(step, state)
    mngr.close()
  return work, at3, at6


@pytest.fixture(scope="module")
def export(saved, steps):
  """Parameters of the adam8 run at step 6, exported, and the model's outputs on them."""
  work, _, _ = saved
  step = steps["adam8"]
  state = step.init(init_params())
  for b in BATCHES:
    state, _ = step(state, b)
  params = step.get_params(state)
  zj.export_params(work / "export", params)
  return work / "export", np.asarray(MODEL.apply({"params": params}, X_EVAL))


@pytest.fixture(scope="module")
def child(saved, export):
  """One fresh process: plain-Orbax export load, then every restore case."""
  work, _, _ = saved
  np.save(work / "x_eval.npy", X_EVAL)
  code = (_PLAIN_LOAD + "\nimport runpy\nsys.argv = [sys.argv[0], 'restore', sys.argv[4]]\n"
          f"runpy.run_path({str(pathlib.Path(__file__))!r}, run_name='__main__')\n")
  proc = subprocess.run(
      [sys.executable, "-c", code, str(export[0]), str(work / "x_eval.npy"),
       str(work / "plain.npz"), str(work)],
      env=_child_env(), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with np.load(work / "child.npz") as f:
    results = dict(f)
  with np.load(work / "plain.npz") as f:
    plain = dict(f)
  return results, plain


def _case(results: dict, tag: str, when: str) -> dict:
  prefix = f"{tag}/{when}/"
  return {k[len(prefix):]: v for k, v in results.items() if k.startswith(prefix)}


# -------------------------------------------------------------------- tests
@pytest.mark.parametrize("src,m,stage", CASES, ids=[f"{s}-to-{m}dev-stage{t}" for s, m, t in CASES])
def test_restore_on_other_mesh_or_stage_continues_like_uninterrupted_run(child, saved, src, m,
                                                                         stage):
  _, at3, at6 = saved
  results, _ = child
  tag = f"{src}/{m}/{stage}"
  # The restored state is the saved one, bit for bit (in logical views).
  got3 = _case(results, tag, "at3")
  assert set(got3) == set(at3[src])
  for k, v in at3[src].items():
    np.testing.assert_array_equal(got3[k], v, err_msg=f"{tag} {k} at restore")
  got6 = _case(results, tag, "at6")
  cfg = SOURCES[src]
  if cfg["precision"] != "fp32":
    # fp16 rounding depends on how the batch is split; the restore itself is exact,
    # dynamic loss-scale counters included.
    assert int(got3["loss_scale.good_steps"]) + int(got3["loss_scale.skipped_steps"]) == 3
    for k, v in got6.items():
      assert np.all(np.isfinite(v.astype(np.float64))), f"{tag} {k}"
    assert int(got6["step"]) == 6
  elif cfg["rng"]:
    assert_close(got6, at6[src], 1e-6, tag)       # same N: the same dropout masks
    for k in at6[src]:
      if k.startswith(("model_state", "rng")):
        np.testing.assert_array_equal(got6[k], at6[src][k], err_msg=k)
  else:
    assert_close(got6, reference(cfg["opt"], 6), 1e-6, tag)


def test_uninterrupted_runs_match_single_device_reference(saved):
  _, _, at6 = saved
  for src in ("adam8", "adam4", "sgd8s3"):
    assert_close(at6[src], reference(SOURCES[src]["opt"], 6), 1e-6, src)


def test_exported_params_load_with_plain_orbax_and_flax(child, export):
  _, plain = child
  _, want = export
  np.testing.assert_allclose(plain["plain"], want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(plain["targeted"], want, rtol=1e-6, atol=1e-6)


def test_sigkill_during_save_leaves_previous_checkpoint_restorable(saved, steps, tmp_path):
  work, _, _ = saved
  shutil.copytree(work / "adam8", tmp_path / "killed")
  proc = subprocess.Popen([sys.executable, __file__, "kill", str(tmp_path)], env=_child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  try:
    deadline = time.time() + 300
    while not (tmp_path / "in_save").exists():
      assert proc.poll() is None, proc.stdout.read().decode()[-4000:]
      assert time.time() < deadline, "the child never reached the save"
      time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.stdout.close()  # (left open, it is a ResourceWarning)
  assert proc.returncode == -signal.SIGKILL
  tmp_dir = pathlib.Path((tmp_path / "in_save").read_text())
  assert tmp_dir.exists() and any(tmp_dir.rglob("*")), "the save had written its arrays"
  assert not (tmp_path / "killed" / "6").exists()

  step = steps["adam4"]  # continue on 4 devices: the same run, another mesh
  with zj.CheckpointManager(tmp_path / "killed", max_to_keep=1) as mngr:
    assert mngr.all_steps() == [3]
    state = mngr.restore(step, init_params())
    assert int(state.step) == 3
    for b in BATCHES[3:]:
      state, _ = step(state, b)
    assert_close(logical(step, state), reference("adam", 6), 1e-6, "after kill")
    assert mngr.save(state)                        # the same step number saves fine now
    assert mngr.all_steps() == [6]
  assert not tmp_dir.exists(), "the partial save was cleaned up"


def test_save_returns_before_the_write_commits(steps, tmp_path, monkeypatch):
  from orbax.checkpoint._src.path import atomicity
  release, reached = threading.Event(), threading.Event()
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def held_finalize(self):
    reached.set()
    await asyncio.to_thread(release.wait, 60)
    return await finalize(self)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_finalize)
  step = steps["adam8"]
  state = step.init(init_params())
  state, _ = step(state, BATCHES[0])
  mngr = zj.CheckpointManager(tmp_path, async_save=True)
  try:
    assert mngr.save(state)
    assert reached.wait(60)
    state, _ = step(state, BATCHES[1])         # training goes on while the write waits
    jax.block_until_ready(state)
    assert not (tmp_path / "1").exists()       # not committed yet: absent, not partial
    release.set()
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1]
  finally:
    release.set()
    mngr.close()


def test_keeps_only_the_last_k_checkpoints(steps, tmp_path):
  step = steps["adam4"]
  state = step.init(init_params())
  with zj.CheckpointManager(tmp_path, max_to_keep=2) as mngr:
    for b in BATCHES[:5]:
      state, _ = step(state, b)
      assert mngr.save(state)
    assert not mngr.save(state)                 # step 5 exists: not rewritten
    mngr.wait_until_finished()
    assert mngr.all_steps() == [4, 5]
    assert mngr.latest_step() == 5
    assert int(mngr.restore(step, init_params(), step=4).step) == 4
  assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith((".", "_"))) == [
      "4", "5"]


def test_restore_never_unpickles(saved, steps, tmp_path, monkeypatch):
  work, at3, _ = saved
  shutil.copytree(work / "adam8", tmp_path / "ckpt")
  marker = tmp_path / "pwned"

  class Payload:
    def __reduce__(self):
      return (open, (str(marker), "w"))

  payload = pickle.dumps(Payload())
  step_dir = tmp_path / "ckpt" / "3"
  for d in [step_dir, *[p for p in step_dir.iterdir() if p.is_dir()]]:
    for name in ("checkpoint.pkl", "state.pickle", "metadata.pkl"):
      (d / name).write_bytes(payload)

  def refuse(*a, **k):
    raise AssertionError("restore called pickle")

  for name in ("load", "loads", "Unpickler"):
    monkeypatch.setattr(pickle, name, refuse)
  with zj.CheckpointManager(tmp_path / "ckpt") as mngr:
    state = mngr.restore(steps["adam8"], init_params())
  monkeypatch.undo()
  assert not marker.exists()
  got = logical(steps["adam8"], state)
  for k, v in at3["adam8"].items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)
  pickle.loads(payload).close()  # the planted file is live: unpickling it would have run code
  assert marker.exists()


def test_errors_name_the_problem(saved, steps, tmp_path):
  work, _, _ = saved
  params = init_params()
  with pytest.raises(FileNotFoundError, match="no complete checkpoint in"):
    zj.CheckpointManager(tmp_path / "empty").restore(steps["adam8"], params)
  mngr = zj.CheckpointManager(work / "adam8")
  with pytest.raises(FileNotFoundError, match="no complete checkpoint for step 7"):
    mngr.restore(steps["adam8"], params, step=7)
  # Another model: the leaves that differ are named, with both shapes.
  z = lambda *shape: np.zeros(shape, np.float32)
  other = {"Dense_0": {"kernel": z(5, 8), "bias": z(8)}, "Dense_1": {"kernel": z(8, 3),
                                                                    "bias": z(3)}}
  with pytest.raises(ValueError) as e:
    mngr.restore(steps["adam8"], other)
  msg = str(e.value)
  assert "params['Dense_0']['kernel']: checkpoint (5, 9) float32, this step's state (5, 8)" in msg
  assert "params['Dense_1']['kernel']" in msg and "params['temperature']" in msg
  assert "params['Dense_1']['bias']" not in msg
  # Another optimizer.
  sgd = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh_of(8))
  with pytest.raises(ValueError, match=r"different optimizer.*ScaleByAdamState.*EmptyState"):
    mngr.restore(sgd, params)
  with pytest.raises(ValueError, match="different optimizer"):
    mngr.restore(zj.make_sharded_train_step(loss_fn, optax.adamw(LR), mesh=mesh_of(8)), params)
  # Another precision.
  with pytest.raises(ValueError, match="another precision.*float32, this step's are bfloat16"):
    mngr.restore(zj.make_sharded_train_step(loss_fn, optax.adam(LR), mesh=mesh_of(8),
                                            precision="bf16"), params)
  # An rng / model state the saved run did not have, and the other way round.
  with_rng = zj.make_sharded_train_step(loss_fn_rng, optax.adam(LR), mesh=mesh_of(8))
  with pytest.raises(ValueError, match=r"rng: in this step's state \(\) key<fry>, not in the"):
    mngr.restore(with_rng, params, rng=jax.random.key(0))
  with pytest.raises(ValueError, match=r"model_state\['ema'\]: in the checkpoint"):
    zj.CheckpointManager(work / "rng8").restore(steps["rng8"], params, rng=jax.random.key(0))
  mngr.close()


def test_metadata_describes_the_checkpoint(saved):
  work, _, _ = saved
  meta = zj.CheckpointManager(work / "fp16s3").metadata()
  assert meta["step"] == 3 and meta["num_devices"] == 8
  assert meta["param_storage"] == "float16 + float32 master"
  kernel = {e["path"]: e for e in meta["groups"]["master"]}["['Dense_0']['kernel']"]
  assert kernel["shape"] == [5, 9] and kernel["stored"] == [8, 9]  # padded for 8 devices



# ------------------------------------------------- misuse that must fail loudly
def _flip_middle_byte(path: pathlib.Path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


def _largest_array_file(step_dir: pathlib.Path) -> pathlib.Path:
  return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and "d" in p.parts),
             key=lambda p: p.stat().st_size)


# How a step directory gets damaged, and the words that must name the damage.
DAMAGE = {
    "data_file_deleted": (lambda d: _largest_array_file(d).unlink(), "missing"),
    "data_file_truncated": (lambda d: os.truncate(_largest_array_file(d), 10), "10 bytes"),
    "data_file_corrupted": (lambda d: _flip_middle_byte(_largest_array_file(d)), "corrupted"),
    "array_metadata_truncated": (lambda d: os.truncate(d / "state" / "_METADATA", 7),
                                 "state/_METADATA"),
    "description_corrupted": (lambda d: _flip_middle_byte(d / "zero_jax" / "metadata"),
                              "zero_jax/metadata"),
    "description_deleted": (lambda d: (d / "zero_jax" / "metadata").unlink(),
                            "zero_jax/metadata"),
    "state_item_removed": (lambda d: shutil.rmtree(d / "state"), "state/ is missing"),
    "description_item_removed": (lambda d: shutil.rmtree(d / "zero_jax"),
                                 "zero_jax/ is missing"),
    "orbax_step_metadata_deleted": (lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
                                    "_CHECKPOINT_METADATA"),
}


@pytest.fixture(scope="module")
def two_steps(steps, tmp_path_factory):
  """Checkpoints of steps 1 and 2 (adam, 4 devices), and the states saved."""
  work = tmp_path_factory.mktemp("two_steps")
  step = steps["adam4"]
  state, saved = step.init(init_params()), {}
  with zj.CheckpointManager(work, max_to_keep=None) as mngr:
    for b in BATCHES[:2]:
      state, _ = step(state, b)
      saved[int(state.step)] = logical(step, state)
      assert mngr.save(state, optimizer=OPTIMIZERS["adam"]())
  return work, saved


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".zero_jax.lock"))
  return dst


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_is_named_never_loaded_and_restore_falls_back(
    damage, two_steps, steps, tmp_path):
  src, saved = two_steps
  work = _copy(src, tmp_path / "ckpt")
  harm, words = DAMAGE[damage]
  harm(work / "2")
  step = steps["adam4"]
  with zj.CheckpointManager(work) as mngr:
    assert mngr.all_steps() == [1] and mngr.latest_step() == 1  # not listed as complete
    with pytest.warns(zj.checkpoint.DamagedCheckpointWarning) as record:
      state = mngr.restore(step, init_params())
    message = " ".join(str(w.message) for w in record)
    assert "step 2" in message and "damaged" in message and words in message, message
    assert "restored step 1" in message, message
    got = logical(step, state)
    for k, v in saved[1].items():
      np.testing.assert_array_equal(got[k], v, err_msg=k)
    with pytest.raises(zj.checkpoint.DamagedCheckpointError) as e:  # asked for explicitly
      mngr.restore(step, init_params(), step=2)
    msg = str(e.value)
    assert "step 2" in msg and words in msg and "steps [1]" in msg, msg
    with pytest.raises(zj.checkpoint.DamagedCheckpointError, match="step 2"):
      mngr.metadata(2)


def test_read_error_in_an_unrecorded_checkpoint_is_damage_too(two_steps, steps, tmp_path):
  # A checkpoint written before the record of files existed: only a failed read
  # shows the damage; it must be named and skipped like any other.
  src, saved = two_steps
  work = _copy(src, tmp_path / "ckpt")
  for s in ("1", "2"):
    (work / s / "zero_jax.files.json").unlink()
    meta = json.loads((work / s / "zero_jax" / "metadata").read_text())
    del meta["files_record"], meta["optimizer"]
    (work / s / "zero_jax" / "metadata").write_text(json.dumps(meta))
  _flip_middle_byte(work / "2" / "state" / "manifest.ocdbt")
  unrecorded = pytest.warns(UserWarning, match="does not record its optimizer's update rule")
  with zj.CheckpointManager(work) as mngr, unrecorded:
    assert mngr.all_steps() == [1, 2]  # the structure is complete
    with pytest.warns(zj.checkpoint.DamagedCheckpointWarning,
                      match=r"step 2 .* damaged \(reading its arrays failed: .*DATA_LOSS"):
      state = mngr.restore(steps["adam4"], init_params())
    assert int(state.step) == 1
    with pytest.raises(zj.checkpoint.DamagedCheckpointError, match="step 2.*steps \\[1\\]"):
      mngr.restore(steps["adam4"], init_params(), step=2)


def test_save_replaces_a_damaged_checkpoint_of_its_step(two_steps, steps, tmp_path):
  src, saved = two_steps
  work = _copy(src, tmp_path / "ckpt")
  os.truncate(_largest_array_file(work / "2"), 3)
  step = steps["adam4"]
  with zj.CheckpointManager(work, max_to_keep=None) as mngr:
    with pytest.warns(zj.checkpoint.DamagedCheckpointWarning):
      state = mngr.restore(step, init_params())
    state, _ = step(state, BATCHES[1])
    with pytest.warns(zj.checkpoint.DamagedCheckpointWarning, match="replacing the damaged"):
      assert mngr.save(state, optimizer=OPTIMIZERS["adam"]())
    assert mngr.all_steps() == [1, 2]
    got = logical(step, mngr.restore(step, init_params()))
  for k, v in saved[2].items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_a_save_over_a_step_the_rolled_back_run_wrote_warns_and_force_replaces(
    two_steps, steps, tmp_path):
  """Restoring step 1 while step 2 is on disk rolls the run back; its own step 2 then meets
  the abandoned run's. save keeps that one (returns False), as for any existing step, and
  warns that it is not this state; force=True replaces it. Resuming from the newest
  checkpoint and saving its step again is no rollback: no warning."""
  src, saved = two_steps
  step = steps["adam4"]
  with zj.CheckpointManager(_copy(src, tmp_path / "ckpt"), max_to_keep=None) as mngr:
    state = mngr.restore(step, init_params(), step=1)
    state, _ = step(state, BATCHES[3])  # another batch than the abandoned run's step 2
    with pytest.warns(UserWarning, match=r"the checkpoint of step 2 .* is from before this "
                                         r"run restored step 1.*force=True"):
      assert not mngr.save(state)
    mine = logical(step, state)
    assert mngr.save(state, force=True)
    got = logical(step, mngr.restore(step, init_params(), step=2))
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert not mngr.save(mngr.restore(step, init_params()))  # the newest: no rollback
  assert any(not np.array_equal(v, saved[2][k]) for k, v in mine.items())  # another state
  for k, v in mine.items():
    np.testing.assert_array_equal(got[k], v, err_msg=k)


_SAVE_AND_EXIT = r"""
import sys, jax, numpy as np, optax
jax.config.update("jax_num_cpu_devices", 8)
import zero_jax as zj
mesh = jax.make_mesh((8,), ("data",))
step = zj.make_sharded_train_step(lambda p, b: (p["w"] ** 2).sum(), optax.adam(0.1), mesh=mesh)
state = step.init({"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
mngr = zj.CheckpointManager(sys.argv[1])
assert mngr.save(state)
print("saved", flush=True)   # and exit, neither waiting nor closing
"""


def test_async_save_then_exit_without_waiting_leaves_a_restorable_checkpoint(tmp_path):
  proc = subprocess.run([sys.executable, "-c", _SAVE_AND_EXIT, str(tmp_path)],
                        env=_child_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "saved" in proc.stdout, proc.stderr[-3000:]
  mesh = mesh_of(2)
  step = zj.make_sharded_train_step(lambda p, b: (p["w"] ** 2).sum(), optax.adam(0.1),
                                    mesh=mesh)
  with zj.CheckpointManager(tmp_path) as mngr:
    assert mngr.all_steps() == [0]
    state = mngr.restore(step, {"w": np.zeros((3, 4), np.float32)})
  np.testing.assert_array_equal(np.asarray(step.get_params(state)["w"]),
                                np.arange(12, dtype=np.float32).reshape(3, 4))


_UNWRITABLE = r"""
import sys, jax, numpy as np, optax
jax.config.update("jax_num_cpu_devices", 8)
import zero_jax as zj
mesh = jax.make_mesh((8,), ("data",))
step = zj.make_sharded_train_step(lambda p, b: (p["w"] ** 2).sum(), optax.sgd(0.1), mesh=mesh)
state = step.init({"w": np.ones((3,), np.float32)})
for directory in sys.argv[1:]:
  try:
    mngr = zj.CheckpointManager(directory)
    saved = mngr.save(state)
    mngr.wait_until_finished()
    print(f"NOT REFUSED {directory}: save returned {saved}", flush=True)
  except OSError as e:
    print(f"refused: {e}", flush=True)
"""


def test_unwritable_directory_is_refused_at_once_naming_it_and_never_hangs(tmp_path):
  # Root ignores permission bits, so: a path under a regular file, and /proc (a
  # directory no one can create files in).
  (tmp_path / "a_file").write_text("not a directory")
  dirs = [str(tmp_path / "a_file" / "ckpt")] + (["/proc"] if os.path.isdir("/proc/self") else [])
  t0 = time.monotonic()
  proc = subprocess.run([sys.executable, "-c", _UNWRITABLE, *dirs], env=_child_env(),
                        capture_output=True, text=True, timeout=90)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "NOT REFUSED" not in proc.stdout, proc.stdout
  assert f"checkpoint directory {dirs[0]} is below {tmp_path / 'a_file'}, which is a file" in \
      proc.stdout, proc.stdout
  for d in dirs[1:]:
    assert f"refused: [Errno" in proc.stdout and f"checkpoint directory {d} is not writable" in (
        proc.stdout), proc.stdout
  assert time.monotonic() - t0 < 60


_HOLD_LOCK = r"""
import sys, time
from zero_jax.checkpoint.writer import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("holding", flush=True)
time.sleep(120)
"""


def test_one_writer_per_directory_named_in_the_refusal_and_a_dead_holder_is_stale(
    steps, tmp_path):
  step = steps["adam4"]
  state, _ = step(step.init(init_params()), BATCHES[0])
  first = zj.CheckpointManager(tmp_path, max_to_keep=1)
  second = zj.CheckpointManager(tmp_path, max_to_keep=1)
  assert first.save(state)
  with pytest.raises(zj.checkpoint.DirectoryInUseError) as e:
    second.save(state)
  assert f"process {os.getpid()} on host {socket.gethostname()}" in str(e.value)
  assert str(tmp_path) in str(e.value)
  first.wait_until_finished()
  assert int(second.restore(step, init_params()).step) == 1  # reading needs no lock
  first.close()
  state, _ = step(state, BATCHES[1])
  assert second.save(state)  # the lock was released by close()
  second.close()
  assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["2"]

  # Another process holds the lock: refused, naming it; killed: its lock is stale.
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path)], env=_child_env(),
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "holding"
    state, _ = step(state, BATCHES[2])
    with zj.CheckpointManager(tmp_path, max_to_keep=1) as third:
      with pytest.raises(zj.checkpoint.DirectoryInUseError, match=f"process {holder.pid} "):
        third.save(state)
    holder.kill()
    holder.wait(30)
    with zj.CheckpointManager(tmp_path, max_to_keep=1) as fourth:
      assert fourth.save(state)
      assert fourth.all_steps() == [3]
  finally:
    if holder.poll() is None:
      holder.kill()
      holder.wait()
    holder.stdout.close()  # (left open, it is a ResourceWarning)


@pytest.mark.parametrize("other", ["nadam", "yogi", "radam"])
def test_restore_refuses_another_update_rule_with_the_same_state_types(
    other, two_steps):
  work, _ = two_steps
  params = init_params()
  make = lambda opt: zj.make_sharded_train_step(loss_fn, opt, mesh=mesh_of(4))
  with zj.CheckpointManager(work) as mngr:
    with pytest.raises(ValueError, match="different optimizer") as e:
      mngr.restore(make(getattr(optax, other)(LR)), params)
    saved_sig = optimizer_signature(optax.adam(LR))
    other_sig = optimizer_signature(getattr(optax, other)(LR))
    assert saved_sig in str(e.value) and other_sig in str(e.value), str(e.value)
    # Hyperparameters may change.
    assert int(mngr.restore(make(optax.adam(LR / 10)), params).step) == 2


def test_checkpoint_without_optimizer_signature_restores_with_a_warning(steps, tmp_path,
                                                                       monkeypatch):
  step = steps["adam4"]
  state, _ = step(step.init(init_params()), BATCHES[0])
  # As an older zero_jax wrote it: no signature (today every state's meta carries one).
  from zero_jax.checkpoint import format as checkpoint_format
  monkeypatch.setattr(checkpoint_format, "_optimizer_signature_of_state", lambda state: None)
  with zj.CheckpointManager(tmp_path) as mngr:
    assert mngr.save(state)
    with pytest.warns(UserWarning, match="does not record its optimizer's update rule"):
      assert int(mngr.restore(step, init_params()).step) == 1


def test_checkpoint_from_before_skipped_in_a_row_restores_it_as_zero(steps, tmp_path,
                                                                     monkeypatch):
  step = steps["adam4"]
  state, _ = step(step.init(init_params()), BATCHES[0])
  nan_batch = {"x": np.full_like(BATCHES[1]["x"], np.nan), "y": BATCHES[1]["y"]}
  with pytest.warns(RuntimeWarning, match=r"step 1 was skipped because both the loss"):
    state, metrics = step(state, nan_batch)  # skipped: skipped_steps = skipped_in_a_row = 1
    step.get_params(state)  # delivered here at the latest
  assert int(metrics["skipped_steps"]) == 1 and int(metrics["skipped_in_a_row"]) == 1

  @flax.struct.dataclass
  class LossScaleBeforeIt:  # the loss-scale state of zero_jax before skipped_in_a_row
    scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array

  from zero_jax.checkpoint import format as checkpoint_format
  groups = checkpoint_format._groups
  monkeypatch.setattr(checkpoint_format, "_groups", lambda s: {**groups(s), "loss_scale":
      LossScaleBeforeIt(s.loss_scale.scale, s.loss_scale.good_steps, s.loss_scale.skipped_steps)})
  with zj.CheckpointManager(tmp_path) as mngr:
    assert mngr.save(state)
    mngr.wait_until_finished()
  monkeypatch.undo()
  with zj.CheckpointManager(tmp_path) as mngr:
    restored = mngr.restore(step, init_params())
  assert int(restored.loss_scale.skipped_steps) == 1
  assert int(restored.loss_scale.skipped_in_a_row) == 0
  chex.assert_trees_all_equal((restored.params, restored.opt_state),
                              (state.params, state.opt_state), strict=True)
  step(restored, BATCHES[2])


if __name__ == "__main__":
  if jax.config.jax_num_cpu_devices != 8:  # unless the plain-load prelude set it
    jax.config.update("jax_num_cpu_devices", 8)
  {"restore": _child_restore, "kill": _child_kill}[sys.argv[1]](pathlib.Path(sys.argv[2]))
