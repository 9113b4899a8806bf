"""XLA:GPU's schedule of a stage-3 ``zj.scan(prefetch=1)`` step: every per-layer collective of
the forward and backward layer loops has another layer's matmuls inside its start..done window,
with the step's default compile (no option set by the user), on every target the project lists
(H100, H200, A100), on one host and across two (hpZ, a replica axis, both), alone and inside a
user's jit made with ``step.jit``; compiled without the step's options, a window is empty."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj
from zero_jax.comm import hlo
from zero_jax.gpu import schedule

LAYERS, WIDTH = 6, 512
LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"
# name: (hosts, step options); a 2-D mesh is ("hosts", "data"), hosts along the first axis
CONFIGS = {
    "one host": (1, {}),
    "hpZ": (2, {"axis_name": ("hosts", "data"), "hpz_axis": "data"}),
    "replica": (2, {"axis_name": "data", "replica_axis": "hosts"}),
    # hpZ within a host of 2 x 4 and a replica axis across the hosts: (hosts, group, data)
    "both": (2, {"axis_name": ("group", "data"), "hpz_axis": "data", "replica_axis": "hosts"}),
}
GPUS = ("h100", "h200", "a100")
NOT_THE_STEPS = {LIMIT: 1, "xla_gpu_enable_latency_hiding_scheduler": False,
                 "xla_gpu_experimental_collective_start_as_early_as_possible": False}


def loss_fn(p, b):
  def layer(h, w):
    return jnp.tanh(h @ w["up"]) @ w["down"], None
  h, _ = zj.scan(layer, b, p["layers"], prefetch=1)
  return jnp.mean(h.astype(jnp.float32) ** 2)


def make_step(name, gpu="h100"):
  hosts, options = CONFIGS[name]
  mesh = (zj.compile_only_mesh((8,), ("data",), gpu=gpu) if hosts == 1 else
          zj.compile_only_mesh((2, 2, 4), ("hosts", "group", "data"), gpu=gpu, hosts=2)
          if name == "both" else zj.compile_only_mesh((2, 8), ("hosts", "data"), gpu=gpu,
                                                      hosts=2))
  return zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), mesh=mesh, stage=3,
                                    stacked=True, precision="bf16", **options)


def inputs(step, name):
  shape = (LAYERS, WIDTH, WIDTH)
  params = {"layers": {k: jax.ShapeDtypeStruct(shape, jnp.float32) for k in ("up", "down")}}
  rows = 16 * 8 * CONFIGS[name][0]
  return step.abstract_state(params), jax.ShapeDtypeStruct((rows, WIDTH), jnp.float32)


def lowered(name, gpu="h100"):
  step = make_step(name, gpu)
  return step.lower(*inputs(step, name))


@pytest.fixture(scope="module")
def compiled():
  cache = {}

  def get(name, gpu="h100"):
    if (name, gpu) not in cache:
      cache[name, gpu] = lowered(name, gpu).compile().as_text()
    return cache[name, gpu]
  return get


def layer_loops(text):
  """(forward, backward) layer loops: the backward one reduce-scatters."""
  loops = [l for l in schedule.loops(text) if l.windows]
  bwd = [l for l in loops if any(w.op == "reduce-scatter" for w in l.windows)]
  fwd = [l for l in loops if l not in bwd]
  assert len(fwd) == 1 and len(bwd) == 1, loops
  return fwd[0], bwd[0]


def crosses_hosts(w):
  return any(len({d // 8 for d in g}) > 1 for g in w.groups)


def check_overlapped(text, name):
  fwd, bwd = layer_loops(text)
  # the next layer, while this computes: one all-gather a layer (its leaves joined by XLA),
  # two layers an iteration on one host (`zero_jax.layers.loops.UNROLL`), one where the blocks
  # vary over fewer axes than the activations (hpZ, a replica axis: `Stack.unroll`)
  k = 2 if name == "one host" else 1
  assert [w.op for w in fwd.windows] == ["all-gather"] * k
  expected = {"one host": ["all-gather", "reduce-scatter"],
              "hpZ": ["all-gather", "reduce-scatter", "reduce-scatter"],
              "replica": ["all-gather", "all-reduce", "reduce-scatter"],
              "both": ["all-gather", "all-reduce", "reduce-scatter", "reduce-scatter"]}[name]
  assert sorted(w.op for w in bwd.windows) == sorted(expected * k)
  assert [crosses_hosts(w) for w in bwd.windows].count(True) == (name != "one host") * k
  for loop in (fwd, bwd):
    for w in loop.windows:
      assert w.overlapped and w.flops > 0, (loop.name, w)
  return fwd, bwd


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("name", CONFIGS)
def test_every_layer_collective_has_another_layers_matmuls_in_its_window(compiled, name, gpu):
  text = compiled(name, gpu)
  fwd, bwd = check_overlapped(text, name)
  assert not schedule.synchronous(text)
  # the loops' collectives are async pairs XLA keeps asynchronous
  names = {w.name for l in (fwd, bwd) for w in l.windows}
  assert not [s for s in schedule.run_synchronously(text) if s.split()[1] in names]


def test_the_step_chooses_its_options_from_its_mesh_and_hops():
  combine = {f"xla_gpu_{op}_combine_threshold_bytes": 512 << 20
             for op in ("all_gather", "reduce_scatter", "all_reduce")}
  assert make_step("one host").compiler_options == {
      LIMIT: 2, "xla_gpu_enable_latency_hiding_scheduler": True,
      "xla_gpu_experimental_collective_start_as_early_as_possible": True, **combine}
  assert make_step("hpZ").compiler_options[LIMIT] == 3
  assert make_step("replica").compiler_options[LIMIT] == 3
  assert make_step("both").compiler_options[LIMIT] == 4
  cpu = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), stage=3, stacked=True,
                                   mesh=jax.make_mesh((8,), ("data",)))
  assert cpu.compiler_options == {LIMIT: 2}  # no GPU option on a CPU mesh


@pytest.mark.parametrize("gpu,name", [("h100", "one host"), ("h100", "hpZ"), ("h200", "both"),
                                      ("a100", "hpZ")])
def test_compiled_without_the_steps_options_a_backward_window_is_empty(gpu, name):
  """The check can fail: compiled with XLA's defaults (one collective in flight; A100: no
  latency-hiding scheduler), a backward loop's collective waits with no compute. (On one host
  of A100s, two layers an iteration overlap every window with XLA's defaults too.)"""
  text = lowered(name, gpu).compile(compiler_options=NOT_THE_STEPS).as_text()
  fwd, bwd = layer_loops(text)
  assert not all(w.overlapped for l in (fwd, bwd) for w in l.windows), (fwd.windows, bwd.windows)


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_inside_step_jit_the_overlap_holds_and_nothing_warns(gpu):
  step = make_step("hpZ", gpu)
  state, batch = inputs(step, "hpZ")
  two = step.jit(lambda s, b: step(step(s, b)[0], b))  # two steps in one program
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    text = two.lower(state, batch).compile().as_text()
  loops = [l for l in schedule.loops(text) if l.windows]
  assert len(loops) == 4  # two steps' forward and backward loops
  assert all(w.overlapped for l in loops for w in l.windows), loops


def test_inside_a_users_own_jit_on_gpus_the_step_warns_once_naming_the_fix():
  step = make_step("hpZ", "a100")
  state, batch = inputs(step, "hpZ")
  with pytest.warns(RuntimeWarning, match=r"(?s)another jax.jit.*step.jit\(fn.*"
                                          r"compiler_options=step.compiler_options"):
    jax.jit(lambda s, b: step(s, b)).lower(state, batch)
  with warnings.catch_warnings():  # once per step
    warnings.simplefilter("error")
    jax.jit(lambda s, b: step(s, b)[1]).lower(state, batch)


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_the_layer_loops_copy_nothing_a_layer_hands_to_the_next(compiled, gpu):
  """Two layers an iteration (`zero_jax.layers.loops.UNROLL`): the gathered weights, the
  gradients reduced one layer late and the carry are written in place. With one layer an
  iteration XLA copied each into the loop's carry: both weights and both gradients
  (bf16 512 x 512) and the activations (f32 16 x 512), every layer."""
  text = compiled("one host", gpu)
  comps = hlo._computations(text)  # pylint: disable=protected-access
  for loop in layer_loops(text):
    body = [i for i in map(hlo.parse_instruction, comps[loop.body]) if i]
    copies = [(i.name, i.shape_text) for i in body if i.op == "copy"
              and hlo.shapes_in(i.shape_text) != [()]]
    assert not copies, (loop.name, copies)
