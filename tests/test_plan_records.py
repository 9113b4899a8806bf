"""zj.Plan's choice and table from its records (no compiling: the GPU tier tests the planning)."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj
from zero_jax.gpu import plan as plan_lib
from zero_jax.gpu import targets

MEM = zj.CompiledMemory(1, 2, 0, 3, 0)


def candidate(step_s, nbytes, hbm=1000, **opts):
  return zj.Candidate({"stage": 3, "axis_name": "data", "mesh": None, **opts}, 1, nbytes, 0,
                      hbm, step_s, step_s / 2, 10.0, 0.0, MEM)


def make(*cands, hbm=1000):
  return zj.Plan(tuple(cands), targets.H100, 1, 8, hbm, (), (), (),
                 {"total": 1.0, "lower": 0.5, "compile": 0.5})


def test_best_is_the_fastest_candidate_that_fits_not_the_fastest():
  fast_big, slow_small = candidate(1e-3, 2000), candidate(2e-3, 900, gather_once=True)
  plan = make(fast_big, slow_small)
  assert plan.best is slow_small and not fast_big.fits
  text = str(plan)
  assert "PREDICTIONS" in text and "| ZeRO-3 flat gather_once prefetch 1 | exact | 900 B | **best** |" in text


def test_when_no_candidate_fits_the_table_names_the_closest_and_the_miss():
  plan = make(candidate(1e-3, 3000), candidate(2e-3, 1500))
  assert plan.best is None and plan.closest.bytes_per_device == 1500
  assert "Nothing fits in 1000 B: the closest is ZeRO-3 flat prefetch 1 at 1.46 KiB, 500 B over" \
      in str(plan)


def test_the_default_budget_is_jaxs_preallocated_share(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert plan_lib.default_hbm(targets.H100) == int(0.75 * targets.H100.memory_bytes)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
  assert plan_lib.default_hbm(targets.H100) == int(0.9 * targets.H100.memory_bytes)


@pytest.mark.parametrize("kw, says", [
    ({"hosts": 0}, "hosts=0: must be an int >= 1"),
    ({"per_host": 2.0}, "per_host=2.0: must be an int >= 1"),
    ({"max_compiles": 0}, "max_compiles=0 must be an int >= 1"),
    ({"workers": True}, "workers=True must be an int >= 1"),
])
def test_a_cluster_or_budget_of_compiles_below_one_is_refused_before_anything_runs(kw, says):
  # Before: max_compiles=0 returned an empty plan, and hosts=0 failed suggesting a (0, 8) mesh.
  with pytest.raises(ValueError, match=re.escape(says)):
    zj.plan(lambda p, b: 0.0, optax.sgd(0.1), {"w": jax.ShapeDtypeStruct((8,), jnp.float32)},
            jax.ShapeDtypeStruct((8, 8), jnp.float32), **kw)


@pytest.mark.parametrize("kw, says", [
    ({"prec": "bf16"}, "zj.plan got prec=, which make_sharded_train_step does not take (did "
                       "you mean precision=?)"),
    ({"prefetch": 1}, "bind it: zj.plan(functools.partial(loss_fn, prefetch=1)"),
])
def test_an_option_the_step_does_not_take_is_named_with_the_nearest(kw, says):
  # Before: a TypeError from make_sharded_train_step at the first candidate, with no hint.
  with pytest.raises(TypeError, match=re.escape(says)):
    zj.plan(lambda p, b: 0.0, optax.sgd(0.1), {"w": jax.ShapeDtypeStruct((8,), jnp.float32)},
            jax.ShapeDtypeStruct((8, 8), jnp.float32), **kw)


def test_a_lossy_candidate_is_marked_on_itself_and_in_the_table():
  exact = candidate(2e-3, 900)
  lossy = candidate(1e-3, 900, quantize=zj.Quantize(weights=True, grads=True, grad_bits=4))
  assert lossy.lossy and not exact.lossy
  text = str(make(lossy, exact))
  assert "| ZeRO-3 flat qwZ+qgZ int4 prefetch 1 | **LOSSY** | 900 B | **best** |" in text
  assert "| ZeRO-3 flat prefetch 1 | exact | 900 B | yes |" in text
  assert "LOSSY: quantized communication, not the exact math" in text
  assert "LOSSY" not in str(make(exact))


def test_the_table_says_why_candidates_were_refused_skipped_pruned_or_left():
  opts = {"stage": 3, "axis_name": "data", "prefetch": 1}
  plan = zj.Plan((candidate(1e-3, 900),), targets.H100, 2, 1, 1000, (),
                 ((opts, 5000),), ((opts, "stage=5: choose 1, 2 or 3"),) * 2,
                 {"total": 1.0, "lower": 0.5, "compile": 0.5},
                 skipped=((opts, "hpZ within a host of 1 GPU keeps a whole copy"),),
                 stopped="stopped at time_limit=1 s with 3 compiles left")
  text = str(plan)
  assert "1 pruned by the memory formulas, 1 skipped, 2 refused" in text
  assert "Refused by make_sharded_train_step:\n- stage=5: choose 1, 2 or 3 (2 candidates)" in text
  assert "Skipped:\n- hpZ within a host of 1 GPU keeps a whole copy" in text
  assert "the smallest, ZeRO-3 flat prefetch 1, needs 4.88 KiB" in text
  assert "Incomplete: stopped at time_limit=1 s with 3 compiles left." in text


@pytest.mark.parametrize("kw, error, says", [
    ({"quantize": "serach"}, ValueError, "pass quantize='search' to add ZeRO++"),
    ({"policy": None}, TypeError, "bind it: zj.plan(functools.partial(loss_fn, policy=None)"),
    ({"time_limit": 0}, ValueError, "time_limit=0 must be seconds > 0"),
])
def test_a_misspelt_quantize_a_policy_or_a_zero_time_limit_is_refused(kw, error, says):
  with pytest.raises(error, match=re.escape(says)):
    zj.plan(lambda p, b: 0.0, optax.sgd(0.1), {"w": jax.ShapeDtypeStruct((8,), jnp.float32)},
            jax.ShapeDtypeStruct((8, 8), jnp.float32), **kw)


def test_a_candidate_that_does_not_fit_is_marked_and_never_ranked_by_its_time():
  # Before: misfits sat among the rows by predicted time ("no" in the fits column), so a
  # program that cannot run was ranked, and compared, beside those that can.
  fast_big, slow, slower = candidate(1e-3, 2000), candidate(3e-3, 900), candidate(5e-3, 800)
  bigger = candidate(0.5e-3, 3000, gather_once=True)
  order = plan_lib.ranked([slower, bigger, fast_big, slow])
  assert order == (slow, slower, fast_big, bigger)
  text = str(make(*order))
  assert "| ZeRO-3 flat prefetch 1 | exact | 1.95 KiB | does not fit | not ranked |" in text
  assert "| ZeRO-3 flat gather_once prefetch 1 | exact | 2.93 KiB | does not fit | not ranked |" \
      in text
  assert "1 ms" not in text and "| 3 ms |" in text
