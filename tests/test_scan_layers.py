"""What `zj.scan`'s ``f`` returns, checked when it is traced: each leaf of the carry and of
``y`` that is not what it must be is named by its path, with what was expected and given,
in the step as outside it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj

W, LAYERS = 6, 3


def in_step(layer, init, mesh):
  """``layer`` scanned in a stage-3 step from ``init(x)``; the step traced on one batch."""
  def loss_fn(p, b):
    h, _ = zj.scan(layer, init(b["x"]), p["layers"])
    return jnp.mean(h["h"])
  params = {"layers": np.ones((LAYERS, W, W), np.float32)}
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked={"layers": True})
  return step(step.init(params), {"x": np.ones((16, W), np.float32)})


def test_a_carry_leaf_of_another_shape_or_dtype_is_named_by_its_path(mesh):
  init = lambda x: {"h": x, "n": x[:, :2]}
  shrinks = lambda c, w: ({"h": jnp.tanh(c["h"] @ w), "n": c["n"][:, :1]}, None)
  with pytest.raises(TypeError, match=r"carry\['n'\]: init float32\(2, 2\), f returned "
                                      r"float32\(2, 1\)"):
    in_step(shrinks, init, mesh)
  casts = lambda c, w: ({"h": jnp.tanh(c["h"] @ w), "n": c["n"].astype(jnp.bfloat16)}, None)
  with pytest.raises(TypeError, match=r"carry\['n'\]: init float32\(2, 2\), f returned "
                                      r"bfloat16\(2, 2\)"):
    in_step(casts, init, mesh)
  grows = lambda c, w: ({"h": c["h"], "n": c["n"], "m": c["h"]}, None)
  with pytest.raises(TypeError, match=r"structure.*init is PyTreeDef\(\{'h': \*, 'n': \*\}\)"
                                      r".*f returned PyTreeDef\(\{'h': \*, 'm': \*, 'n': \*\}\)"):
    in_step(grows, init, mesh)


def test_a_value_of_y_that_is_not_an_array_is_named_by_its_path(mesh):
  tagged = lambda c, w: ({"h": jnp.tanh(c["h"] @ w)}, {"mean": c["h"].mean(), "tag": "x"})
  match = r"zero_jax.scan: f\(carry, layer\) returned y\['tag'\] = 'x' \(str\)"
  with pytest.raises(TypeError, match=match):
    in_step(tagged, lambda x: {"h": x}, mesh)
  with pytest.raises(TypeError, match=match):  # outside the step: as lax.scan, named
    zj.scan(tagged, {"h": jnp.ones((2, W))}, jnp.ones((LAYERS, W, W)))


def test_numbers_in_y_are_stacked_as_lax_scan_stacks_them(mesh):
  layer = lambda c, w: ({"h": jnp.tanh(c["h"] @ w)}, {"const": 1.5, "flag": True})
  got = {}

  def loss_fn(p, b):
    h, got["ys"] = zj.scan(layer, {"h": b["x"]}, p["layers"])
    return jnp.mean(h["h"]) + jnp.mean(got["ys"]["const"])
  params = {"layers": np.ones((LAYERS, W, W), np.float32)}
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, stage=3,
                                    stacked={"layers": True})
  step(step.init(params), {"x": np.ones((16, W), np.float32)})
  _, want = jax.lax.scan(layer, {"h": jnp.ones((2, W))}, params["layers"])
  assert jax.tree.map(lambda y: (y.shape, y.dtype), got["ys"]) == jax.tree.map(
      lambda y: (y.shape, y.dtype), want)


def test_a_stage_3_step_without_stacked_warns_that_the_loop_gets_the_whole_gathered_stack(
    mesh):
  """Without ``stacked=`` a ZeRO-3 step gathers every parameter before the loss: the loop
  still gives the right numbers (as lax.scan), but holds every layer at once. It says so,
  once per trace; with the stack marked, or at stages 1-2, it does not."""
  def loss_fn(p, b):
    h, _ = zj.scan(lambda c, w: (jnp.tanh(c @ w), None), b["x"], p["layers"])
    return jnp.mean(h ** 2)
  params = {"layers": np.full((LAYERS, W, W), 0.1, np.float32)}
  batch = {"x": np.ones((16, W), np.float32)}
  states = {}
  for name, kw in [("unmarked", dict(stage=3)), ("marked", dict(stage=3, stacked={"layers": True})),
                   ("stage2", dict(stage=2))]:
    step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, **kw)
    if name == "unmarked":
      with pytest.warns(UserWarning, match=r"zero_jax.scan inside a ZeRO-3 step got no stacked "
                                           r"parameter.*stacked=\{'layers': True"):
        states[name] = step(step.init(params), batch)[0]
    else:
      states[name] = step(step.init(params), batch)[0]  # filterwarnings=error: none
    states[name] = step.get_params(states[name])["layers"]
  np.testing.assert_allclose(states["unmarked"], states["marked"], rtol=1e-6)
  assert zj.scan(lambda c, w: (c @ w, None), jnp.ones((2, W)),  # outside a step: quiet
                 jnp.ones((LAYERS, W, W)))[0].shape == (2, W)
  # A loop over what is not a parameter (a sequence, per-layer inputs) is quiet too.
  steps = lambda x: jnp.broadcast_to(x, (LAYERS, *x.shape))
  over_time = lambda p, b: jnp.mean(zj.scan(lambda c, x: (jnp.tanh(c @ p["layers"][0] + x), None),
                                            b["x"], steps(b["x"]))[0] ** 2)
  step = zj.make_sharded_train_step(over_time, optax.sgd(0.1), mesh=mesh, stage=3)
  step(step.init(params), batch)
