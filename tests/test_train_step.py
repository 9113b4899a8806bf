"""The core promise: the sharded step equals a plain single-device optax step.

Every case runs 5 steps of `make_sharded_train_step` on 8 CPU devices and 5
steps of `jax.jit` + optax on one device over the same global batches, and
compares params and loss at rtol 1e-5 (fp32).
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj

N = 8
STEPS = 5
RTOL = 1e-5


def uneven_params():
  """Uneven leaves as real models have them: vocab-sized rows, odd shapes, scalars."""
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.3).astype(np.float32)
  return {"emb": f(50257, 12), "w": f(9, 7), "b": f(7,), "head": f(7, 5), "hb": f(5,),
          "temp": np.float32(0.7)}


def uneven_loss(p, batch):
  h = jnp.tanh(p["emb"][batch["tok"]][:, :9] @ p["w"] + p["b"])
  out = (h @ p["head"] + p["hb"]) * p["temp"]
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]))


def uneven_batches():
  r = np.random.default_rng(1)
  return [{"tok": r.integers(0, 50257, size=(16,)).astype(np.int32),
           "y": r.integers(0, 5, size=(16,)).astype(np.int32)} for _ in range(STEPS)]


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(13)(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(3)(x)


MODEL = MLP()


def linen_params():
  return MODEL.init(jax.random.key(0), jnp.zeros((1, 6)))["params"]


def linen_loss(p, batch):
  logits = MODEL.apply({"params": p}, batch["x"])
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def linen_batches():
  r = np.random.default_rng(2)
  return [{"x": r.normal(size=(32, 6)).astype(np.float32),
           "y": r.integers(0, 3, size=(32,)).astype(np.int32)} for _ in range(STEPS)]


def decay_mask(p):
  return jax.tree.map(lambda x: jnp.ndim(x) > 1, p)


def label_fn(p):
  return jax.tree.map(lambda x: "matrix" if jnp.ndim(x) > 1 else "vector", p)


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw_masked": lambda: optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-1),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "clip_chain": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    "multi_transform": lambda: optax.multi_transform(
        {"matrix": optax.adam(1e-2), "vector": optax.sgd(0.1)}, label_fn),
    "schedule": lambda: optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 5)),
    # Not elementwise: Newton-Schulz on each whole matrix (the update sees logical arrays).
    "muon": lambda: optax.contrib.muon(1e-2),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2),
    # A class, not a GradientTransformation; the step takes its gradient_transformation().
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
}

PROBLEMS = {
    "uneven": (uneven_params, uneven_loss, uneven_batches),
    "linen": (linen_params, linen_loss, linen_batches),
}



def reference_run(loss_fn, opt, params, batches):
  """Plain single-device optax: the ground truth."""
  dev = jax.devices()[0]
  params = jax.device_put(jax.tree.map(jnp.asarray, params), dev)
  opt_state = opt.init(params)

  @jax.jit
  def step(p, o, b):
    loss, g = jax.value_and_grad(loss_fn)(p, b)
    u, o = opt.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  losses = []
  for b in batches:
    params, opt_state, loss = step(params, opt_state, jax.device_put(b, dev))
    losses.append(float(loss))
  return params, losses


def sharded_run(loss_fn, opt, params, batches, mesh, **kw):
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, **kw)
  state = step.init(params)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  return step, state, losses


def assert_trees_close(got, want, rtol=RTOL, atol=1e-7):
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    assert g.shape == w.shape and g.dtype == w.dtype, jax.tree_util.keystr(path)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


CASES = ([("uneven", name) for name in sorted(OPTIMIZERS)] +
         [("linen", "sgd"), ("linen", "adam"), ("linen", "adamw_masked")])


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("problem,opt_name", CASES)
def test_sharded_step_matches_single_device_optax(problem, opt_name, stage, mesh):
  make_params, loss_fn, make_batches = PROBLEMS[problem]
  params, batches = make_params(), make_batches()
  want, want_losses = reference_run(loss_fn, OPTIMIZERS[opt_name](), params, batches)
  step, state, losses = sharded_run(loss_fn, OPTIMIZERS[opt_name](), params, batches, mesh,
                                    stage=stage)
  np.testing.assert_allclose(losses, want_losses, rtol=RTOL)
  assert_trees_close(step.get_params(state), want)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_step_inside_the_users_jit_and_scan_matches_single_device_optax(opt_name, stage, mesh):
  """Several steps per dispatch, as ``lax.scan`` over the step in the user's ``jax.jit``."""
  params, batches = linen_params(), linen_batches()
  want, want_losses = reference_run(linen_loss, OPTIMIZERS[opt_name](), params, batches)
  step = zj.make_sharded_train_step(linen_loss, OPTIMIZERS[opt_name](), mesh=mesh, stage=stage)

  def body(state, batch):
    state, metrics = step(state, batch)
    return state, metrics["loss"]

  run = jax.jit(lambda state, batches: jax.lax.scan(body, state, batches))
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches[:-1])
  state, losses = run(step.init(params), stacked)
  state, metrics = jax.jit(step)(state, batches[-1])  # and one step in a plain jit
  np.testing.assert_allclose(list(losses) + [metrics["loss"]], want_losses, rtol=RTOL)
  assert_trees_close(step.get_params(state), want)
  step(state, batches[0])  # the state stays usable by the step called directly


def test_sgd_gradient_is_the_global_mean_not_the_sum(mesh):
  """One SGD step with lr=1 moves params by exactly the full-batch gradient."""
  params = {"w": np.ones((4, 3), np.float32)}
  batch = {"x": np.arange(N * 2 * 4, dtype=np.float32).reshape(N * 2, 4) / 10}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  grad = jax.grad(loss_fn)(jax.tree.map(jnp.asarray, params), batch)
  for stage in (1, 2):
    step = zj.make_sharded_train_step(loss_fn, optax.sgd(1.0), mesh=mesh, stage=stage)
    state, metrics = step(step.init(params), batch)
    np.testing.assert_allclose(step.get_params(state)["w"], params["w"] - grad["w"], rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grad), rtol=1e-6)


def test_leaves_of_several_dtypes_keep_their_dtype(mesh):
  r = np.random.default_rng(3)
  params = {"f32": r.normal(size=(9, 7)).astype(np.float32),
            "bf16": jnp.asarray(r.normal(size=(7,)), jnp.bfloat16),
            "count": np.array([3], np.int32)}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["f32"] + p["bf16"].astype(jnp.float32)) ** 2)
  batches = [{"x": r.normal(size=(16, 9)).astype(np.float32)} for _ in range(3)]
  floats = {k: params[k] for k in ("f32", "bf16")}
  want, _ = reference_run(lambda p, b: loss_fn({**p, "count": params["count"]}, b),
                          optax.sgd(0.01), floats, batches)
  want["count"] = params["count"]
  with pytest.warns(RuntimeWarning, match=r"params\['bf16'\] \(bfloat16\) is below float32 "
                                          r"with no float32 master copy"):
    step, state, _ = sharded_run(loss_fn, optax.sgd(0.01), params, batches, mesh)
  got = step.get_params(state)
  assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
  np.testing.assert_allclose(got["f32"], want["f32"], rtol=RTOL)
  # bf16 gradients are reduced in bf16 on 8 devices vs summed once on one: bf16 rounding.
  np.testing.assert_allclose(np.float32(got["bf16"]), np.float32(want["bf16"]), rtol=1e-2)
  np.testing.assert_array_equal(got["count"], params["count"])


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_state_per_device_is_one_nth_plus_padding(stage, mesh):
  params = uneven_params()
  step = zj.make_sharded_train_step(uneven_loss, optax.adam(1e-3), mesh=mesh, stage=stage)
  state = step.init(params)
  replicated = jax.eval_shape(optax.adam(1e-3).init, params)
  replicated_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(replicated))
  padding_bytes = 0
  for layout, x in zip(state.meta.opt_layouts, jax.tree.leaves(replicated)):
    elems = int(np.prod(layout.shape)) if layout.shape else 1
    padded = int(np.prod(layout.storage_shape)) if layout.shape else N
    padding_bytes += (padded - elems) * x.dtype.itemsize / N
  for d in range(N):
    per_device = sum(s.data.nbytes for x in jax.tree.leaves(state.opt_state)
                     for s in x.addressable_shards if s.device == jax.devices()[d])
    assert per_device <= replicated_bytes / N + padding_bytes + 1e-9
  # And it really is split: the big leaf holds 1/N rows on each device.
  mu_emb = state.opt_state[0].mu["emb"]
  assert mu_emb.addressable_shards[0].data.shape == (50264 // N, 12)


def test_params_from_another_device_and_global_batches_are_accepted(mesh):
  params = jax.device_put(linen_params(), jax.devices()[3])
  batches = linen_batches()
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  global_batch = jax.device_put(batches[0], sharding)
  step = zj.make_sharded_train_step(linen_loss, optax.sgd(0.1), mesh=mesh)
  state, m_global = step(step.init(params), global_batch)
  state2, m_host = step(step.init(params), batches[0])
  assert float(m_global["loss"]) == float(m_host["loss"])
  assert_trees_close(step.get_params(state), step.get_params(state2), rtol=0, atol=0)


def test_aux_is_returned_and_averaged(mesh):
  def loss_fn(p, b):
    err = b["x"] @ p["w"]
    return jnp.mean(err ** 2), {"mean_err": jnp.mean(err)}
  params = {"w": np.ones((3, 2), np.float32)}
  batch = {"x": np.random.default_rng(4).normal(size=(16, 3)).astype(np.float32)}
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, has_aux=True)
  _, metrics = step(step.init(params), batch)
  _, want = loss_fn(params, batch)
  np.testing.assert_allclose(metrics["aux"]["mean_err"], want["mean_err"], rtol=1e-6)
  assert set(metrics) >= {"loss", "grad_norm", "grads_finite", "loss_scale", "aux"}
  assert bool(metrics["grads_finite"]) and float(metrics["loss_scale"]) == 1.0


def test_compiles_once_per_input_shape(mesh):
  """The loss is traced once per batch shape, however many steps run (chex counts traces)."""
  chex.clear_trace_counter()
  loss_fn = chex.assert_max_traces(linen_loss, n=2)   # raises on a third trace
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), mesh=mesh)
  state = step.init(linen_params())
  half = jax.tree.map(lambda x: x[:x.shape[0] // 2], linen_batches()[0])
  for b in [*linen_batches()[:3], half, half, half]:
    state, _ = step(state, b)
  assert [f._cache_size() for f in step._jits.values()] == [2]


def test_lower_exposes_reduce_scatter_and_all_gather(mesh):
  step = zj.make_sharded_train_step(linen_loss, optax.adam(1e-3), mesh=mesh, stage=2)
  state = step.init(linen_params())
  text = step.lower(state, linen_batches()[0]).compile().as_text()
  assert "reduce-scatter" in text and "all-gather" in text
  stats = step.lower(state, linen_batches()[0]).compile().memory_analysis()
  assert stats.argument_size_in_bytes > 0


def test_explicit_and_auto_meshes_give_the_same_result():
  params, batches = linen_params(), linen_batches()[:2]
  results = []
  for axis_type in (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto):
    mesh = jax.make_mesh((N,), ("data",), axis_types=(axis_type,))
    step, state, losses = sharded_run(linen_loss, optax.adam(1e-2), params, batches, mesh)
    results.append((losses, step.get_params(state)))
  assert results[0][0] == results[1][0]
  assert_trees_close(results[0][1], results[1][1], rtol=0, atol=0)


# ----------------------------------------------------------------------- errors
def test_error_batch_not_divisible_names_leaf_sizes_and_fix(mesh):
  step = zj.make_sharded_train_step(linen_loss, optax.sgd(0.1), mesh=mesh)
  state = step.init(linen_params())
  batch = {"x": np.zeros((12, 6), np.float32), "y": np.zeros((12,), np.int32)}
  with pytest.raises(ValueError, match=r"batch\['x'\] has leading dimension 12.*divisible by 8"
                                       r".*multiple of 8"):
    step(state, batch)


def test_error_axis_name_missing_from_mesh(mesh):
  with pytest.raises(ValueError, match=r"axis_name='dp' is not an axis of the mesh.*\('data',\)"):
    zj.make_sharded_train_step(linen_loss, optax.sgd(0.1), mesh=mesh, axis_name="dp")


def test_error_loss_not_scalar(mesh):
  step = zj.make_sharded_train_step(lambda p, b: (b["x"] @ p["w"]).sum(-1), optax.sgd(0.1),
                                    mesh=mesh)
  state = step.init({"w": np.ones((3, 2), np.float32)})
  with pytest.raises(TypeError, match=r"scalar floating loss.*\(2,\) float32.*\.mean\(\)"):
    step(state, {"x": np.ones((16, 3), np.float32)})


def test_error_loss_tuple_without_has_aux(mesh):
  step = zj.make_sharded_train_step(lambda p, b: (jnp.sum(p["w"]), {}), optax.sgd(0.1),
                                    mesh=mesh)
  state = step.init({"w": np.ones((3,), np.float32)})
  with pytest.raises(TypeError, match="has_aux=True"):
    step(state, {"x": np.ones((8, 3), np.float32)})


@pytest.mark.parametrize("stage", [0, 4, "2"])
def test_error_stage_outside_one_to_three(stage, mesh):
  with pytest.raises(ValueError, match=r"stage=.*choose 1 .*2 .*or 3"):
    zj.make_sharded_train_step(linen_loss, optax.sgd(0.1), mesh=mesh, stage=stage)


def test_error_optimizer_not_a_gradient_transformation(mesh):
  with pytest.raises(TypeError, match="optax.GradientTransformation"):
    zj.make_sharded_train_step(linen_loss, optax.sgd, mesh=mesh)


def test_error_param_leaf_not_an_array(mesh):
  step = zj.make_sharded_train_step(linen_loss, optax.sgd(0.1), mesh=mesh)
  with pytest.raises(TypeError, match=r"params\['lr'\] is a float"):
    step.init({"w": np.ones(3, np.float32), "lr": 0.1})


def test_error_comm_dtype_at_stage_three(mesh):
  with pytest.raises(ValueError, match="comm_dtype applies to stages 1-2"):
    zj.make_sharded_train_step(linen_loss, optax.sgd(0.1), mesh=mesh, stage=3,
                               comm_dtype=jnp.bfloat16)
