"""Resuming with other hyperparameters (issue 48, item 2).

A checkpoint restores into a step whose optimizer differs only in its hyperparameters,
integer or float (``optax.adam(1)`` into ``optax.adam(0.5)``, ``weight_decay=0`` into
``0.01``, betas, eps, one schedule for another), and the steps after it are those of a
plain single-device optax run that continues from the same values with the new
hyperparameters. A change of structure (another transformation, another state layout)
is refused naming the optimizer-state leaves that differ.

Exactness. The model is ``x @ w`` with ``x`` a 16 x 16 permutation matrix and the loss the
mean over 16 x 4 = 64 squared residuals: every entry of ``x @ w`` and of the gradient
``(2 / 64) x.T (x @ w - y)`` is a sum with one nonzero term, so it is exact in any order
of summation and any split over devices (each device's partial sums hold exact zeros
elsewhere, and 1/64, 1/8 are powers of two). The sharded and the single-device runs thus
get bit-identical gradients, and differ at most where the compiler evaluates the same
elementwise update formula differently (an FMA contraction, another association): each of
the update's at most K = 16 roundings per element may then differ by one rounding, a
relative difference of at most 2u (u = 2**-24) each, so each step's update differs by at
most 2 K u |update|, and |update| <= lr * A with A = 4. For Adam, Kingma & Ba (sec. 2.1)
bound the step by lr * max(1, (1 - b1) / sqrt(1 - b2)): 3.2 for (0.9, 0.999), 1.5 for
(0, 0.5); weight decay 0.01 adds lr * 0.01 |w| < 0.1 lr. SGD's step is lr times the trace
of gradients, at most |g| / (1 - momentum) = 10 |g| with |g| = 2/64 |w - y| < 0.25 (|w|,
|y| < 4: normal draws of 64 values). A parameter difference d changes the next gradient by
only 2/64 d (second order in u). Over the 4 steps: |difference| <= 4 * lr_max * A * 2 K u,
with lr_max the larger learning rate (3e-5 for lr_max 1).
"""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj

STEPS_BEFORE, STEPS_AFTER = 2, 2
U = 2.0**-24
K, A = 16, 4


def _mesh():
  return jax.make_mesh((jax.device_count(),), ("data",))


def loss_fn(p, b):
  return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def params():
  return {"w": np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)}


def batch(i):
  r = np.random.default_rng(10 + i)
  return {"x": np.eye(16, dtype=np.float32)[r.permutation(16)],
          "y": r.normal(size=(16, 4)).astype(np.float32)}


def _tol(lr_max):
  return (STEPS_BEFORE + STEPS_AFTER) * lr_max * A * 2 * K * U


def _reference(saved_opt, new_opt):
  """Plain optax on one device: STEPS_BEFORE steps of ``saved_opt``, then STEPS_AFTER
  steps of ``new_opt`` continuing from the same optimizer state."""
  p = jax.tree.map(jnp.asarray, params())
  s = saved_opt.init(p)
  grad = jax.jit(jax.grad(loss_fn))
  for i in range(STEPS_BEFORE + STEPS_AFTER):
    opt = saved_opt if i < STEPS_BEFORE else new_opt
    u, s = jax.jit(opt.update)(grad(p, batch(i)), s, p)
    p = optax.apply_updates(p, u)
  return p


CHANGES = {  # name: (saved optimizer, the one resumed with, the larger learning rate)
    "sgd_int_lr": (lambda: optax.sgd(1), lambda: optax.sgd(0.5), 1),
    "sgd_int_momentum": (lambda: optax.sgd(0.5, momentum=0),
                         lambda: optax.sgd(0.25, momentum=0.9), 0.5),
    "adam_int_lr": (lambda: optax.adam(1), lambda: optax.adam(0.5), 1),
    "adam_betas_eps": (lambda: optax.adam(0.1, b1=0, b2=0.5, eps=1),
                       lambda: optax.adam(0.1, b1=0.9, b2=0.999, eps=1e-8), 0.1),
    "adamw_weight_decay": (lambda: optax.adamw(0.1, weight_decay=0),
                           lambda: optax.adamw(0.1, weight_decay=0.01), 0.1),
    "adam_schedules": (lambda: optax.adam(optax.constant_schedule(0.1)),
                       lambda: optax.adam(lambda count: 0.05 * 0.5**count), 0.1),
}


@pytest.mark.parametrize("change,stage", [(c, 2) for c in sorted(CHANGES)] +
                         [("sgd_int_lr", 3), ("adam_int_lr", 3)])
def test_resume_with_other_hyperparameters_continues_as_optax_would(tmp_path, change, stage):
  saved_opt, new_opt, lr_max = CHANGES[change]
  step = zj.make_sharded_train_step(loss_fn, saved_opt(), mesh=_mesh(), stage=stage)
  state = step.init(params())
  for i in range(STEPS_BEFORE):
    state, _ = step(state, batch(i))
  new = zj.make_sharded_train_step(loss_fn, new_opt(), mesh=_mesh(), stage=stage)
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    restored = mngr.restore(new, params())
  for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
    restored, _ = new(restored, batch(i))
  got = np.asarray(new.get_params(restored)["w"])
  want = np.asarray(_reference(saved_opt(), new_opt())["w"])
  # The new hyperparameters are in force: the saved optimizer's own run ends elsewhere.
  assert np.max(np.abs(np.asarray(_reference(saved_opt(), saved_opt())["w"]) - want)) > 1e-3
  np.testing.assert_allclose(got, want, rtol=0, atol=_tol(lr_max))


@pytest.mark.parametrize("choice", ["step", "checkpoint"])
def test_injected_hyperparameters_saved_as_integers_restore_into_floats(tmp_path, choice):
  """``inject_hyperparams`` keeps ``learning_rate=1`` and ``b1=0`` as int32 in the state;
  the step resumed with 0.5 and 0.9 keeps float32 ones. The saved values are read and cast:
  with ``hyperparams="step"`` the step's are in force, with ``"checkpoint"`` the saved ones
  (as floats), as optax continues from a state holding those values."""
  inject = optax.inject_hyperparams(optax.adam)
  saved_opt, new_opt = inject(learning_rate=1, b1=0), inject(learning_rate=0.5, b1=0.9)
  step = zj.make_sharded_train_step(loss_fn, saved_opt, mesh=_mesh())
  state = step.init(params())
  for i in range(STEPS_BEFORE):
    state, _ = step(state, batch(i))
  assert state.opt_state.hyperparams["learning_rate"].dtype == jnp.int32
  new = zj.make_sharded_train_step(loss_fn, new_opt, mesh=_mesh())
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    restored = mngr.restore(new, params(), hyperparams=choice)
  hps = restored.opt_state.hyperparams
  assert hps["learning_rate"].dtype == hps["b1"].dtype == jnp.float32
  want_hps = {"step": (0.5, 0.9), "checkpoint": (1.0, 0.0)}[choice]
  assert (float(hps["learning_rate"]), float(hps["b1"])) == (np.float32(want_hps[0]),
                                                             np.float32(want_hps[1]))
  for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
    restored, _ = new(restored, batch(i))
  # Plain optax: the saved optimizer's steps, then the step's with the restored values.
  p = jax.tree.map(jnp.asarray, params())
  s = saved_opt.init(p)
  grad = jax.jit(jax.grad(loss_fn))
  for i in range(STEPS_BEFORE + STEPS_AFTER):
    if i == STEPS_BEFORE:
      s.hyperparams.update({k: jnp.asarray(v, jnp.float32) for k, v in s.hyperparams.items()})
      s.hyperparams.update(learning_rate=jnp.float32(want_hps[0]), b1=jnp.float32(want_hps[1]))
    u, s = jax.jit((saved_opt if i < STEPS_BEFORE else new_opt).update)(grad(p, batch(i)), s, p)
    p = optax.apply_updates(p, u)
  np.testing.assert_allclose(np.asarray(new.get_params(restored)["w"]), np.asarray(p["w"]),
                             rtol=0, atol=_tol(1))


def _saved(tmp_path, opt):
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=_mesh())
  state, _ = step(step.init(params()), batch(0))
  mngr = zj.CheckpointManager(tmp_path, async_save=False)
  mngr.save(state)
  return mngr


@pytest.mark.parametrize("saved_opt,new_opt,named", [
    (lambda: optax.adam(1), lambda: optax.sgd(1),
     r"different optimizer: its optimizer state is \(ScaleByAdamState\(\*,\*,\*\),"
     r"EmptyState\(\)\), this step's optimizer makes \(EmptyState\(\),EmptyState\(\)\)\. "
     r"The leaves that differ:\n  opt_state\[0\]\.count: in the checkpoint \(\) int32, not "
     r"in this step's state\n  opt_state\[0\]\.mu\['w'\]: in the checkpoint \(16, 4\) float32"),
    (lambda: optax.adam(0.1), lambda: optax.adam(optax.constant_schedule(0.1)),
     r"(?s)ScaleByScheduleState.*opt_state\[1\]\.count: in this step's state \(\) int32, not in "
     r"the checkpoint.*a schedule in place of a constant learning rate adds a step count"),
    (lambda: optax.adam(0.1), lambda: optax.adam(0.1, mu_dtype=jnp.bfloat16),
     r"does not match this step's state \(1 difference\(s\)\):\n  opt_state\[0\]\.mu\['w'\]: "
     r"checkpoint \(16, 4\) float32, this step's state \(16, 4\) bfloat16\nThe optimizer's "
     r"state has another layout"),
    (lambda: optax.adam(0.1), lambda: optax.nadam(0.1),
     r"different optimizer: its update rule is scale_by_adam#\w+, this step's optimizer is "
     r"scale_by_adam#\w+"),
], ids=["another_transformation", "schedule_for_constant", "state_dtype", "update_rule"])
def test_a_change_of_structure_is_refused_naming_what_differs(tmp_path, saved_opt, new_opt,
                                                              named):
  with _saved(tmp_path, saved_opt()) as mngr:
    new = zj.make_sharded_train_step(loss_fn, new_opt(), mesh=_mesh())
    with pytest.raises(ValueError, match=named):
      mngr.restore(new, params())


def test_a_checkpoint_recording_the_older_signature_restores_and_says_how_to_change(
    tmp_path):
  """Before issue 48 integers were part of the recorded update rule: a checkpoint of
  ``adam(1)`` written then restores into ``adam(1)``; into ``adam(0.5)`` it is refused
  saying how to move it on (restore, save again), after which it restores into ``adam(0.5)``."""
  from zero_jax.step.signature import optimizer_signature  # pylint: disable=g-import-not-at-top
  _saved(tmp_path, optax.adam(1)).close()
  old = optimizer_signature(optax.adam(1), legacy=True)
  assert old != optimizer_signature(optax.adam(1))
  (tmp_path / "1" / "zero_jax.files.json").unlink()  # as an older zero_jax wrote it
  meta_file = tmp_path / "1" / "zero_jax" / "metadata"
  meta = json.loads(meta_file.read_text())
  del meta["files_record"], meta["optimizer_record"]
  meta["optimizer"] = old
  meta_file.write_text(json.dumps(meta))
  make = lambda opt: zj.make_sharded_train_step(loss_fn, opt, mesh=_mesh())
  with zj.CheckpointManager(tmp_path) as mngr:
    with pytest.raises(ValueError, match=r"update rule is scale_by_adam#\w+, this step's "
                                         r"optimizer is scale_by_adam#.*written by an older "
                                         r"zero_jax.*mngr.save\(state, force=True\)"):
      mngr.restore(make(optax.adam(0.5)), params())
    state = mngr.restore(make(optax.adam(1)), params())
    assert int(state.step) == 1
    assert mngr.save(state, force=True)
    mngr.wait_until_finished()
    assert int(mngr.restore(make(optax.adam(0.5)), params()).step) == 1


def _continue(step, state, first, n=STEPS_AFTER):
  for i in range(first, first + n):
    state, _ = step(state, batch(i))
  return state


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("choice", [None, "step"])
def test_a_bf16_step_restores_its_own_hyperparameters_in_float32(tmp_path, stage, choice):
  """Under ``precision="bf16"`` the optimizer is initialized on the float32 master copy, so
  ``inject_hyperparams`` keeps its values in float32. Restoring into the same step finds
  nothing to reconcile: no warning, and ``hyperparams="step"`` keeps 0.999, not its bfloat16
  rounding 1.0 (which made Adam's second moment never decay). The run then continues as the
  uninterrupted one, bit for bit: the same compiled step on the same state values."""
  make = lambda: zj.make_sharded_train_step(
      loss_fn, optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2), mesh=_mesh(),
      stage=stage, precision="bf16")
  step = make()
  state = _continue(step, step.init(params()), 0, STEPS_BEFORE)
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    new = make()
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # nothing differs: nothing to warn about
      restored = mngr.restore(new, params(), **({} if choice is None else
                                                 {"hyperparams": choice}))
  saved, got = state.opt_state.hyperparams, restored.opt_state.hyperparams
  # Plain optax on the float32 parameters (the master the step's optimizer updates).
  plain = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2).init(
      jax.tree.map(jnp.asarray, params())).hyperparams
  as_read = lambda hps: {k: (jnp.asarray(v).dtype, float(v)) for k, v in hps.items()}
  assert as_read(got) == as_read(saved) == as_read(plain)
  assert got["b2"].dtype == jnp.float32 and float(got["b2"]) == np.float32(0.999)
  want = step.get_params(_continue(step, state, STEPS_BEFORE))
  np.testing.assert_array_equal(np.asarray(new.get_params(_continue(new, restored,
                                                                    STEPS_BEFORE))["w"]),
                                np.asarray(want["w"]))


@pytest.mark.parametrize("choice", [None, "step"])
def test_a_scheduled_hyperparameter_is_the_schedules_not_a_difference(tmp_path, choice):
  """A schedule recomputes its value from its own step count at every update: its value in
  the saved state differs from the fresh optimizer's (the schedule at step 0) on every
  resume, which is no difference to warn about, and ``hyperparams="step"`` leaves it as
  saved (the step's constant hyperparameters are still taken)."""
  sched = optax.linear_schedule(0.1, 0.01, 10)
  make = lambda b1: zj.make_sharded_train_step(
      loss_fn, optax.inject_hyperparams(optax.adam)(learning_rate=sched, b1=b1), mesh=_mesh())
  step = make(0.9)
  state = _continue(step, step.init(params()), 0, STEPS_BEFORE)
  assert float(state.opt_state.hyperparams["learning_rate"]) != np.float32(0.1)
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      same = mngr.restore(make(0.9), params(), **({} if choice is None else
                                                   {"hyperparams": choice}))
    other = mngr.restore(make(0.5), params(), hyperparams="step")
  for restored in (same, other):
    assert float(restored.opt_state.hyperparams["learning_rate"]) == \
        float(state.opt_state.hyperparams["learning_rate"])
  assert float(other.opt_state.hyperparams["b1"]) == np.float32(0.5)
