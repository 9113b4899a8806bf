"""Nothing silent, round two: skipped steps warned in modes without a dynamic loss scale,
WeightedLoss steps without weight skipped (against one device), negative weights and a
NaN loss with a finite gradient warned, low-precision leaves without a master copy
warned, and param_specs that do not divide refused at init. Round three: these warnings reach
a run that stops a step after the trouble (at get_params, a checkpoint save, wait_until_finished,
close, or interpreter exit). Round four: a NaN loss from a mean over a leaf without elements
names the leaf."""

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run
from _small_mlp import init_params, loss_fn

OPTS = {"sgd": lambda: optax.sgd(0.1), "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1)}


def batch(rows=16, seed=1, bad=False):
  r = np.random.default_rng(seed)
  b = {"x": r.normal(size=(rows, 9)).astype(np.float32),
       "y": r.normal(size=(rows, 5)).astype(np.float32)}
  if bad:
    b["x"][3, 2] = np.nan
  return b


def run(step, state, batches):
  """Steps on ``batches``, waiting for each (the watch reads a step's metrics at a later
  call, once they are ready: a warning about the last step comes with the next call)."""
  ms = []
  for b in batches:
    state, m = step(state, b)
    ms.append(jax.block_until_ready(m))
  return state, ms


def messages(rec, needle):
  return [str(w.message) for w in rec if needle in str(w.message)]


# ------------------------------------------- 1. the first skipped step is warned
@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("mode", ["fp32", "bf16", "static"])
def test_first_skipped_step_warns_once_naming_the_step_and_the_rest_equals_one_device(
    mode, opt, mesh):
  kw = {"precision": mode} if mode != "static" else {"loss_scale": 128.0}
  step = zj.make_sharded_train_step(loss_fn, OPTS[opt](), mesh=mesh, **kw)
  good = [batch(seed=1), batch(seed=2)]
  with pytest.warns(RuntimeWarning, match=r"step 1 was skipped because both the loss and "
                                          r"the gradient were not finite") as rec:
    state, ms = run(step, step.init(init_params()),
                    [good[0], batch(bad=True), good[1], batch(bad=True), good[1]])
  assert len(messages(rec, "was skipped")) == 1
  assert not messages(rec, "not progressing")
  assert [int(m["skipped_steps"]) for m in ms] == [0, 1, 1, 2, 2]
  good.append(good[1])
  if mode == "fp32":  # the skipped steps change nothing: one device on the good batches
    ref, _, _ = reference_run(loss_fn, OPTS[opt](), init_params(), good)
    assert_tree_close(step.get_params(state), ref[-1])


def test_skipped_step_with_a_finite_loss_says_the_gradient_was_not_finite(mesh):
  def loss(p, b):  # sqrt at 0: the loss is finite, its gradient is not
    return loss_fn(p, b) + jnp.sqrt(p["s"] * b["z"][0])
  step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh)
  b = {**batch(), "z": np.zeros(16, np.float32)}
  with pytest.warns(RuntimeWarning, match=r"step 0 was skipped because the loss was finite "
                                          r"but the gradient was not"):
    run(step, step.init(init_params()), [b, b])


def test_fp16_dynamic_scale_stays_quiet_on_its_early_overflows(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, precision="fp16",
                                    loss_scale=zj.dynamic_loss_scale(2.0**24))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _, ms = run(step, step.init(init_params()), [batch(seed=s) for s in range(12)])
  assert int(ms[-1]["skipped_steps"]) > 0 and bool(ms[-1]["grads_finite"])


# ----------------------------------------------------- 2. WeightedLoss edge cases
def masked_batch(seed, real):
  b = batch(seed=seed)
  mask = np.zeros(16, np.float32)
  mask[:real] = 1
  return {**b, "mask": mask}


def weighted(p, b):
  per = jnp.square(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - b["y"]).sum(-1)
  return zj.WeightedLoss(total=(per * b["mask"] * p["s"]).sum(), weight=b["mask"].sum())


def weighted_mean(p, b):  # the single-device reference
  out = weighted(p, b)
  return out.total / out.weight


@pytest.mark.parametrize("opt", sorted(OPTS))
@pytest.mark.parametrize("stage,k,offload", [(1, 1, None), (2, 2, None), (3, 1, None),
                                              (2, 1, "optimizer")])
def test_weighted_step_of_weight_zero_is_skipped_and_counted(stage, k, offload, opt, mesh):
  step = zj.make_sharded_train_step(weighted, OPTS[opt](), mesh=mesh, stage=stage,
                                    grad_accum_steps=k, offload=offload)
  state = step.init(init_params())
  good = [masked_batch(1, 5), masked_batch(3, 11)]
  state, ms = run(step, state, good[:1])
  before = jax.tree.map(np.asarray, (step.get_params(state), state.opt_state))
  with pytest.warns(RuntimeWarning, match=r"step 1 was skipped: its WeightedLoss weight") as rec:
    state, (m,) = run(step, state, [masked_batch(2, 0)])
    assert np.isnan(float(m["loss"])) and bool(m["grads_finite"])  # 0/0, as on one device
    assert int(m["skipped_steps"]) == 1 and float(m["loss_scale"]) == 1.0
    after = jax.tree.map(np.asarray, (step.get_params(state), state.opt_state))
    assert_tree_close(after, before, rtol=0, atol=0)  # bit for bit
    state, ms = run(step, state, good[1:] * 2)
  assert len(messages(rec, "was skipped")) == 1
  good.append(good[1])
  ref, losses, _ = reference_run(weighted_mean, OPTS[opt](), init_params(), good)
  assert_tree_close(step.get_params(state), ref[-1])
  np.testing.assert_allclose([float(m["loss"]) for m in ms], losses[1:], rtol=1e-5)


def test_weight_zero_keeps_the_model_state(mesh):
  def loss(p, b, *, model_state):  # counts its calls, as BatchNorm statistics move
    return weighted(p, b), {"calls": model_state["calls"] + 1.0}
  step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh)
  state = step.init(init_params(), model_state={"calls": jnp.float32(0)})
  with pytest.warns(RuntimeWarning, match=r"WeightedLoss weight"):
    state, ms = run(step, state, [masked_batch(1, 8), masked_batch(1, 0), masked_batch(1, 8)])
    assert [float(m["skipped_steps"]) for m in ms] == [0, 1, 1]
  assert float(state.model_state["calls"]) == 2.0  # the skipped step's change is dropped


def test_weight_zero_does_not_back_off_a_dynamic_loss_scale(mesh):
  step = zj.make_sharded_train_step(weighted, optax.sgd(0.1), mesh=mesh, precision="fp16",
                                    loss_scale=zj.dynamic_loss_scale(8.0))
  with pytest.warns(RuntimeWarning, match=r"WeightedLoss weight"):
    _, ms = run(step, step.init(init_params()), [masked_batch(1, 0), masked_batch(1, 4)] * 2)
  assert float(ms[1]["loss_scale"]) == float(ms[0]["loss_scale"])
  assert int(ms[1]["skipped_steps"]) == 1


def test_negative_weights_warn_once(mesh):
  def loss(p, b):
    out = weighted(p, b)
    return zj.WeightedLoss(out.total, (b["mask"] * b["sign"]).sum())
  step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh)
  sign = np.ones(16, np.float32)
  sign[:2] = -1  # device 0's two real rows weigh -1 each
  b = {**masked_batch(1, 8), "sign": sign}
  with pytest.warns(RuntimeWarning, match=r"step 0: a WeightedLoss weight is negative") as rec:
    run(step, step.init(init_params()), [b, b, b])
  assert len(messages(rec, "is negative")) == 1


def test_healthy_weighted_training_does_not_warn(mesh):
  step = zj.make_sharded_train_step(weighted, optax.adam(1e-2), mesh=mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    run(step, step.init(init_params()), [masked_batch(1, 1), masked_batch(2, 16)])


def test_nan_loss_with_a_finite_gradient_points_to_weighted_loss(mesh):
  def own_count(p, b):  # divides by its own count: 0/0 on a device with only padding
    per = jnp.square(jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"] - b["y"]).sum(-1)
    return jnp.where(b["mask"] > 0, per, 0.0).sum() / b["mask"].sum()
  step = zj.make_sharded_train_step(own_count, optax.sgd(0.1), mesh=mesh)
  with pytest.warns(RuntimeWarning, match=r"metrics\['loss'\] is nan while the gradient is "
                                          r"finite.*zj.WeightedLoss") as rec:
    _, ms = run(step, step.init(init_params()), [masked_batch(1, 5)] * 3)
  assert len(messages(rec, "while the gradient is finite")) == 1
  assert bool(ms[0]["grads_finite"]) and int(ms[-1]["skipped_steps"]) == 0


def test_nan_loss_from_a_mean_over_a_leaf_without_elements_names_the_leaf(mesh):
  """jnp.mean of a zero-size leaf is 0/0: the warning names the leaf and that cause first
  (it blamed a loss dividing by its own count); the step trains the rest as one device."""
  params = {**init_params(), "e": np.zeros((0, 4), np.float32)}
  empty_mean = lambda p, b: loss_fn(p, b) + jnp.mean(p["e"])
  step = zj.make_sharded_train_step(empty_mean, optax.sgd(0.1), mesh=mesh)
  with pytest.warns(RuntimeWarning, match=r"metrics\['loss'\] is nan while the gradient is "
                                          r"finite.*The parameters params\['e'\] \(0, 4\) have "
                                          r"no elements.*jnp.mean") as rec:
    state, ms = run(step, step.init(params), [batch()] * 2)
    got = step.get_params(state)
  assert len(messages(rec, "while the gradient is finite")) == 1
  assert int(ms[-1]["skipped_steps"]) == 0
  ref, _, _ = reference_run(loss_fn, optax.sgd(0.1), init_params(), [batch()] * 2)
  assert_tree_close({k: v for k, v in got.items() if k != "e"}, ref[-1])


# ------------------------------------------- 3. low precision without a master copy
def test_bf16_params_under_fp32_warn_at_init_naming_the_leaves(mesh):
  params = init_params()
  params["w1"] = params["w1"].astype(jnp.bfloat16)
  params["b2"] = params["b2"].astype(jnp.float16)
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-4), mesh=mesh)
  with pytest.warns(RuntimeWarning, match=r"params\['b2'\] \(float16\), params\['w1'\] "
                                          r"\(bfloat16\).*precision='bf16'"):
    step.init(params)
  with warnings.catch_warnings():  # a master copy, or frozen leaves: no warning
    warnings.simplefilter("error")
    zj.make_sharded_train_step(loss_fn, optax.adam(1e-4), mesh=mesh,
                               precision="bf16").init(params)
    zj.make_sharded_train_step(loss_fn, optax.adam(1e-4), mesh=mesh,
                               trainable={"w1": False, "b1": True, "w2": True, "b2": False,
                                          "s": True}).init(params)


# ------------------------------------------------- 4. param_specs that do not divide
def test_param_specs_splitting_an_indivisible_dimension_is_refused_at_init():
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  r = np.random.default_rng(0)
  params = {"w1": r.normal(size=(6, 9)).astype(np.float32),
            "w2": r.normal(size=(9, 5)).astype(np.float32)}
  step = zj.make_sharded_train_step(lambda p, b: jnp.mean(b["x"] @ p["w1"] @ p["w2"]),
                                    optax.sgd(0.1), mesh=mesh,
                                    param_specs={"w1": P(None, "model"), "w2": P()})
  with pytest.raises(ValueError, match=r"params\['w1'\].*dimension 1 \(size 9\).*'model' "
                                       r"\(size 2\).*Pad.*multiple of 2 \(e.g. 10\).*another "
                                       r"dimension.*unsplit"):
    step.init(params)


# ------------------------------------- 5. warnings reach runs that stop a step later
def slowed(loss):
  """``loss`` with a 0.2 s host callback: the host runs ahead of the device, so a step's
  metrics are not ready when the step returns (as on an accelerator) and the warning
  must come from a later delivery point."""
  def slow(x):
    time.sleep(0.2)
    return x
  def fn(p, b):
    out = loss(p, b)
    total = out.total if isinstance(out, zj.WeightedLoss) else out
    wait = 0 * jax.pure_callback(slow, jax.ShapeDtypeStruct((), jnp.float32),
                                 jax.lax.stop_gradient(total).astype(jnp.float32))
    return zj.WeightedLoss(out.total + wait, out.weight) \
        if isinstance(out, zj.WeightedLoss) else out + wait
  return fn


def signed(p, b):  # weights +1 and -1 that cancel: the global weight is 0, the loss inf
  out = weighted(p, b)
  return zj.WeightedLoss(out.total, (b["mask"] * b["sign"]).sum())


NEEDLES = {
    "nan_params": r"step 0 was skipped because both the loss and the gradient were not finite",
    "bf16_overflow": r"step 0 was skipped because the loss was finite but the gradient was not",
    "norm_overflow": r"gradient was not \(an element is inf or NaN, or the sum of squares",
    "negative_weight": r"step 0: a WeightedLoss weight is negative"}
ALSO = {"negative_weight": r"step 0 was skipped: its WeightedLoss weight summed over the global "
                           r"batch is not positive"}  # weights that cancel


def short_run_case(name, mesh):
  """(step, params, batch) for each kind of trouble of issue 28; `NEEDLES` says what is
  warned."""
  p, b, kw, loss = init_params(), batch(), {}, loss_fn
  if name == "nan_params":
    p["w1"] = np.full_like(p["w1"], np.nan)
  elif name == "bf16_overflow":
    kw, loss = {"precision": "bf16"}, lambda p, b: loss_fn(p, b) * 1e30
  elif name == "norm_overflow":  # every element finite, the fp32 sum of squares is not
    loss = lambda p, b: loss_fn(p, b) + 1e19 * jnp.sum(p["w1"])
  else:
    sign = np.ones(16, np.float32)
    sign[8:] = -1
    b, loss = {**masked_batch(1, 16), "sign": sign}, signed
  return zj.make_sharded_train_step(slowed(loss), optax.sgd(0.1), mesh=mesh, **kw), p, b


@pytest.mark.parametrize("case,point", [("nan_params", "get_params"),
                                        ("bf16_overflow", "save"),
                                        ("norm_overflow", "wait_until_finished"),
                                        ("negative_weight", "close")])
def test_a_run_that_stops_after_one_step_hears_of_the_trouble_by_its_next_call(
    case, point, mesh, tmp_path):
  step, p, b = short_run_case(case, mesh)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # the step's metrics are not ready when it returns
    state, m = step(step.init(p), b)
  mngr = zj.CheckpointManager(tmp_path / "ckpt", async_save=False)
  also = pytest.warns(RuntimeWarning, match=ALSO[case]) if case in ALSO else \
      contextlib.nullcontext()
  with also, pytest.warns(RuntimeWarning, match=NEEDLES[case]) as rec:
    if point == "get_params":
      step.get_params(state)
    elif point == "save":
      mngr.save(state)
    else:
      getattr(mngr, point)()
  mngr.close()
  got = [w for w in rec if re.search(NEEDLES[case], str(w.message))]
  assert len(got) == 1 and got[0].filename == __file__  # at the user's line
  assert int(m["skipped_steps"]) == 1


def test_a_run_that_exits_after_1_2_or_3_steps_hears_of_the_trouble_at_exit(tmp_path):
  """In a subprocess that ends without reading anything: one warning per step object.
  Every case after 1 step (its metrics not ready when the step returned, so only the exit
  reports it), and NaN parameters after 2 and 3 steps (whose program the persistent
  compilation cache compiles once)."""
  code = textwrap.dedent("""
      import sys
      sys.path.insert(0, %r)
      import jax
      jax.config.update("jax_num_cpu_devices", 8)
      jax.config.update("jax_compilation_cache_dir", %r)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
      import test_silent as T
      mesh = jax.make_mesh((8,), ("data",))
      keep = []
      for case, n in [(c, 1) for c in T.NEEDLES] + [("nan_params", 2), ("nan_params", 3)]:
        step, p, b = T.short_run_case(case, mesh)
        state = step.init(p)
        for _ in range(n):
          state, _ = step(state, b)
        keep.append((step, state))
      print("exiting")
  """ % (os.path.dirname(os.path.abspath(__file__)), str(tmp_path)))
  out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0 and "exiting" in out.stdout, out.stderr[-3000:]
  counts = {name: len(re.findall(needle, out.stderr)) for name, needle in NEEDLES.items()}
  # bf16_overflow and norm_overflow get the same words
  assert counts == {"nan_params": 3, "bf16_overflow": 2, "norm_overflow": 2,
                    "negative_weight": 1}, out.stderr[-3000:]
  assert out.stderr.count("(Reported at interpreter exit.)") >= 4, out.stderr[-3000:]


def test_a_warning_skips_zero_jax_frames_imported_through_a_path_with_dots():
  """zero_jax imported through ``sys.path`` entry such as ``benchmarks/..`` (as the benchmark
  scripts add it) names its files ``.../benchmarks/../zero_jax/...``: those frames are still
  zero_jax's, so the warning points past them at the user's line."""
  import os  # pylint: disable=import-outside-toplevel
  from zero_jax.step import monitor  # pylint: disable=import-outside-toplevel
  package = os.path.dirname(os.path.dirname(os.path.abspath(monitor.__file__)))
  dotted = os.path.join(os.path.dirname(package), "benchmarks", "..", os.path.basename(package),
                        "step", "inside.py")
  scope = {"monitor": monitor}
  code = compile("def inside():\n  return monitor._user_level()\n", dotted, "exec")
  exec(code, scope)  # pylint: disable=exec-used
  # Level 1 is _user_level's caller (zero_jax's, by its dotted name); 2 is this test.
  assert scope["inside"]() == 2
