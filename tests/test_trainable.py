"""`trainable=`: frozen leaves never change, have no optimizer state and no communication.

The reference for a mask is single-device optax with ``optax.masked(opt,
mask)``, not the plain optimizer with zeroed gradients: a frozen leaf must
not enter a global norm (``clip_by_global_norm`` in a chain), must not be
weight-decayed (``adamw``) and gets no optimizer state. The frozen leaves
are compared bit for bit with their initial values; the others at rtol 1e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import (assert_tree_close, collectives, gradient_collectives,
                              reference_run, shapes_in)

STEPS = 2
BATCH = 16
# A large frozen leaf of a shape that nothing else has: its logical (37, 13), padded
# storage (40, 13) and per-device block (5, 13) must appear in no collective.
TABLE_SHAPES = {(37, 13), (40, 13), (5, 13)}


def make_params():
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.5).astype(np.float32)
  return {"enc": {"w": f(5, 9), "b": f(9)}, "head": {"w": f(9, 3), "b": f(3)},
          "table": f(37, 13), "count": np.array([3, 4], np.int32)}


def loss_fn(p, b):
  scale = 1.0 + 0.01 * jnp.sum(p["count"]).astype(jnp.float32)
  h = jnp.tanh(b["x"] @ (p["enc"]["w"] + p["table"][:5, :9]) + p["enc"]["b"])
  pred = (h @ p["head"]["w"] + p["head"]["b"]) * scale
  return jnp.mean((pred - b["y"]) ** 2)


def make_batches():
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(BATCH, 5)).astype(np.float32),
           "y": r.normal(size=(BATCH, 3)).astype(np.float32)} for _ in range(STEPS)]


def full_mask(enc_w=False, enc_b=False, head_w=False, head_b=False):
  return {"enc": {"w": enc_w, "b": enc_b}, "head": {"w": head_w, "b": head_b},
          "table": False, "count": False}


BOOL_TREE = {"enc": {"w": True, "b": False}, "head": {"w": True, "b": True}, "table": False,
             "count": False}
PREFIX_TREE = {"enc": True, "head": False, "table": False, "count": False}
# Says True for the int leaf too: non-float leaves are frozen automatically.
CALLABLE = lambda path, x: "table" not in jax.tree_util.keystr(path)

SPECS = {
    "bool_tree": (BOOL_TREE, full_mask(enc_w=True, head_w=True, head_b=True)),
    "prefix_tree": (PREFIX_TREE, full_mask(enc_w=True, enc_b=True)),
    "callable": (CALLABLE, full_mask(True, True, True, True)),
}
DECAY_MASK = {"enc": {"w": True, "b": False}, "head": {"w": True, "b": False}, "table": True,
              "count": False}
LABELS = {"enc": {"w": "a", "b": "b"}, "head": {"w": "a", "b": "b"}, "table": "a", "count": "b"}
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    # Non-elementwise: the clip must see only the trainable leaves' norm.
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
    # User optimizers that take masks and labels themselves.
    "adamw_mask": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=DECAY_MASK),
    "adamw_mask_fn": lambda: optax.adamw(
        1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(lambda x: x.ndim == 2, p)),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "b": optax.sgd(0.3)}, LABELS),
}

CASES = [
    ("bool_tree", 2, "adam"), ("bool_tree", 2, "sgd"), ("bool_tree", 1, "clip_adam"),
    ("prefix_tree", 1, "adam"), ("prefix_tree", 2, "multi_transform"),
    ("callable", 3, "adam"), ("callable", 3, "sgd"), ("callable", 2, "adamw_mask"),
    ("bool_tree", 2, "adamw_mask_fn"),
]



@pytest.fixture(scope="module")
def batches():
  return make_batches()


@pytest.mark.parametrize("spec,stage,opt_name", CASES)
def test_frozen_leaves_unchanged_and_others_match_masked_reference(mesh, batches, spec, stage,
                                                                   opt_name):
  trainable, mask = SPECS[spec]
  init = make_params()
  step = zj.make_sharded_train_step(loss_fn, OPTIMIZERS[opt_name](), mesh=mesh, stage=stage,
                                    trainable=trainable)
  state = step.init(init)
  assert state.meta.trainable == tuple(jax.tree.leaves(mask))
  ref_params, ref_losses, _ = reference_run(loss_fn, OPTIMIZERS[opt_name](), init, batches,
                                            mask=mask)
  for i, b in enumerate(batches):
    state, metrics = step(state, b)
    np.testing.assert_allclose(metrics["loss"], ref_losses[i], rtol=1e-5)
  params = step.get_params(state)
  assert_tree_close(params, ref_params[-1])
  for (path, x), x0, m in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                              jax.tree.leaves(init), jax.tree.leaves(mask)):
    x = np.asarray(x)
    assert x.dtype == x0.dtype, path
    assert np.array_equal(x, x0) != m, f"params{jax.tree_util.keystr(path)} trainable={m}"


def test_frozen_leaves_have_no_optimizer_state(mesh):
  init = make_params()
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, trainable=BOOL_TREE)
  state = step.init(init)
  opt_shapes = [l.shape for l in state.meta.opt_layouts]
  # Adam keeps mu and nu per trainable leaf, plus the scalar count.
  assert sorted(opt_shapes) == sorted([(5, 9)] * 2 + [(9, 3)] * 2 + [(3,)] * 2 + [()])
  assert not any(np.shape(x) in TABLE_SHAPES for x in jax.tree.leaves(state.opt_state))
  # The mixed-precision master copy also holds the trainable leaves only.
  step16 = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, precision="bf16",
                                      trainable=BOOL_TREE)
  master = step16.init(init).master
  assert sorted(np.shape(m) for m in master) == sorted([(8, 9), (16, 3), (8,)])


def test_grad_norm_and_clipping_count_trainable_leaves_only(mesh, batches):
  init = make_params()
  mask = SPECS["bool_tree"][1]
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, trainable=BOOL_TREE,
                                    max_grad_norm=0.05)
  state, metrics = step(step.init(init), batches[0])
  float_params = {k: v for k, v in init.items() if k != "count"}
  grads = jax.grad(lambda fp: loss_fn(fp | {"count": init["count"]}, batches[0]))(float_params)
  trained = [gl for gl, m in zip(jax.tree.leaves(grads), jax.tree.leaves(
      {k: v for k, v in mask.items() if k != "count"})) if m]
  norm = optax.tree.norm(trained)
  np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=1e-5)
  ref, _, _ = reference_run(loss_fn, optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1)),
                            init, batches[:1], mask=mask)
  assert_tree_close(step.get_params(state), ref[0])


# ------------------------------------------------------------ communication
def compiled(mesh, stage, trainable):
  """Compiled collectives, one per leaf (bucket_bytes=0) so that leaves show by shape."""
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=stage,
                                    trainable=trainable, bucket_bytes=0)
  state = step.init(make_params())
  return collectives(step.lower(state, make_batches()[0]).compile().as_text())


def touches_table(c):
  return any(s in TABLE_SHAPES for s in shapes_in(c[1]))


@pytest.mark.parametrize("stage", [1, 2])
def test_frozen_leaf_appears_in_no_collective(mesh, stage):
  colls = compiled(mesh, stage, BOOL_TREE)
  assert gradient_collectives(colls), "the trainable leaves are reduced"
  assert not [c for c in colls if touches_table(c)], colls


def test_stage3_frozen_leaf_is_gathered_but_never_reduced(mesh):
  colls = compiled(mesh, 3, BOOL_TREE)
  assert not [c for c in gradient_collectives(colls) if touches_table(c)], colls


def test_the_same_leaf_is_reduced_when_it_trains(mesh):
  """The control for the two tests above: the shape check does see the leaf."""
  colls = compiled(mesh, 2, None)
  assert [c for c in gradient_collectives(colls) if touches_table(c)], colls


# ------------------------------------------------------------------ errors
def test_error_trainable_tree_does_not_match_params(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh,
                                    trainable={"enc": True, "head": False})
  with pytest.raises(ValueError, match="trainable=.*does not match the params") as e:
    step.init(make_params())
  assert "count" in str(e.value) and "table" in str(e.value)  # the missing keys


def test_error_trainable_true_on_an_int_leaf_names_it(mesh):
  spec = dict(BOOL_TREE, count=True)
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, trainable=spec)
  with pytest.raises(ValueError, match=r"params\['count'\] of dtype int32"):
    step.init(make_params())


def test_error_trainable_leaf_not_a_bool_names_it(mesh):
  spec = dict(BOOL_TREE, head="a")  # e.g. a multi_transform label tree by mistake
  step = zj.make_sharded_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, trainable=spec)
  with pytest.raises(TypeError, match=r"trainable\['head'\] is 'a'"):
    step.init(make_params())


def test_prefix_true_over_a_subtree_freezes_its_int_leaves(mesh):
  params = {"layer": {"w": np.ones((3, 2), np.float32), "steps": np.zeros((), np.int32)}}
  step = zj.make_sharded_train_step(lambda p, b: jnp.mean(b @ p["layer"]["w"]),
                                    optax.sgd(0.1), mesh=mesh, trainable={"layer": True})
  state = step.init(params)
  assert state.meta.trainable == (False, True)  # sorted keys: steps, w
