"""Loss scaling: the pure functions, their pytree state, and skipped steps in the step.

The schedule is checked against a closed-form model written here: a finite
step counts towards ``period``; ``period`` finite steps in a row multiply the
scale by ``factor``; a non-finite step divides it by ``factor`` (never below
``min_scale``), restarts the count and changes nothing else, bit for bit.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zero_jax as zj
from _small_mlp import init_params, loss_fn

N = 8
MESH = jax.make_mesh((N,), ("data",))


def model_schedule(flags, init, period, factor, min_scale):
  """Closed-form reference: (scale used at each step, final (scale, good, skipped))."""
  scale, good, skipped, used = init, 0, 0, []
  for finite in flags:
    used.append(scale)
    if finite:
      good += 1
      if good == period:
        scale, good = scale * factor, 0
    else:
      scale, good, skipped = max(scale / factor, min_scale), 0, skipped + 1
  return used, (scale, good, skipped)


def fields(state):
  return (float(state.scale), int(state.good_steps), int(state.skipped_steps), state.dynamic,
          state.period, state.factor, state.min_scale)


# ------------------------------------------------------------ pure functions
def test_dynamic_defaults():
  s = zj.dynamic_loss_scale()
  assert fields(s) == (2.0**15, 0, 0, True, 2000, 2.0, 1.0)
  assert s.scale.dtype == jnp.float32 and s.good_steps.dtype == jnp.int32


def test_static_and_no_loss_scale_never_change_but_count_skips():
  for s, scale in [(zj.static_loss_scale(128.0), 128.0), (zj.no_loss_scale(), 1.0)]:
    for finite in [False, True, True, False, True]:
      s = zj.adjust_loss_scale(s, finite)
    assert fields(s)[:4] == (scale, 0, 2, False)


@pytest.mark.parametrize("make", [
    lambda: zj.dynamic_loss_scale(0.5, min_scale=1.0),
    lambda: zj.dynamic_loss_scale(8.0, period=0),
    lambda: zj.dynamic_loss_scale(8.0, factor=1.0),
    lambda: zj.dynamic_loss_scale(8.0, min_scale=0.0),
    lambda: zj.static_loss_scale(0.0),
    lambda: zj.static_loss_scale(float("inf")),
    lambda: zj.dynamic_loss_scale(float("inf")),
])
def test_invalid_hyperparameters_raise(make):
  with pytest.raises(ValueError):
    make()


def test_scale_loss_multiplies_in_fp32():
  s = zj.dynamic_loss_scale()
  out = zj.scale_loss(s, jnp.float16(3.0))  # 98304: past fp16's max of 65504
  assert out.dtype == jnp.float32 and float(out) == 3.0 * 2.0**15


def test_unscale_upcasts_before_dividing():
  s = zj.dynamic_loss_scale(2.0**16)  # 65536 is not even representable in fp16
  grads = {"h": jnp.full((3,), 2.0**-10, jnp.float16), "b": jnp.full((2,), 3.0, jnp.bfloat16)}
  out = zj.unscale_grads(s, grads)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(out))
  # 2**-26 underflows to 0 in fp16 (smallest subnormal 2**-24); exact in fp32.
  np.testing.assert_array_equal(out["h"], np.full(3, 2.0**-26, np.float32))
  np.testing.assert_array_equal(out["b"], np.full(2, 3.0 * 2.0**-16, np.float32))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_sees_any_nonfinite_element(bad):
  tree = {"a": jnp.ones((3, 4)), "b": [jnp.float16(1.0), jnp.arange(5)]}
  assert bool(zj.all_finite(tree))
  assert bool(zj.all_finite({}))
  tree["a"] = tree["a"].at[2, 1].set(bad)
  assert not bool(zj.all_finite(tree))


def test_all_finite_with_axis_name_agrees_on_every_device():
  mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
  x = np.ones((N * 2, 3), np.float32)
  x[5, 1] = np.nan  # in the 3rd device's slice (rows 4-5)

  def flags(block, rep):
    tree = {"block": block, "rep": rep}
    # The agreed flag is device-invariant (returnable with P() under check_vma).
    return zj.all_finite(tree)[None], zj.all_finite(tree, axis_name="data")

  fn = jax.jit(jax.shard_map(flags, mesh=mesh, in_specs=(P("data"), P()),
                             out_specs=(P("data"), P())))
  local, agreed = fn(x, np.ones(4, np.float32))
  np.testing.assert_array_equal(local, [True, True, False] + [True] * 5)
  assert [bool(s.data) for s in agreed.addressable_shards] == [False] * N


FLAGS = [False, True, True, True, False, False, False, True, True, True, True, False, True]


def test_dynamic_schedule_closed_form():
  init, period, factor, min_scale = 8.0, 3, 2.0, 2.0
  s = zj.dynamic_loss_scale(init, period=period, factor=factor, min_scale=min_scale)
  adjust = jax.jit(zj.adjust_loss_scale)
  used = []
  for finite in FLAGS:
    used.append(float(s.scale))
    s = adjust(s, jnp.bool_(finite))
  want_used, want_final = model_schedule(FLAGS, init, period, factor, min_scale)
  assert used == want_used
  # Written out: backoff, growth after 3, backoff to the floor 2 and no lower,
  # growth after 3 more, and a finite streak broken by a skip restarts the count.
  assert used == [8, 4, 4, 4, 8, 4, 2, 2, 2, 2, 4, 4, 2]
  assert fields(s) == (*want_final, True, 3, 2.0, 2.0) == (2.0, 1, 5, True, 3, 2.0, 2.0)


def test_growth_stops_short_of_inf():
  # A scale of inf would make every loss inf and could never back off (inf / 2).
  s = zj.dynamic_loss_scale(2.0**126, period=1, factor=4.0)
  for _ in range(3):
    s = zj.adjust_loss_scale(s, True)
  assert float(s.scale) == 2.0**126
  assert float(zj.adjust_loss_scale(s, False).scale) == 2.0**124


def test_dynamic_schedule_in_scan_carry():
  s = zj.dynamic_loss_scale(8.0, period=3, factor=2.0, min_scale=2.0)

  def body(state, finite):
    return zj.adjust_loss_scale(state, finite), state.scale

  final, used = jax.jit(lambda st, f: jax.lax.scan(body, st, f))(s, jnp.array(FLAGS))
  want_used, want_final = model_schedule(FLAGS, 8.0, 3, 2.0, 2.0)
  assert used.tolist() == want_used
  assert fields(final) == (*want_final, True, 3, 2.0, 2.0)


def test_every_field_survives_jit_and_pytree_round_trips():
  # Non-default values everywhere, so a field silently reset to its default shows.
  make = lambda: zj.dynamic_loss_scale(1024.0, period=7, factor=4.0, min_scale=0.5)
  s = make()
  s = zj.adjust_loss_scale(zj.adjust_loss_scale(s, True), False)  # good 0, skipped 1, 256
  s = zj.adjust_loss_scale(s, True)
  want = (256.0, 1, 1, True, 7, 4.0, 0.5)
  assert fields(s) == want and int(s.skipped_in_a_row) == 0
  assert int(zj.adjust_loss_scale(zj.adjust_loss_scale(s, False), False).skipped_in_a_row) == 2
  leaves, treedef = jax.tree_util.tree_flatten(s)
  assert len(leaves) == 4  # only the arrays are leaves; the rest is static
  rep = NamedSharding(MESH, P())
  trips = {
      "jit returning it": jax.jit(lambda: zj.adjust_loss_scale(
          zj.adjust_loss_scale(zj.adjust_loss_scale(make(), True), False), True))(),
      "jit identity": jax.jit(lambda x: x)(s),
      "flatten/unflatten": jax.tree_util.tree_unflatten(treedef, leaves),
      "tree_map": jax.tree.map(lambda x: x + 0, s),
      "device_put": jax.device_put(s, rep),
  }
  shaped = jax.eval_shape(lambda x: x, s)
  assert (shaped.dynamic, shaped.period, shaped.factor, shaped.min_scale) == want[3:]
  for name, got in trips.items():
    assert isinstance(got, zj.LossScaleState), name
    assert fields(got) == want, name
  # The floor still applies after the round trips: 0.5, not 1 (the default).
  got = trips["jit returning it"]
  for _ in range(12):
    got = jax.jit(zj.adjust_loss_scale)(got, False)
  assert float(got.scale) == 0.5


# ----------------------------------------------------- skipped steps in the step




def batch_with(step_index, bad=None):
  """A global batch of 16 (2 per device); ``bad`` = (key, row, col, value) to inject."""
  r = np.random.default_rng(100 + step_index)
  b = {"x": r.normal(size=(16, 9)).astype(np.float32),
       "y": r.normal(size=(16, 5)).astype(np.float32)}
  if bad is not None:
    key, row, col, value = bad
    b[key][row, col] = value
  return b


# Non-finite values injected into single examples; device d holds rows 2d, 2d+1.
INJECT = {0: ("x", 4, 3, np.nan),     # 3rd device
          4: ("x", 5, 0, np.inf),     # 3rd device
          5: ("y", 15, 2, -np.inf),   # last device
          6: ("x", 0, 8, np.nan),     # first device
          11: ("y", 9, 4, np.nan)}    # 5th device
STEP_FLAGS = [i not in INJECT for i in range(len(FLAGS))]
assert STEP_FLAGS == FLAGS


def raw(state):
  """Host copies of every stored array: params, master, optimizer state (padded)."""
  return [np.array(x, copy=True) for x in
          jax.tree.leaves((state.params, state.master, state.opt_state))]


def bit_identical(a, b):
  return (len(a) == len(b) and
          all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) and
              x.tobytes() == y.tobytes() for x, y in zip(a, b)))


@pytest.mark.parametrize("stage,precision,opt", [
    (1, "fp16_memory_efficient", "momentum"),  # no master; params replicated
    (2, "fp16", "adam"),                         # fp32 master, sharded and padded
    (3, "fp16", "adam"),                         # params, master, state all padded
    (3, "fp32", "momentum"),                     # a plain fp32 run skips too
])
def test_nonfinite_example_on_one_device_skips_the_step_everywhere(stage, precision, opt):
  optimizer = {"adam": optax.adam(1e-2), "momentum": optax.sgd(0.1, momentum=0.9)}[opt]
  ls = zj.dynamic_loss_scale(8.0, period=3, factor=2.0, min_scale=2.0)
  step = zj.make_sharded_train_step(loss_fn, optimizer, mesh=MESH, stage=stage,
                                    precision=precision, loss_scale=ls)
  state = step.init(init_params())
  want_used, _ = model_schedule(FLAGS, 8.0, 3, 2.0, 2.0)
  with pytest.warns(RuntimeWarning, match=r"not progressing: the dynamic loss scale sits at "
                                          r"its minimum \(2\)"):  # FLAGS overflow at 2
    for i, finite in enumerate(FLAGS):
      before = raw(state)
      state, m = step(state, batch_with(i, INJECT.get(i)))  # donates the old state
      flags = [bool(s.data) for s in m["grads_finite"].addressable_shards]
      assert flags == [finite] * N, (i, flags)  # every device agrees
      assert float(m["loss_scale"]) == want_used[i], i  # the scale this step used
      assert int(state.step) == i + 1
      after = raw(state)
      if finite:
        assert not bit_identical(before, after), i
        assert np.isfinite(float(m["grad_norm"]))
      else:  # not a single bit of params, master or optimizer state changes
        chex.assert_trees_all_equal(after, before, strict=True)   # names a leaf that changed
        assert bit_identical(before, after), i                    # and compares bytes too
    final_params = step.get_params(state)
  _, final = model_schedule(FLAGS, 8.0, 3, 2.0, 2.0)
  assert fields(state.loss_scale) == (*final, True, 3, 2.0, 2.0)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(final_params))
