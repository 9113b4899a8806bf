"""zj.plan checks every argument before anything is compiled or JAX's CUDA plugin looked for.

Each case runs with `compile_only_mesh` (the plugin lookup) replaced by a function that fails
the test: an argument check that came after the lookup would hide behind the plugin's message
on a machine without it (this suite's), and fail bare once the plugin is there. The fixed
options' values are checked by building the steps, on the compile-only mesh where the plugin
is there (looking for it first: asking for this machine's devices would start JAX's backends
and leave the plugin without compile-only devices), on a stand-in mesh where it is missing.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj
from zero_jax.gpu import plan as plan_lib

PARAMS = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
BATCH = jax.ShapeDtypeStruct((16, 8), jnp.float32)


def loss_fn(params, batch):
  return jnp.mean((batch @ params["w"]) ** 2)


@pytest.fixture(autouse=True)
def no_plugin_lookup(monkeypatch):
  def looked_up(*args, **kwargs):
    raise AssertionError("zj.plan looked for the CUDA plugin before checking its arguments")
  monkeypatch.setattr(plan_lib, "compile_only_mesh", looked_up)


def no_plugin(monkeypatch):
  def missing(*args, **kwargs):
    raise RuntimeError("compiling for a GPU without one needs JAX's CUDA plugin")
  monkeypatch.setattr(plan_lib, "compile_only_mesh", missing)


def on_a_mesh(monkeypatch):
  # The plugin's mesh, stood in for by 8 CPU devices: what the checks build steps on.
  monkeypatch.setattr(plan_lib, "compile_only_mesh",
                      lambda *a, **k: jax.make_mesh((8,), ("data",)))


def plan(**kw):
  args = {"loss_fn": loss_fn, "optimizer": optax.sgd(0.1), "init": PARAMS, "batch": BATCH}
  args.update({k: kw.pop(k) for k in list(kw) if k in args})
  return zj.plan(args["loss_fn"], args["optimizer"], args["init"], args["batch"], **kw)


@pytest.mark.parametrize("kw, error, says", [
    # hbm: before, "80GB" failed with a bare ValueError from int() and inf with an
    # OverflowError, both after the plugin was looked for.
    ({"hbm": "80GB"}, ValueError, "zj.plan: hbm='80GB' must be a positive, finite number of "
                                  "bytes per device, e.g. hbm=80e9 (80 GB) or hbm=80 * 2**30"),
    ({"hbm": float("inf")}, ValueError, "zj.plan: hbm=inf must be a positive, finite number"),
    ({"hbm": float("nan")}, ValueError, "zj.plan: hbm=nan must be a positive, finite number"),
    ({"hbm": 0}, ValueError, "zj.plan: hbm=0 must be a positive"),
    ({"hbm": -80e9}, ValueError, "zj.plan: hbm=-80000000000.0 must be a positive"),
    ({"hbm": True}, ValueError, "zj.plan: hbm=True must be a positive"),
    ({"gpu": "h1000"}, ValueError, "gpu='h1000': zero_jax knows ['a100', 'h100', 'h200']"),
    ({"gpu": None}, ValueError, "gpu=None: zero_jax knows"),
    ({"hosts": "2"}, ValueError, "hosts='2': must be an int >= 1"),
    ({"per_host": -8}, ValueError, "per_host=-8: must be an int >= 1"),
    ({"max_compiles": 2.5}, ValueError, "zj.plan: max_compiles=2.5 must be an int >= 1"),
    ({"time_limit": "10"}, ValueError, "zj.plan: time_limit='10' must be seconds > 0, or None"),
    ({"time_limit": -1}, ValueError, "zj.plan: time_limit=-1 must be seconds > 0"),
    ({"loss_fn": "loss"}, TypeError, "zj.plan: loss_fn must be callable"),
    ({"optimizer": optax.sgd}, TypeError, "zj.plan: optimizer must be an "
                                          "optax.GradientTransformation (e.g. optax.adamw(3e-4)); "
                                          "got function"),
    ({"batch": {"x": [1, 2]}}, TypeError, "zj.plan: batch['x'][0] is a int; each leaf of "
                                          "batch must be an array or a jax.ShapeDtypeStruct"),
    ({"batch": {"x": jax.ShapeDtypeStruct((), jnp.float32)}}, ValueError,
     "zj.plan: batch['x'] is a scalar; each leaf of batch needs a leading batch dimension"),
    ({"batch": {}}, ValueError, "zj.plan: batch has no arrays"),
    ({"prec": "bf16"}, TypeError, "which make_sharded_train_step does not take (did you mean "
                                  "precision=?)"),
    ({"mesh": None}, TypeError, "pass hosts= and per_host=, not mesh="),
])
def test_a_bad_argument_is_named_before_the_plugin_is_looked_for(kw, error, says):
  with pytest.raises(error, match=re.escape(says)):
    plan(**kw)


@pytest.mark.parametrize("plugin", [no_plugin, on_a_mesh])
@pytest.mark.parametrize("kw, says", [
    # Fixed options of a wrong value: make_sharded_train_step refuses every candidate, said
    # before anything compiles, and without the plugin instead of its install message.
    ({"precision": "bf61"}, "make_sharded_train_step refused every candidate"),
    ({"stage": 5}, "stage=5: choose 1 (optimizer state sharded)"),
    ({"grad_accum_steps": 0}, "make_sharded_train_step refused every candidate"),
    ({"offload": "params"}, "offload='params': choose None"),
])
def test_a_fixed_option_of_a_wrong_value_is_named_with_or_without_the_plugin(
    monkeypatch, plugin, kw, says):
  plugin(monkeypatch)
  with pytest.raises(ValueError, match=re.escape(says)):
    plan(hosts=1, per_host=8, **kw)


@pytest.mark.parametrize("hbm", [80e9, 80 * 2**30, 1])
def test_good_arguments_reach_the_plugin_lookup(monkeypatch, hbm):
  # The checks refuse nothing they should let through (a float or int hbm, fixed options the
  # step takes): the next thing zj.plan does is look for the plugin, and without it, its
  # message is what the user gets.
  with pytest.raises(AssertionError, match="looked for the CUDA plugin"):
    plan(hbm=hbm, precision="bf16", stage=3, time_limit=float("inf"))
  no_plugin(monkeypatch)
  with pytest.raises(RuntimeError, match="needs JAX's CUDA plugin"):
    plan(hbm=hbm, precision="bf16", stage=3)
