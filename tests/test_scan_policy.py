"""`zj.scan(..., policy=)`: what each layer keeps for the backward pass.

With ``policy=None`` the step keeps what ``jax.lax.scan`` keeps (no layer is recomputed);
with a ``jax.checkpoint`` policy, what ``jax.checkpoint(f, policy=policy)`` saves. Either way
the numbers are those of the single-device reference, which runs the same loss (outside the
step ``zj.scan`` is ``lax.scan`` over ``jax.checkpoint(f, policy=policy)``), with SGD and
Adam, at stages 1-3, with hpZ, replica axes and accumulation (NNX: BatchNorm here, Dropout
in test_prefetch); and equal bit for bit to ``policy=None``'s, since recomputing a value gives
the same bits.
The gathered weights are never kept, nor what is computed from them alone (a cast): the
compiled loops carry no stack of whole layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import zero_jax as zj
from _feature_helpers import assert_tree_close, reference_run
from zero_jax.comm import hlo as hlo_lib

CP = jax.checkpoint_policies
W, STEPS = 12, 2
POLICIES = {
    "none": None,
    "nothing_saveable": CP.nothing_saveable,
    "everything_saveable": CP.everything_saveable,
    "dots_saveable": CP.dots_saveable,
    "only_z": CP.save_only_these_names("z"),
    "offload_z": CP.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["z"],
        offload_src="device", offload_dst="pinned_host"),
}


def make_params(layers):
  r = np.random.default_rng(0)
  f = lambda *s: (r.normal(size=s) * 0.4).astype(np.float32)
  return {"emb": f(5, W), "layers": {"w": f(layers, W, W), "b": f(layers, W)}, "head": f(W, 3)}


def make_loss(policy, prefetch=1, cast=False):
  """A layer that scales its weight (a value of the weight alone; with ``cast`` rounded to
  bf16 as a mixed-precision layer does), names its matmul ``z``, closes over ``p["emb"]``
  and emits a per-layer output."""
  def loss_fn(p, b):
    def layer(h, lp):
      w = lp["w"] * 1.5
      w = w.astype(jnp.bfloat16).astype(jnp.float32) if cast else w
      z = checkpoint_name(h @ w, "z")
      # a mask of constants broadcast against z inside jnp.where's jit: carry-free
      z = jnp.where(jnp.arange(z.shape[-1]) % 3 == 0, z * 0.5, z)
      h = jnp.tanh(z + lp["b"] + p["emb"][0])
      return h, jnp.mean(h, axis=-1)
    h, ys = zj.scan(layer, b["x"] @ p["emb"], p["layers"], prefetch=prefetch, policy=policy)
    return jnp.mean((h @ p["head"] - b["y"]) ** 2) + 0.1 * jnp.mean(ys)
  return loss_fn


def make_batches():
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(16, 5)).astype(np.float32),
           "y": r.normal(size=(16, 3)).astype(np.float32)} for _ in range(STEPS)]


def run(policy, *, layers, opt, mesh_shape=(8,), axes=("data",), prefetch=1, **kw):
  mesh = jax.make_mesh(mesh_shape, axes)
  step = zj.make_sharded_train_step(make_loss(policy, prefetch), opt, mesh=mesh,
                                    stacked={"emb": False, "layers": True, "head": False}, **kw)
  state, losses = step.init(make_params(layers)), []
  for b in make_batches():
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return step.get_params(state), losses


SGD, ADAM = lambda: optax.sgd(0.1), lambda: optax.adam(1e-2)
CASES = {
    "s3_sgd_5layers": (5, SGD, {"stage": 3}),
    "s3_adam_prefetch0": (3, ADAM, {"stage": 3, "prefetch": 0}),
    "s2_sgd_accum": (3, SGD, {"stage": 2, "grad_accum_steps": 2}),
    "s1_adam": (2, ADAM, {"stage": 1}),
    "s3_sgd_hpz_replica_accum": (4, SGD, {"stage": 3, "mesh_shape": (2, 2, 2),
                                          "axes": ("replica", "host", "data"),
                                          "replica_axis": "replica",
                                          "axis_name": ("host", "data"), "hpz_axis": "data",
                                          "grad_accum_steps": 2}),
}


def check(policy_name, case):
  layers, opt, kw = CASES[case]
  got, losses = run(POLICIES[policy_name], layers=layers, opt=opt(), **kw)
  ref, ref_losses, _ = reference_run(make_loss(POLICIES[policy_name]), opt(),
                                     make_params(layers), make_batches())
  assert_tree_close(got, ref[-1], what=f"{policy_name} {case} vs reference ")
  np.testing.assert_allclose(losses, [float(x) for x in ref_losses], rtol=1e-5)
  return got, losses


@pytest.mark.parametrize("policy_name", POLICIES)
def test_each_policy_equals_the_reference_and_policy_none_bit_for_bit(policy_name, full_compile):
  got, losses = check(policy_name, "s3_sgd_5layers")
  keep, keep_losses = run(None, layers=5, opt=SGD(), stage=3)
  assert_tree_close(got, keep, rtol=0, atol=0, what=f"{policy_name} vs policy=None ")
  assert losses == keep_losses


@pytest.mark.parametrize("case", [c for c in CASES if c != "s3_sgd_5layers"])
def test_a_policy_equals_the_reference_at_every_stage_and_mesh(case):
  check("dots_saveable", case)


def odd_calls_policy():
  """Saves what it is asked about on odd calls only: its answers depend on how often it has
  been asked, and zj.scan asks about each layer in several traces."""
  calls = [0]

  def policy(prim, *avals, **params):  # pylint: disable=unused-argument
    calls[0] += 1
    return calls[0] % 2 == 1
  return policy


@pytest.mark.parametrize("case", ["s3_sgd_5layers", "s3_adam_prefetch0", "s2_sgd_accum"])
def test_a_policy_whose_answers_depend_on_call_order_gives_the_reference(case, full_compile):
  """Issue 48: such a policy failed inside the loop ("dynamic_update_slice update shape must
  be smaller", an index out of range) where lax.scan over jax.checkpoint runs it. zj.scan
  asks it once per kind of operation: the numbers are the reference's (lax.scan over
  jax.checkpoint(policy=) on one device, to this module's tolerance) and policy=None's bit
  for bit, as for every policy (a recomputed value has the same bits)."""
  layers, opt, kw = CASES[case]
  got, losses = run(odd_calls_policy(), layers=layers, opt=opt(), **kw)
  ref, ref_losses, _ = reference_run(make_loss(odd_calls_policy()), opt(),
                                     make_params(layers), make_batches())
  assert_tree_close(got, ref[-1], what=f"odd calls {case} vs reference ")
  np.testing.assert_allclose(losses, [float(x) for x in ref_losses], rtol=1e-5)
  keep, keep_losses = run(None, layers=layers, opt=opt(), **kw)
  assert_tree_close(got, keep, rtol=0, atol=0, what=f"odd calls {case} vs policy=None ")
  assert losses == keep_losses


# ------------------------------------------------------- what the program keeps
DEEP, WIDE, ROWS = 6, 128, 16


def compiled(policy, mesh):
  params = {"emb": jax.ShapeDtypeStruct((5, WIDE), jnp.float32),
            "layers": {"w": jax.ShapeDtypeStruct((DEEP, WIDE, WIDE), jnp.float32),
                       "b": jax.ShapeDtypeStruct((DEEP, WIDE), jnp.float32)},
            "head": jax.ShapeDtypeStruct((WIDE, 3), jnp.float32)}
  batch = {"x": jax.ShapeDtypeStruct((ROWS * 8, 5), jnp.float32),
           "y": jax.ShapeDtypeStruct((ROWS * 8, 3), jnp.float32)}
  step = zj.make_sharded_train_step(make_loss(policy, cast=True), optax.sgd(0.1), mesh=mesh,
                                    stage=3,
                                    stacked={"emb": False, "layers": True, "head": False})
  return step.lower(step.abstract_state(params), batch).compile()


def test_kept_activations_are_stacked_but_never_the_gathered_or_cast_weights(mesh):
  progs = {k: compiled(POLICIES[k], mesh) for k in ("none", "nothing_saveable", "only_z")}
  for name, prog in progs.items():  # no loop carries every layer's weight (or its cast)
    text = prog.as_text()
    for loop in hlo_lib.loops(text):
      assert (DEEP, WIDE, WIDE) not in loop.carried, (name, loop.carried)
  # The forward loop stacks the residuals of the layers it runs, all but the first and the
  # last (run outside the loops, their residuals kept apart: `zero_jax.layers.loops.span`):
  # 3 a layer kept, 2 with only z.
  stacks = {k: sum(c == (DEEP - 2, ROWS, WIDE) for c in hlo_lib.loops(p.as_text())[0].carried)
            for k, p in progs.items()}
  assert stacks == {"none": 3, "nothing_saveable": 1, "only_z": 2}, stacks
  temp = {k: p.memory_analysis().temp_size_in_bytes for k, p in progs.items()}
  act = (DEEP - 1) * ROWS * WIDE * 4  # one activation per stacked layer
  # nothing_saveable keeps the carries only; naming z keeps one more activation per layer;
  # keeping all (lax.scan's) keeps more again (a margin of 1/16 activation for XLA's layout).
  assert temp["nothing_saveable"] + act - act // 16 <= temp["only_z"] <= temp["none"], temp
  # the backward loop recomputes the layer's matmul under nothing_saveable only
  dots = {k: p.as_text().count(" dot(") for k, p in progs.items()}
  assert dots["nothing_saveable"] > dots["only_z"] == dots["none"], dots


def test_a_policy_that_is_not_a_policy_or_an_uncalled_factory_is_refused_by_name():
  with pytest.raises(TypeError, match=r"policy='dots'.*jax.checkpoint_policies"):
    zj.scan(lambda h, w: (h @ w, None), jnp.ones((2, 3)), jnp.ones((4, 3, 3)), policy="dots")
  factory = jax.checkpoint_policies.save_only_these_names
  with pytest.raises(TypeError, match=r"policy=jax.checkpoint_policies.save_only_these_names "
                                      r"makes a policy from its arguments; call it"):
    zj.scan(lambda h, w: (h @ w, None), jnp.ones((2, 3)), jnp.ones((4, 3, 3)), policy=factory)
  zj.scan(lambda h, w: (h @ w, None), jnp.ones((2, 3)), jnp.ones((4, 3, 3)),
          policy=factory("z"))  # called: a policy


@pytest.mark.parametrize("not_a_policy", [jax.checkpoint, lambda: True],
                         ids=["jax.checkpoint", "lambda_of_no_arguments"])
def test_a_callable_that_is_not_a_policy_is_refused_by_name_when_zj_scan_is_called(
    not_a_policy):
  # jax.checkpoint calls a policy as policy(primitive, *avals, **params); a transform, or a
  # function of other arguments, is refused at once (not deep in the step's backward pass,
  # nor never outside it, where nothing is differentiated).
  with pytest.raises(TypeError, match=r"policy=.* fails when called as a jax.checkpoint "
                                      r"policy.*here a matmul\): TypeError.*"
                                      r"jax.checkpoint_policies"):
    zj.scan(lambda h, w: (h @ w, None), jnp.ones((2, 3)), jnp.ones((4, 3, 3)),
            policy=not_a_policy)


# ---------------------------------------------- NNX: statistics the layer updates
class NormBlock(nnx.Module):
  """A layer whose BatchNorm statistics (float model state) leave the scan beside its
  carry; no bias before the BatchNorm (its gradient is zero, which Adam would amplify)."""

  def __init__(self, rngs):
    self.lin = nnx.Linear(W, W, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(W, momentum=0.8, rngs=rngs)

  def __call__(self, x):
    return x + jnp.tanh(self.bn(checkpoint_name(self.lin(x), "z")))


class NormStack(nnx.Module):
  def __init__(self, rngs, loop, policy):
    self.loop, self.policy = loop, policy
    self.embed = nnx.Linear(5, W, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NormBlock(rngs)
    self.blocks = make(rngs)
    self.head = nnx.Linear(W, 3, rngs=rngs)

  def __call__(self, x):
    if self.loop == "nnx.scan":
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat(policy=self.policy)
      def layer(h, block):
        return zj.gather(block)(h)
      return self.head(layer(self.embed(x), self.blocks))
    h, _ = zj.scan(lambda h, block: (block(h), None), self.embed(x), self.blocks,
                   policy=self.policy)
    return self.head(h)


@pytest.mark.parametrize("stage,policy_name", [(2, "none"), (3, "only_z")])
def test_batchnorm_statistics_and_params_through_a_policy_equal_nnx_scan(mesh, stage,
                                                                         policy_name):
  r = np.random.default_rng(2)
  batches = [{"x": r.normal(size=(64, 5)).astype(np.float32),
              "y": r.normal(size=(64, 3)).astype(np.float32)} for _ in range(STEPS)]
  got = {}
  for loop in ("zj.scan", "nnx.scan"):
    step = zj.make_sharded_train_step(
        lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), optax.sgd(0.1), mesh=mesh,
        stage=stage, stacked=nnx.PathContains("blocks"))
    model = NormStack(nnx.Rngs(0), loop, POLICIES[policy_name])
    state = step.init(model)
    for b in batches:
      state, _ = step(state, b)
    got[loop] = nnx.state(step.get_model(state))
  assert_tree_close(got["zj.scan"], got["nnx.scan"], rtol=1e-5, what="zj.scan vs nnx.scan ")
  assert not np.allclose(got["zj.scan"]["blocks"]["bn"]["mean"][...], 0)  # they moved
