"""offload="optimizer": optimizer state and master copy in pinned host memory between steps.

On 8 CPU devices (whose ``pinned_host`` memory exists and moves inside
``jit``, though XLA:CPU drops the moves when it compiles), an offloaded run
must equal the single-device optax reference (SGD and Adam, stages 1-3) and
the same run without offload (bf16, and optimizers that are not elementwise),
keep the optimizer state and master copy on the host after every step and the
parameters on the devices, leave the host state bit-identical on a skipped
fp16 step, and checkpoint to and from runs without offload. The order of the
transfers is checked in the program lowered for CUDA, which is what a GPU
would compile (on CPU, JAX lowers ``device_put`` inside ``jit`` to nothing).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from zero_jax.step import offload
from _feature_helpers import assert_tree_close, reference_run
from _small_mlp import init_params, loss_fn

STEPS = 5
HOST, DEVICE = "pinned_host", "device"
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1), "adam": lambda: optax.adam(1e-2)}


def make_batches(steps=STEPS):
  r = np.random.default_rng(1)
  return [{"x": r.normal(size=(16, 9)).astype(np.float32),
           "y": r.normal(size=(16, 5)).astype(np.float32)} for _ in range(steps)]


BATCHES = make_batches()


@pytest.fixture
def per_leaf(monkeypatch):
  """One group per bucket, so that the tiny test model streams leaf by leaf."""
  monkeypatch.setattr(offload, "BUCKET_BYTES", 0)


def kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def assert_placed(state):
  """Optimizer state and master copy on the host, everything else on the devices."""
  assert kinds((state.opt_state, state.master)) <= {HOST}  # empty for plain SGD in fp32
  assert kinds((state.step, state.params, state.loss_scale)) == {DEVICE}


def run(mesh, optimizer, batches=BATCHES, *, check=True, **options):
  step = zj.make_sharded_train_step(loss_fn, optimizer, mesh=mesh, **options)
  state = step.init(init_params())
  if check and options.get("offload"):
    assert_placed(state)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
    if check and options.get("offload"):
      assert_placed(state)
  return step, state, losses


def host_arrays(state):
  return [np.array(x) for x in jax.tree.leaves((state.opt_state, state.master, state.params))]


# --------------------------------------------------------------- exactness
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_offloaded_run_equals_the_single_device_reference(mesh, per_leaf, opt, stage):
  step, state, losses = run(mesh, OPTIMIZERS[opt](), stage=stage, offload="optimizer")
  ref, ref_losses, _ = reference_run(loss_fn, OPTIMIZERS[opt](), init_params(), BATCHES)
  assert_tree_close(step.get_params(state), ref[-1], rtol=1e-5)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_offloaded_equals_bf16_on_device_bit_for_bit(mesh, per_leaf, stage, full_compile):
  on = run(mesh, optax.adamw(1e-2), stage=stage, precision="bf16", offload="optimizer")
  off = run(mesh, optax.adamw(1e-2), stage=stage, precision="bf16")
  assert on[2] == off[2]
  for a, b in zip(host_arrays(on[1]), host_arrays(off[1])):
    np.testing.assert_array_equal(a, b)


NOT_ELEMENTWISE = {  # name: (optimizer, number of groups of the tiny MLP's leaves, or None)
    "lamb": (lambda: optax.lamb(1e-2), 4),
    "clip then adam": (lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
                       4),
    "adam then clip": (lambda: optax.chain(optax.adam(1e-2), optax.clip_by_global_norm(1e-3)),
                       1),
    "adafactor": (lambda: optax.adafactor(1e-2), None),
    "multi_transform": (lambda: optax.multi_transform(
        {"m": optax.adamw(1e-2, weight_decay=0.1), "v": optax.sgd(0.1, momentum=0.9)},
        lambda p: jax.tree.map(lambda x: "m" if jnp.ndim(x) > 1 else "v", p)), None),
}


@pytest.mark.parametrize("name", list(NOT_ELEMENTWISE))
def test_optimizers_that_are_not_elementwise_stay_exact(mesh, per_leaf, monkeypatch, name):
  """LAMB's trust ratio and a clip before Adam need one leaf (or only gradients) at a time,
  so the leaves still stream; a clip after Adam needs every moment: one group."""
  optimizer, groups = NOT_ELEMENTWISE[name]
  plans = []
  plan = offload.plan
  monkeypatch.setattr(offload, "plan", lambda *a: plans.append(plan(*a)) or plans[-1])
  batches = BATCHES[:3]
  on = run(mesh, optimizer(), batches, offload="optimizer")
  off = run(mesh, optimizer(), batches)
  assert groups is None or len(plans[0]) == groups, (name, plans[0])
  np.testing.assert_allclose(on[2], off[2], rtol=1e-6)
  assert_tree_close(on[0].get_params(on[1]), off[0].get_params(off[1]), rtol=1e-6, atol=1e-7)


def test_plan_groups_leaves_that_meet_in_an_output():
  """a and b meet in one output, c is alone, d is read by nothing; buckets merge by weight."""
  def fn(g, a, b, c, d):
    del d
    return a * g + b, c + jnp.sum(g), b * 2
  jaxpr = jax.make_jaxpr(fn)(*[jnp.ones(3)] * 5).jaxpr
  inputs = [1, 2, 3, 4]
  assert offload.plan(jaxpr, inputs, [4, 4, 4, 4], 0) == [([1, 2], [0, 2]), ([3], [1])]
  assert offload.plan(jaxpr, inputs, [4, 4, 4, 4], 12) == [([1, 2, 3], [0, 1, 2])]


# ----------------------------------------------------------- where it lives
def test_skipped_fp16_step_leaves_the_host_state_bit_identical(mesh, per_leaf):
  step, state, _ = run(mesh, optax.adam(1e-2), BATCHES[:2], stage=2, precision="fp16",
                       offload="optimizer")
  before, skipped = host_arrays(state), int(state.loss_scale.skipped_steps)
  bad = dict(BATCHES[2], x=np.full_like(BATCHES[2]["x"], np.inf))
  state, metrics = step(state, bad)
  assert not bool(metrics["grads_finite"])
  assert int(metrics["skipped_steps"]) == skipped + 1
  assert_placed(state)
  for a, b in zip(host_arrays(state), before):
    np.testing.assert_array_equal(a, b)


def test_abstract_state_and_get_params(mesh):
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=3,
                                    precision="bf16", offload="optimizer")
  abstract = step.abstract_state(init_params())
  assert {x.sharding.memory_kind for x in jax.tree.leaves(abstract.opt_state)} == {HOST}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(abstract.master)} == {HOST}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(abstract.params)} == {DEVICE}
  params = step.get_params(step.init(init_params()))
  assert kinds(params) == {DEVICE}
  assert_tree_close(params, jax.tree.map(np.asarray, init_params()))


@pytest.mark.parametrize("saved,restored", [("optimizer", None), (None, "optimizer")])
def test_checkpoint_restores_with_and_without_offload(mesh, tmp_path, saved, restored):
  """Saved on 8 devices at stage 2, restored on 4 devices at stage 3, offload switched."""
  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  make = lambda m, stage, off: zj.make_sharded_train_step(
      loss_fn, optax.adam(1e-2), mesh=m, stage=stage, precision="bf16", offload=off)
  a, b = make(mesh, 2, saved), make(mesh4, 3, restored)
  state, _ = a(a.init(init_params()), BATCHES[0])
  with zj.CheckpointManager(tmp_path, async_save=False) as mngr:
    mngr.save(state)
    back = mngr.restore(b, init_params())
  assert kinds((back.opt_state, back.master)) == {HOST if restored else DEVICE}
  assert kinds(back.params) == {DEVICE}
  assert_tree_close(b.get_params(back), a.get_params(state), rtol=0, atol=0)  # the masters
  logical = lambda s: [np.asarray(x)[tuple(slice(0, d) for d in l.shape)]
                       for x, l in zip(jax.tree.leaves(s.opt_state), s.meta.opt_layouts)]
  for x, y in zip(logical(back), logical(state)):
    np.testing.assert_array_equal(x, y)
  state, m1 = a(state, BATCHES[1])
  back, m2 = b(back, BATCHES[1])
  # bf16 gradients are reduced in another order on 4 devices: about a bf16 rounding apart.
  np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
  assert_tree_close(b.get_params(back), a.get_params(state), rtol=2**-7, atol=1e-4)


def test_memory_report_puts_optimizer_state_and_master_on_the_host():
  params = {"w": jax.ShapeDtypeStruct((1024, 64), jnp.float32)}
  plain = zj.memory_report(params, optax.adam(1e-3), n_devices=8, precision="bf16")
  rep = zj.memory_report(params, optax.adam(1e-3), n_devices=8, precision="bf16",
                         offload="optimizer")
  psi = 1024 * 64
  for stage in (1, 2, 3):
    assert rep[stage].host == rep[stage].optimizer_state + rep[stage].master
    assert rep[stage].host == 12 * psi // 8 + 4  # m, v and master 1/N; Adam's count
    # stage 3 offloaded keeps the bf16 copy on the device to gather from (2 psi/N), which
    # stage 3 on the device does without (its fp32 master is the parameter)
    half = 2 * psi // 8 if stage == 3 else 0
    assert rep[stage].params - plain[stage].params == half
    assert rep[stage].device == plain[stage].total - rep[stage].host + half
  assert rep[0].host == 0 and rep[0].device == plain[0].total
  table = str(rep)
  assert "on host" in table and "on device" in table and "offload='optimizer'" in table
  assert rep.as_dict()[2]["device"] == rep[2].device
  with pytest.raises(ValueError, match="offload='cpu'"):
    zj.memory_report(params, optax.adam(1e-3), n_devices=8, offload="cpu")


def test_a_backend_without_pinned_host_memory_is_refused_naming_the_fix(mesh, monkeypatch):
  device_type = type(jax.devices()[0])
  memories = device_type.addressable_memories
  monkeypatch.setattr(device_type, "addressable_memories",
                      lambda d: [m for m in memories(d) if m.kind != HOST])
  with pytest.raises(ValueError) as e:
    zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, offload="optimizer")
  message = str(e.value)
  for words in ("offload='optimizer'", "'pinned_host'", "platform 'cpu'", "['device', "
                "'unpinned_host']", "Use offload=None"):
    assert words in message, (words, message)
  zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh)  # offload=None still builds
  with pytest.raises(ValueError, match="choose None"):
    zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, offload="cpu")


# ------------------------------------------------------------ transfer order
_MOVE = re.compile(r"(%\S+) = stablehlo.custom_call @annotate_device_placement\((%[\w#]+)\).*"
                   r"_xla_buffer_placement = \"(\w+)\"")
_BARRIER = re.compile(r"(%[\w]+)(?::\d+)? = stablehlo.optimization_barrier (.*?) :")


def transfer_events(text):
  """``[(kind, result, operands)]`` of the moves and barriers in ``@main``, in program order."""
  main = text[text.index("func.func public @main"):]
  main = main[:main.index("\n  }\n")]
  out = []
  for line in main.splitlines():
    m = _MOVE.search(line)
    if m:
      out.append((m.group(3), m.group(1), [m.group(2)]))
    m = _BARRIER.search(line)
    if m:
      out.append(("barrier", m.group(1), [v.strip() for v in m.group(2).split(",")]))
  return out


def test_gpu_program_streams_each_bucket_after_the_one_two_before_is_written_back(
    mesh, per_leaf):
  """In the program lowered for CUDA, bucket b's host arguments enter a barrier together
  with the stores of bucket b - 2, and every store precedes the outputs' annotations."""
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh, stage=2,
                                    precision="bf16", offload="optimizer")
  state = step.init(init_params())
  text = step.lower(state, BATCHES[0], lowering_platforms=("cuda",)).as_text()
  events = transfer_events(text)
  barriers = [e for e in events if e[0] == "barrier"]
  # 4 non-scalar parameters: buckets of (mu, nu, master); barriers before buckets 2 and 3.
  assert len(barriers) == 2, events
  stores = [e[1] for e in events if e[0] == HOST]
  for k, (_, _, operands) in enumerate(barriers):
    args, tied = operands[:3], operands[3:]
    assert all(a.startswith("%arg") for a in args), operands
    assert tied == stores[3 * k:3 * k + 3], (tied, stores)  # bucket k's stores
