"""Gradient accumulation: k micro-batches inside the compiled step equal one full-batch step.

Every case runs 2 steps of `make_sharded_train_step(..., grad_accum_steps=4)`
on 8 CPU devices (64 examples: 8 per device, 4 micro-batches of 2) and 2
full-batch steps of plain single-device optax, and compares params and loss
at rtol 1e-5. The compiled program is read to check where the gradient
reduction happens: once per step after the micro-batch loop ("local"), or in
every micro-batch ("sharded").
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import (N, assert_tree_close, collectives, gradient_collectives,
                              reference_run, shapes_in)

K = 4
BATCH = 64
STEPS = 2
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}
# (stage, accumulate) pairs that are allowed.
MODES = [(1, "local"), (2, "local"), (2, "sharded"), (3, "sharded")]


def make_params():
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.5).astype(np.float32)
  # Uneven leaves: (5, 9) and (9,) need padding on 8 devices; a scalar is replicated.
  return {"w1": f(5, 9), "b1": f(9), "w2": f(9, 3), "s": np.float32(1.3)}


def make_batches(n=STEPS, size=BATCH):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(size, 5)).astype(np.float32),
           "y": r.normal(size=(size, 3)).astype(np.float32)} for _ in range(n)]


def loss_fn(p, b):
  pred = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] * p["s"]
  return jnp.mean((pred - b["y"]) ** 2)


def loss_aux_fn(p, b):
  err = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] * p["s"] - b["y"]
  return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err)), "bias": jnp.mean(err, axis=0)}



@pytest.fixture(scope="module")
def batches():
  return make_batches()


@pytest.fixture(scope="module")
def reference(batches):
  """Full-batch single-device results per (optimizer, has_aux), computed once."""
  cache = {}
  def get(opt_name, has_aux=False):
    if (opt_name, has_aux) not in cache:
      fn = loss_aux_fn if has_aux else loss_fn
      cache[opt_name, has_aux] = reference_run(fn, OPTIMIZERS[opt_name](), make_params(),
                                               batches, has_aux=has_aux)
    return cache[opt_name, has_aux]
  return get


def run_sharded(mesh, batches, opt_name, stage, accumulate, k=K, has_aux=False):
  step = zj.make_sharded_train_step(
      loss_aux_fn if has_aux else loss_fn, OPTIMIZERS[opt_name](), mesh=mesh, stage=stage,
      grad_accum_steps=k, accumulate=accumulate, has_aux=has_aux)
  state = step.init(make_params())
  params, metrics = [], []
  for b in batches:
    state, m = step(state, b)
    params.append(step.get_params(state))
    metrics.append(m)
  return params, metrics


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("stage,accumulate", MODES)
def test_micro_batches_equal_one_full_batch_step(mesh, batches, reference, stage, accumulate,
                                                 opt_name):
  params, metrics = run_sharded(mesh, batches, opt_name, stage, accumulate)
  ref_params, ref_losses, _ = reference(opt_name)
  for i in range(STEPS):
    assert_tree_close(params[i], ref_params[i], what=f"step {i} params")
    np.testing.assert_allclose(metrics[i]["loss"], ref_losses[i], rtol=1e-5)


@pytest.mark.parametrize("stage,accumulate,opt_name",
                         [(1, "local", "adam"), (2, "sharded", "sgd"), (3, "sharded", "adam")])
def test_micro_batches_with_aux_equal_one_full_batch_step(mesh, batches, reference, stage,
                                                          accumulate, opt_name):
  params, metrics = run_sharded(mesh, batches, opt_name, stage, accumulate, has_aux=True)
  ref_params, ref_losses, ref_aux = reference(opt_name, has_aux=True)
  for i in range(STEPS):
    assert_tree_close(params[i], ref_params[i], what=f"step {i} params")
    np.testing.assert_allclose(metrics[i]["loss"], ref_losses[i], rtol=1e-5)
    # aux are means over examples: the mean over devices and micro-batches is the full one.
    assert_tree_close(metrics[i]["aux"], ref_aux[i], what=f"step {i} aux")


def test_accumulated_step_equals_unaccumulated_step(mesh, batches):
  """k=4 and k=1 give the same parameters (both are the full-batch gradient)."""
  p1, _ = run_sharded(mesh, batches, "sgd", 2, "local", k=1)
  p4, _ = run_sharded(mesh, batches, "sgd", 2, "local", k=4)
  assert_tree_close(p4[-1], p1[-1])


# ------------------------------------------------------------ communication
def compiled_collectives(mesh, stage, accumulate, k):
  """The compiled collectives, one per leaf (bucket_bytes=0; buckets: test_buckets.py)."""
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=stage,
                                    grad_accum_steps=k, accumulate=accumulate, bucket_bytes=0)
  state = step.init(make_params())
  return collectives(step.lower(state, make_batches(1)[0]).compile().as_text())


# Gradient blocks of the non-scalar leaves on 8 devices: w1 (5,9) -> (1,9), b1 (9,) -> (2,),
# w2 (9,3) -> (2,3); the scalar's gradient is all-reduced.
GRAD_BLOCKS = sorted([(1, 9), (2,), (2, 3)])


def test_local_accumulation_reduce_scatters_once_per_step_after_the_loop(mesh):
  colls = compiled_collectives(mesh, 2, "local", K)
  in_loop = gradient_collectives([c for c in colls if c[2]])
  assert in_loop == [], f"no gradient communication inside the micro-batch loop: {in_loop}"
  rs = [c for c in colls if c[0] == "reduce-scatter"]
  assert sorted(s for c in rs for s in shapes_in(c[1])) == GRAD_BLOCKS, rs
  assert not any(c[2] for c in rs)
  # The same gradient traffic as a step without accumulation.
  plain = compiled_collectives(mesh, 2, "local", 1)
  key = lambda cs: sorted((c[0], c[1]) for c in gradient_collectives(cs))
  assert key(colls) == key(plain)


def test_stage1_local_accumulation_all_reduces_once_after_the_loop(mesh):
  colls = compiled_collectives(mesh, 1, "local", K)
  grad = gradient_collectives(colls)
  assert not any(c[2] for c in grad), grad
  assert not any(c[0] == "reduce-scatter" for c in colls)
  reduced = sorted(s for c in grad if c[0] == "all-reduce" for s in shapes_in(c[1]) if s)
  assert reduced == sorted([(5, 9), (9,), (9, 3)]), grad  # each full gradient once


@pytest.mark.parametrize("stage", [2, 3])
def test_sharded_accumulation_reduce_scatters_every_micro_batch(mesh, stage):
  colls = compiled_collectives(mesh, stage, "sharded", K)
  rs_loop = sorted(s for c in colls if c[0] == "reduce-scatter" and c[2] for s in shapes_in(c[1]))
  rs_out = sorted(s for c in colls if c[0] == "reduce-scatter" and not c[2]
                  for s in shapes_in(c[1]))
  # One reduce-scatter per leaf in the loop body (micro-batches 2..k), and one for
  # the first micro-batch, which runs before the loop.
  assert rs_loop == GRAD_BLOCKS, colls
  assert rs_out == GRAD_BLOCKS, colls


# ------------------------------------------------------------------ errors
def test_error_batch_not_divisible_by_devices_times_micro_batches_names_leaf(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, grad_accum_steps=3)
  state = step.init(make_params())
  bad = {"x": np.zeros((40, 5), np.float32), "y": np.zeros((40, 3), np.float32)}
  with pytest.raises(ValueError) as e:
    step(state, bad)
  msg = str(e.value)
  assert "batch['x']" in msg and "40" in msg and "24" in msg and "grad_accum_steps=3" in msg


@pytest.mark.parametrize("stage,accumulate,needle", [
    (1, "sharded", "stage=2"), (3, "local", "accumulate='sharded'"),
    (2, "global", "'local'")])
def test_error_accumulate_mode_invalid_for_stage(mesh, stage, accumulate, needle):
  with pytest.raises(ValueError, match="accumulate") as e:
    zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=stage,
                               grad_accum_steps=2, accumulate=accumulate)
  assert needle in str(e.value)


@pytest.mark.parametrize("k", [0, -1, 2.0, "2"])
def test_error_grad_accum_steps_not_a_positive_int(mesh, k):
  with pytest.raises(ValueError, match="grad_accum_steps"):
    zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, grad_accum_steps=k)
