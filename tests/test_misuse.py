"""Nothing silent: misuse fails at once with an error that names what is wrong and how
to fix it, and a condition that is legal but almost surely a mistake warns.

Classes: a state from another step; a donated state reused; inconsistent batches;
dtypes (communication, float64, complex, numpy loss-scale numbers); a loss already
averaged over the data axis and collectives over axes the step does not map;
training that cannot progress; the last raw errors of issue 28 (leaves without elements,
shape structs and an unused rng= at init, param_specs matched by path, model splits on a
reordered mesh, a list of rows as a batch leaf).
"""

import os
import re
import subprocess
import sys
import textwrap
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run
from _small_mlp import init_params, loss_fn


def batch(rows=16, seed=1):
  r = np.random.default_rng(seed)
  return {"x": r.normal(size=(rows, 9)).astype(np.float32),
          "y": r.normal(size=(rows, 5)).astype(np.float32)}


def make(mesh, opt=None, **kw):
  return zj.make_sharded_train_step(loss_fn, opt or optax.adam(1e-2), mesh=mesh, **kw)


# ------------------------------------------------- 1. a state from another step
OTHER = {
    "trainable": ({}, {"trainable": {"w1": True, "b1": False, "w2": True, "b2": True,
                                     "s": True}}, r"trainable= differs for params\['b1'\]"),
    "optimizer": ({}, {"opt": optax.sgd(0.1)}, r"optimizer"),
    "same_state_type_other_rule": ({}, {"opt": optax.nadam(1e-2)}, r"optimizer: the state's "
                                   r"'scale_by_adam#.*this step's 'scale_by_adam#\w+' \(the "
                                   r"update rules differ where the states' types agree, as "
                                   r"adam's, nadam's"),
    "precision": ({}, {"precision": "fp16"}, r"precision: the state's 'fp32', this step's "
                  r"'fp16'"),
    "stage": ({}, {"stage": 3}, r"ZeRO stage: the state's 2, this step's 3"),
}


@pytest.mark.parametrize("case", sorted(OTHER))
def test_state_from_a_step_with_other_options_is_refused_naming_what_differs(case, mesh):
  made_with, run_with, needle = OTHER[case]
  opt_a = made_with.pop("opt", None)
  state = make(mesh, opt_a, **made_with).init(init_params())
  run_with = dict(run_with)
  other = make(mesh, run_with.pop("opt", None), **run_with)
  with pytest.raises(ValueError, match=r"not made by this step(.|\n)*" + needle +
                     r"(.|\n)*CheckpointManager"):
    other(state, batch())
  with pytest.raises(ValueError, match="not made by this step"):
    other.get_params(state)


def test_state_from_a_smaller_mesh_is_refused_naming_the_axis_sizes(mesh):
  small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  state = make(small).init(init_params())
  with pytest.raises(ValueError, match=r"data axes \(name, size\): the state's "
                                       r"\(\('data', 4\),\), this step's \(\('data', 8\),\)"):
    make(mesh)(state, batch())


@pytest.mark.parametrize("made_with,run_with,theirs,mine", [
    ("dynamic", 1024.0, r"dynamic \(period=2000, factor=2, min_scale=1\)", "static"),
    (1024.0, "dynamic", "static", r"dynamic \(period=2000"),
    ("dynamic", zj.dynamic_loss_scale(period=10), r"dynamic \(period=2000", r"dynamic \(period=10")])
def test_state_with_another_loss_scale_policy_is_refused_and_restore_converts_it(
    made_with, run_with, theirs, mine, mesh, tmp_path):
  state = make(mesh, precision="fp16", loss_scale=made_with).init(init_params())
  other = make(mesh, precision="fp16", loss_scale=run_with)
  with pytest.raises(ValueError, match=rf"loss scale is {theirs}.*makes it {mine}.*restore it"):
    other(state, batch())
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    restored = mngr.restore(other, init_params())
  _, m = other(restored, batch())  # the restored state takes the step's policy
  if not isinstance(run_with, str) and not hasattr(run_with, "dynamic"):  # static: its value
    assert float(m["loss_scale"]) == run_with and bool(m["grads_finite"])


def test_state_from_an_identically_built_step_is_accepted(mesh):
  state = make(mesh).init(init_params())
  a, _ = make(mesh, donate=False)(state, batch())
  b, _ = make(mesh, donate=False)(state, batch())
  assert_tree_close(a.params, b.params, rtol=0, atol=0)


# ------------------------------------------------------ 2. a donated state reused
def test_reusing_a_donated_state_raises_before_dispatch_and_explains_donation(mesh, tmp_path):
  step = make(mesh, stage=3)
  state = step.init(init_params())
  new, _ = step(state, batch())
  mngr = zj.CheckpointManager(tmp_path)
  for use in (lambda: step(state, batch()), lambda: step.get_params(state),
              lambda: mngr.save(state)):
    with pytest.raises(RuntimeError, match=r"already passed to the step.*donate=False"):
      use()
  step(new, batch())  # the returned state is fine
  mngr.close()


# ----------------------------------------------------------------- 3. batches
def test_batch_leaves_with_different_leading_sizes_are_refused_naming_them(mesh):
  step = make(mesh)
  state = step.init(init_params())
  bad = {"x": batch()["x"], "y": batch(rows=8)["y"]}  # 8 still divides 8 devices
  with pytest.raises(ValueError, match=r"batch\['x'\] has 16; batch\['y'\] has 8"):
    step(state, bad)


def test_python_list_batch_leaf_is_refused_with_the_fix(mesh):
  step = make(mesh)
  state = step.init(init_params())
  bad = {"x": batch()["x"], "y": [0.5] * 16}
  with pytest.raises(TypeError, match=r"batch\['y'\] is a Python list of numbers.*np\.asarray"):
    step(state, bad)


def test_empty_batch_is_refused_not_run_as_a_nan_step(mesh):
  step = make(mesh)
  state = step.init(init_params())
  with pytest.raises(ValueError, match=r"batch\['x'\] has no rows \(shape \(0, 9\)\)"):
    step(state, batch(rows=0))


# ------------------------------------------------------------------ 4. dtypes
@pytest.mark.parametrize("dtype", ["int8", "bool", jnp.int32])
def test_comm_dtype_must_be_floating(dtype, mesh):
  with pytest.raises(ValueError, match=r"comm_dtype=.*floating dtype"):
    make(mesh, comm_dtype=dtype)


def test_numpy_scalar_loss_scale_is_accepted(mesh):
  step = make(mesh, precision="fp16", loss_scale=np.float32(2**12))
  _, m = step(step.init(init_params()), batch())
  assert float(m["loss_scale"]) == 2**12


def complex_loss(p, b):
  pred = (b["x"].astype(jnp.complex64) @ p["w"]).real + p["b"]
  return jnp.mean((pred - b["y"]) ** 2)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_complex_params_train_like_optax(opt, mesh):
  r = np.random.default_rng(0)
  params = {"w": (r.normal(size=(9, 5)) + 1j * r.normal(size=(9, 5))).astype(np.complex64),
            "b": np.zeros(5, np.float32)}
  tx = {"sgd": optax.sgd(0.05), "adam": optax.adam(1e-2)}[opt]
  bs = [batch(seed=s) for s in range(3)]
  ref, opt_state = jax.tree.map(jnp.asarray, params), tx.init(params)
  for b in bs:  # plain optax on one device, every leaf trained (complex included)
    updates, opt_state = tx.update(jax.grad(complex_loss)(ref, b), opt_state, ref)
    ref = optax.apply_updates(ref, updates)
  step = zj.make_sharded_train_step(complex_loss, tx, mesh=mesh)
  state = step.init(params)
  for b in bs:
    state, _ = step(state, b)
  assert_tree_close(step.get_params(state), ref, rtol=1e-5, atol=1e-6)


def test_float64_params_train_in_float64_with_x64():
  """In a subprocess: x64 is a process-wide switch."""
  code = textwrap.dedent("""
      import jax
      jax.config.update("jax_enable_x64", True)
      jax.config.update("jax_num_cpu_devices", 8)
      import jax.numpy as jnp, numpy as np, optax, zero_jax as zj
      mesh = jax.make_mesh((8,), ("data",))
      r = np.random.default_rng(0)
      p = {"w": r.normal(size=(9, 5)), "b": np.zeros(5)}
      b = {"x": r.normal(size=(16, 9)), "y": r.normal(size=(16, 5)) * 1e-9}
      loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
      ref = jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(loss)(p, b))
      for stage in (1, 2, 3):
        step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh, stage=stage)
        state, m = step(step.init(p), b)
        got = step.get_params(state)
        assert got["w"].dtype == np.float64, got["w"].dtype
        err = max(float(np.abs(got[k] - ref[k]).max()) for k in p)
        assert err < 1e-13, (stage, err)   # float32 rounding would be ~1e-8
      print("ok")
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


# ------------------------------------------- 5. losses averaged, foreign axes
def test_loss_already_averaged_over_the_data_axis_is_refused(mesh):
  step = zj.make_sharded_train_step(lambda p, b: jax.lax.pmean(loss_fn(p, b), "data"),
                                    optax.sgd(0.1), mesh=mesh)
  with pytest.raises(ValueError, match=r"same on every device of axis 'data'.*already "
                                       r"averaged.*1/N.*WeightedLoss"):
    step(step.init(init_params()), batch())


def test_loss_summed_over_the_replica_axis_only_is_refused_too():
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  step = zj.make_sharded_train_step(lambda p, b: jax.lax.psum(loss_fn(p, b), "replica") / 2,
                                    optax.sgd(0.1), mesh=mesh, replica_axis="replica")
  with pytest.raises(ValueError, match=r"same on every device of axis 'replica'"):
    step(step.init(init_params()), batch())


class SyncBN(nn.Module):
  axis_name: str | None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(6, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=False, axis_name=self.axis_name, momentum=0.9)(x)
    return nn.Dense(5)(x)


def test_collective_over_an_axis_the_step_does_not_map_names_the_axes(mesh):
  model = SyncBN("batch")  # Flax's ImageNet ResNet names its axis "batch"
  v = model.init(jax.random.key(0), jnp.zeros((2, 9)))

  def loss(p, b, *, model_state):
    out, new = model.apply({"params": p, **model_state}, b["x"], mutable=["batch_stats"])
    return jnp.mean((out - b["y"]) ** 2), new

  step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=mesh)
  state = step.init(v["params"], model_state={"batch_stats": v["batch_stats"]})
  with pytest.raises(ValueError, match=r"collective.*names an axis the step does not map.*"
                                       r"\('data',\).*axis_name='data'"):
    step(state, batch())


# ------------------------------------------------- 6. training that cannot progress
def test_nan_loss_at_every_step_warns_once_and_counts_the_skips(mesh):
  step = zj.make_sharded_train_step(lambda p, b: loss_fn(p, b) * jnp.nan, optax.sgd(0.1),
                                    mesh=mesh)
  state = step.init(init_params())
  before = step.get_params(state)
  with pytest.warns(RuntimeWarning, match=r"step 0 was skipped because both the loss"), \
      pytest.warns(RuntimeWarning, match=r"not progressing.*skipped.*NaN") as rec:
    for _ in range(8):
      state, m = step(state, batch())
      jax.block_until_ready(m)
  assert sum("not progressing" in str(w.message) for w in rec) == 1
  assert int(m["skipped_steps"]) == 8 and not bool(m["grads_finite"])
  assert_tree_close(step.get_params(state), before, rtol=0, atol=0)


def test_fp16_overflow_at_every_step_warns_when_the_scale_hits_its_minimum(mesh):
  big = lambda p, b: loss_fn(p, b) * 1e30  # overflows fp16 at any scale
  step = zj.make_sharded_train_step(big, optax.sgd(0.1), mesh=mesh, precision="fp16",
                                    loss_scale=zj.dynamic_loss_scale(8.0, min_scale=1.0))
  state = step.init(init_params())
  with pytest.warns(RuntimeWarning, match=r"loss scale sits at its minimum"):
    for _ in range(8):
      state, m = step(state, batch())
      jax.block_until_ready(m)
  assert float(m["loss_scale"]) == 1.0


def test_healthy_training_does_not_warn(mesh):
  step = make(mesh)
  state = step.init(init_params())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for _ in range(4):
      state, m = step(state, batch())
      jax.block_until_ready(m)


def test_nothing_trainable_warns_at_init(mesh):
  step = make(mesh, trainable=False)
  with pytest.warns(RuntimeWarning, match="no parameter leaf trains"):
    step.init(init_params())


# ------------------------------------------- 7. the last raw errors (issue 28, item 10)
@pytest.mark.parametrize("stage,opt", [(2, "sgd"), (3, "adam")])
def test_leaves_without_elements_train_with_the_rest_as_on_one_device(stage, opt, mesh):
  def loss(p, b):  # the empty leaves take part (with nothing to add)
    return loss_fn(p, b) + jnp.sum(p["e"]) + jnp.sum(p["f"] ** 2)
  params = {**init_params(), "e": np.zeros((0, 4), np.float32),
            "f": np.zeros((3, 0), np.float32)}
  tx = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}[opt]
  bs = [batch(seed=s) for s in range(2)]
  ref, _, _ = reference_run(loss, tx(), params, bs)
  step = zj.make_sharded_train_step(loss, tx(), mesh=mesh, stage=stage)
  state = step.init(params)
  for b in bs:
    state, _ = step(state, b)
  assert_tree_close(step.get_params(state), ref[-1])


def test_init_with_shape_structs_points_to_abstract_state(mesh):
  from flax import nnx
  step = make(mesh)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                        init_params())
  with pytest.raises(TypeError, match=r"init got params\['b1'\], a jax.ShapeDtypeStruct \(7,\) "
                                      r"float32: a shape without values.*step.abstract_state"):
    step.init(shapes)
  step.abstract_state(shapes)  # what the message points to works
  abstract = nnx.eval_shape(lambda: nnx.Linear(9, 5, rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match=r"init got params\['bias'\].*ShapeDtypeStruct"):
    make(mesh).init(abstract)


def test_a_train_state_where_the_parameters_go_is_refused_with_the_fix(mesh, tmp_path):
  # Re-running init on a trained state nested the state in the parameters and failed only
  # inside the loss; restore and load_safetensors listed every leaf as missing.
  step = make(mesh)
  state, _ = step(step.init(init_params()), batch())
  fix = r"a TrainState was given where the parameters go.*step.get_params\(state\)"
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    for use in (lambda: step.init(state), lambda: step.abstract_state(state),
                lambda: mngr.restore(step, state)):
      with pytest.raises(TypeError, match=fix):
        use()
    mngr.restore(step, step.get_params(state))  # what the message points to works
  step.init(step.get_params(state))


def test_lookahead_params_are_refused_naming_them_and_the_fast_params_train(mesh):
  # optax.lookahead's update takes the fast parameters' gradient alone: the step's gradient of
  # every leaf of the LookaheadParams failed inside optax with a bare pytree-structure error.
  params = optax.LookaheadParams.init_synced(init_params())
  step = make(mesh, optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5))
  with pytest.raises(TypeError, match=r"params is an optax.LookaheadParams.*inner optimizer "
                                      r"\(step.init\(params.fast\)"):
    step.init(params)
  nested = make(mesh, optax.adam(1e-2))
  with pytest.raises(TypeError, match=r"params\['model'\] is an optax.LookaheadParams"):
    nested.init({"model": params})
  bs = [batch(seed=s) for s in range(3)]  # what the message points to trains as on one device
  step = make(mesh)
  state = step.init(params.fast)
  for b in bs:
    state, _ = step(state, b)
  assert_tree_close(step.get_params(state),
                    reference_run(loss_fn, optax.adam(1e-2), init_params(), bs)[0][-1])


def test_an_abstract_state_is_refused_where_values_are_needed_and_lowers(mesh, tmp_path):
  step = make(mesh, stage=3)
  abstract = step.abstract_state(init_params())
  mngr = zj.CheckpointManager(tmp_path, async_save=False)
  for what, use in (("the step", lambda: step(abstract, batch())),
                    ("evaluate", lambda: step.evaluate(abstract, batch())),
                    ("get_params", lambda: step.get_params(abstract)),
                    ("CheckpointManager.save", lambda: mngr.save(abstract))):
    with pytest.raises(TypeError, match=rf"{what} got an abstract TrainState.*step.init"):
      use()
  mngr.close()
  step.lower(abstract, batch())  # what an abstract state is for


def test_rng_for_a_loss_that_takes_none_is_refused_naming_it(mesh):
  from flax import nnx
  step = make(mesh)
  with pytest.raises(TypeError, match=r"init got rng=, so the step calls loss_fn with the "
                                      r"keyword rng=.*loss_fn\(p, batch\) takes no rng.*Add it "
                                      r"\(def loss_fn\(params, batch, \*, rng\)"):
    step(step.init(init_params(), rng=jax.random.key(0)), batch())
  nnx_step = zj.make_sharded_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                                        optax.sgd(0.1), mesh=mesh)
  with pytest.raises(TypeError, match=r"init got rng=.*takes no rng"):
    nnx_step(nnx_step.init(nnx.Linear(9, 5, rngs=nnx.Rngs(0)), rng=jax.random.key(0)),
             batch())


def _tp_step(param_specs):
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  return zj.make_sharded_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2),
                                    optax.sgd(0.1), mesh=mesh, param_specs=param_specs)


TP = {"w": np.ones((9, 4), np.float32), "b": np.zeros(4, np.float32)}


@pytest.mark.parametrize("specs,error", [
    ({"w": (None, "model"), "b": None}, r"TypeError: param_specs\['w'\] is \(None, 'model'\); "
                                        r"write P\(None, 'model'\).*a plain tuple is read as "
                                        r"a subtree"),
    ({"w": [None, "model"], "b": None}, r"param_specs\['w'\] is \[None, 'model'\]; write "
                                        r"P\(None, 'model'\)"),
    ({"w": P(None, "model")}, r"ValueError: param_specs has no entry for params\['b'\].*its "
                              r"paths: \['w'\]"),
    ({"w": P(None, "model"), "b": None, "c": P()}, r"param_specs\['c'\] is at a path that "
                                                    r"holds no parameter"),
], ids=["tuple", "list", "missing", "extra"])
def test_param_specs_that_are_not_partition_specs_are_named(specs, error):
  with pytest.raises((TypeError, ValueError)) as e:
    _tp_step(specs).init(TP)
  assert re.search(error, f"{type(e.value).__name__}: {e.value}"), str(e.value)


def test_param_specs_none_subtrees_and_a_dict_for_a_module_are_accepted():
  from flax import nnx
  state = _tp_step({"w": P(None, "model"), "b": None}).init(TP)
  assert state.params["w"].sharding.spec == P(None, "model")
  lin = nnx.Linear(9, 4, rngs=nnx.Rngs(0))
  step = zj.make_sharded_train_step(
      lambda m, b: jnp.mean(m(b["x"]) ** 2), optax.sgd(0.1),
      mesh=jax.make_mesh((4, 2), ("data", "model")),
      param_specs={"kernel": P(None, "model"), "bias": None})  # a dict for the nnx.State
  assert step.init(lin).params["kernel"].get_value().sharding.spec == P(None, "model")


def test_model_split_params_on_a_mesh_of_another_device_order_are_read_and_train(mesh):
  placed_on = jax.make_mesh((4, 2), ("data", "model"))
  reordered = jax.sharding.Mesh(np.array(jax.devices())[::-1].reshape(4, 2), ("data", "model"))
  params = {"w": jax.device_put(TP["w"], NamedSharding(placed_on, P(None, "model"))),
            "b": TP["b"]}
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  step = zj.make_sharded_train_step(loss, optax.sgd(0.1), mesh=reordered)
  state = step.init(params)  # no longer "no parameter is split over 'model'"
  assert state.params["w"].sharding.spec == P(None, "model")
  assert state.params["w"].sharding.mesh == reordered
  b = {"x": batch()["x"]}
  state, _ = step(state, b)
  ref, _, _ = reference_run(loss, optax.sgd(0.1), TP, [b])
  assert_tree_close(step.get_params(state), ref[-1])


def test_a_batch_leaf_given_as_a_list_of_rows_is_named(mesh):
  b = {"x": list(batch()["x"]), "y": batch()["y"]}  # 16 rows of shape (9,), as a list
  with pytest.raises(ValueError, match=r"different leading sizes \(batch\['x'\]\[0\], "
                                       r"batch\['x'\]\[1\] and 14 more have 9; batch\['y'\] "
                                       r"has 16\).*batch\['x'\] is a Python list of 16 arrays "
                                       r"of shape \(9,\).*np.stack\(batch\['x'\]\)"):
    make(mesh)(make(mesh).init(init_params()), b)


def test_a_shape_error_in_the_loss_says_its_shapes_are_per_device(mesh):
  """A broadcasting bug in the user's loss shows JAX's per-device shapes ((2, 5) for a
  global batch of 16 rows on 8 devices): the error carries a note saying so."""
  step = zj.make_sharded_train_step(lambda p, b: jnp.mean(b["x"] @ p["w1"] @ p["w2"] +
                                                          b["y"][:, :2]), optax.sgd(0.1),
                                    mesh=mesh)
  with pytest.raises(TypeError, match=r"(?i)incompatible shapes") as info:
    step(step.init(init_params()), batch())
  assert any(re.search(r"per device \(here batch\['x'\] is \(2, 9\)\)", n)
             for n in getattr(info.value, "__notes__", [])), info.value
