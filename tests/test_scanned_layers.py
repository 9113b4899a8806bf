"""A Flax language model's blocks, scanned and gathered one at a time at stage 3.

The model is lm1b's decoder in miniature: embedding, pre-LayerNorm blocks of
causal self-attention and an MLP, all parameters boxed with
``nn.with_logical_partitioning`` as lm1b boxes them, and a masked token loss
(`zj.WeightedLoss`). Written with a Python loop, its blocks are
``layers_0`` ... ``layers_{L-1}``; written for ``stacked=``, one block is
wrapped in ``nn.map_variables(..., trans_in_fn=zj.gather)``, ``nn.remat`` and
``nn.scan`` (which needs ``metadata_params`` for boxed parameters). The
scanned model trained at stage 3 from `zj.stack_layers` of the loop model's
parameters must equal the loop model trained on one device, once
`zj.unstack_layers` brings its parameters back.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run

VOCAB, DIM, LAYERS, LENGTH, BATCH = 13, 12, 3, 8, 16


class Block(nn.Module):
  """A pre-LayerNorm decoder block; ``box`` wraps its initialisers (lm1b: logical names)."""
  box: callable = nn.with_logical_partitioning

  @nn.compact
  def __call__(self, x, _=None):
    box, init = self.box, nn.initializers.xavier_uniform()
    norm = lambda: nn.LayerNorm(scale_init=box(nn.initializers.ones, ("embed",)),
                                bias_init=box(nn.initializers.zeros, ("embed",)))
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    y = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, use_bias=False,
                         kernel_init=box(init, ("embed", "kv")))(norm()(x), mask=mask)
    x = x + y
    z = nn.Dense(2 * DIM, kernel_init=box(init, ("embed", "mlp")),
                 bias_init=box(nn.initializers.zeros, ("mlp",)))(norm()(x))
    z = nn.Dense(DIM, kernel_init=box(init, ("mlp", "embed")),
                 bias_init=box(nn.initializers.zeros, ("embed",)))(nn.relu(z))
    return x + z, None


class LM(nn.Module):
  """``scanned=False``: a loop over blocks ``layers_i``; True: one scanned block ``layers``."""
  scanned: bool
  box: callable = nn.with_logical_partitioning

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, DIM, embedding_init=self.box(nn.initializers.normal(1.0),
                                                         ("vocab", "embed")))
    x = embed(tokens)
    if self.scanned:
      block = nn.map_variables(Block, "params", trans_in_fn=zj.gather,
                               init=self.is_initializing())
      stack = nn.scan(nn.remat(block), variable_axes={"params": 0},
                      split_rngs={"params": True}, length=LAYERS,
                      metadata_params={nn.PARTITION_NAME: None})  # needed for boxed params
      x, _ = stack(box=self.box, name="layers")(x, None)
    else:
      for i in range(LAYERS):
        x, _ = Block(box=self.box, name=f"layers_{i}")(x)
    x = nn.LayerNorm(name="final_norm")(x)
    return embed.attend(x)


def make_loss(model):
  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return zj.WeightedLoss((ce * batch["mask"]).sum(), batch["mask"].sum())
  return loss_fn


def global_mean(model):
  loss_fn = make_loss(model)
  return lambda p, b: (lambda out: out.total / out.weight)(loss_fn(p, b))


def make_batches(n=2):
  r = np.random.default_rng(1)
  out = []
  for _ in range(n):
    lengths = r.integers(1, LENGTH + 1, size=BATCH)
    out.append({"inputs": r.integers(0, VOCAB, size=(BATCH, LENGTH)).astype(np.int32),
                "targets": r.integers(0, VOCAB, size=(BATCH, LENGTH)).astype(np.int32),
                "mask": (np.arange(LENGTH) < lengths[:, None]).astype(np.float32)})
  return out


@functools.lru_cache  # each model is initialised once per session
def init_params(scanned=False, box=nn.with_logical_partitioning):
  tokens = jnp.zeros((1, LENGTH), jnp.int32)
  return jax.jit(LM(scanned, box).init)(jax.random.key(0), tokens)["params"]


def is_stacked(path, _):
  return jax.tree_util.keystr(path).startswith("['layers']")


def test_stack_layers_gives_the_scanned_models_tree_and_outputs():
  params = init_params()
  stacked = zj.stack_layers(params, "layers_")
  # The same tree as the scanned model's own init, boxes and axis names included.
  assert jax.tree.structure(stacked) == jax.tree.structure(init_params(scanned=True))
  assert stacked["layers"]["Dense_0"]["kernel"].names == (None, "embed", "mlp")
  apply = lambda model, p, x: jax.jit(model.apply)({"params": p}, x)
  tokens = make_batches(1)[0]["inputs"]
  np.testing.assert_allclose(apply(LM(scanned=True), stacked, tokens),
                             apply(LM(scanned=False), params, tokens), rtol=1e-5, atol=1e-5)
  back = zj.unstack_layers(stacked, "layers")
  assert jax.tree.structure(back) == jax.tree.structure(params)
  assert_tree_close(back, params, rtol=0, atol=0)


def tensor_parallel(init, names):
  """nn.with_partitioning over mesh axes: the MLP's and attention's inner dims on "model"."""
  return nn.with_partitioning(init, tuple("model" if n in ("mlp", "kv") else None
                                          for n in names))


@pytest.mark.parametrize("box", [nn.with_logical_partitioning, tensor_parallel])
def test_scanned_boxed_model_at_stage3_equals_the_loop_model_on_one_device(mesh, box):
  # lm1b's logical boxes, on the 8-device data mesh; or boxes naming a model axis of a
  # (data 4, model 2) mesh, whose names give the step its param_specs.
  params = init_params(box=box)
  batches = make_batches()
  ref, ref_losses, _ = reference_run(global_mean(LM(scanned=False, box=box)), optax.adam(1e-2),
                                     params, batches)
  stacked = zj.stack_layers(params, "layers_")
  kw = {"mesh": mesh}
  if box is tensor_parallel:
    kw = {"mesh": jax.make_mesh((4, 2), ("data", "model")),
          "param_specs": nn.get_partition_spec(stacked)}
  step = zj.make_sharded_train_step(make_loss(LM(scanned=True, box=box)), optax.adam(1e-2),
                                    stage=3, stacked=is_stacked, **kw)
  state = step.init(stacked)
  assert sum(state.meta.stacked) == 12  # every leaf of the block, none outside it
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  got = zj.unstack_layers(step.get_params(state), "layers")
  assert_tree_close(got, ref[-1], rtol=1e-5, atol=1e-6, what="unstacked")
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("names,match", [
    (("data", None), r"'data' is a batch axis of the step"),
    (("embed", "mlp"), r"'embed' is not an axis of the mesh \('data',\)")])
def test_partitioned_names_flax_cannot_apply_in_the_step_are_refused_at_init(mesh, names,
                                                                              match):
  box = nn.with_partitioning(nn.initializers.ones, names)
  params = {"dense": {"kernel": box(jax.random.key(0), (4, 3)), "bias": jnp.zeros(3)}}
  step = zj.make_sharded_train_step(lambda p, b: jnp.mean(b @ p["dense"]["kernel"]),
                                    optax.sgd(0.1), mesh=mesh)
  with pytest.raises(ValueError, match=r"params\['dense'\]\['kernel'\] is an nn.Partitioned box.*"
                                       + match + r".*with_logical_partitioning"):
    step.init(params)


# ------------------------------------------------------------------ the helpers alone
def test_stack_and_unstack_a_list_of_layers():
  r = np.random.default_rng(0)
  layers = [{"w": r.normal(size=(3, 2)), "b": nn.Partitioned(r.normal(size=2), ("model",))}
            for _ in range(4)]
  stacked = zj.stack_layers(layers, partition_name="layers")
  assert isinstance(stacked["w"], np.ndarray) and stacked["w"].shape == (4, 3, 2)
  assert stacked["b"].names == ("layers", "model") and stacked["b"].value.shape == (4, 2)
  back = zj.unstack_layers(stacked)
  assert len(back) == 4 and back[2]["b"].names == ("model",)
  assert_tree_close(back[2], layers[2], rtol=0, atol=0)
  shapes = zj.stack_layers([{"w": jax.ShapeDtypeStruct((3,), jnp.bfloat16)}] * 5)
  assert shapes["w"] == jax.ShapeDtypeStruct((5, 3), jnp.bfloat16)


def test_nested_runs_of_layers_are_each_stacked():
  layer = lambda v: {"w": np.full((2,), v, np.float32)}
  params = {"encoder": {f"block_{i}": layer(i) for i in range(3)},
            "decoder": {f"block_{i}": layer(10 + i) for i in range(12)}, "head": np.ones(2)}
  stacked = zj.stack_layers(params, "block_", name="blocks")
  assert stacked["encoder"]["blocks"]["w"][:, 0].tolist() == [0, 1, 2]
  assert stacked["decoder"]["blocks"]["w"][:, 0].tolist() == list(range(10, 22))  # 10 after 9
  assert_tree_close(zj.unstack_layers(stacked, "blocks", prefix="block_"), params, rtol=0, atol=0)


@pytest.mark.parametrize("call,match", [
    (lambda: zj.stack_layers({"a": {"l_0": {"w": np.ones(3)}, "l_1": {"w": np.ones(4)}}}, "l_"),
     r"params\['a'\]\['l_1'\]\['w'\] is float64\[4\], params\['a'\]\['l_0'\]\['w'\] is "
     r"float64\[3\]"),
    (lambda: zj.stack_layers({"l_0": {"w": np.ones(3)}, "l_2": {"w": np.ones(3)}}, "l_"),
     r"no l_1.*without gaps"),
    (lambda: zj.stack_layers([{"w": np.ones(3)}, {"v": np.ones(3)}]),
     r"layers\[1\] has another tree structure"),
    (lambda: zj.stack_layers({"w": np.ones(3)}, "layers_"), r"no dict in params has a key layers_0"),
    (lambda: zj.unstack_layers({"w": np.ones((3, 2)), "b": np.ones(2)}),
     r"stacked\['w'\] is float64\[3, 2\] and stacked\['b'\] is float64\[2\]"),
])
def test_helpers_name_the_leaf_that_does_not_fit(call, match):
  with pytest.raises(ValueError, match=match):
    call()
