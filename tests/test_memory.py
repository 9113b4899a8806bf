"""`zj.memory_report` and `zj.compiled_memory` against the bytes a real state holds."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax.comm import collectives
from zero_jax.comm.layout import leaf_layout

N = 8



def uneven_params():
  """Leaves that do not split evenly over 8 devices, a scalar and an int leaf."""
  k = jax.random.split(jax.random.key(0), 4)
  return {
      "w": jax.random.normal(k[0], (9, 7)),
      "b": jax.random.normal(k[1], (5,)),
      "s": jnp.float32(0.5),
      "k": jax.random.normal(k[2], (3, 4, 5)),
      "emb": jax.random.normal(k[3], (13, 6)),
      "ids": jnp.arange(3, dtype=jnp.int32),  # non-float: always frozen
  }


def loss_fn(p, batch):
  h = jnp.tanh(batch["x"] @ p["w"]) * p["s"]
  return (jnp.mean(h ** 2) + jnp.mean(p["b"] ** 2) + jnp.mean(p["k"] ** 2)
          + jnp.mean(p["emb"] ** 2) + 0.0 * p["ids"].sum())


def shard_bytes(tree) -> int:
  """Bytes device 0 holds for a tree of (possibly sharded) arrays."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "sgd": lambda: optax.sgd(1e-2),
    "sgd_momentum_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                             optax.sgd(1e-2, momentum=0.9)),
    "lamb": lambda: optax.lamb(1e-3),
}

CASES = [
    (1, "fp32", "adam", None),
    (2, "fp32", "adam", None),
    (3, "fp32", "adam", None),
    (2, "bf16", "adam", None),
    (3, "bf16", "sgd_momentum_clip", None),
    (3, "fp16", "lamb", None),
    (1, "fp16_memory_efficient", "adam", None),
    (2, "bf16", "adam", {"w": True, "b": True, "s": True, "k": False, "emb": True,
                         "ids": False}),
    (3, "fp32", "sgd", None),
]


@pytest.mark.parametrize("stage,precision,opt_name,trainable", CASES)
def test_report_equals_bytes_of_a_real_states_shards(mesh, stage, precision, opt_name,
                                                     trainable):
  params = uneven_params()
  opt = OPTIMIZERS[opt_name]()
  step = zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, stage=stage, precision=precision,
                                    trainable=trainable)
  state = step.init(params)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  row = zj.memory_report(shapes, opt, n_devices=N, precision=precision, stages=(stage,),
                         trainable=trainable)[stage]
  assert row.optimizer_state == shard_bytes(state.opt_state)
  if state.meta.master_in_params:  # stage 3 bf16/fp16: the float32 master is the parameter
    leaves = jax.tree.leaves(state.params)
    assert row.master == shard_bytes([x for x, m in zip(leaves, state.meta.master) if m])
    assert row.params == shard_bytes([x for x, m in zip(leaves, state.meta.master) if not m])
  else:
    assert row.params == shard_bytes(state.params)
    assert row.master == shard_bytes(state.master)


@pytest.mark.parametrize("precision,opt_name", [("fp32", "adam"), ("bf16", "lamb")])
def test_stage_0_equals_a_plain_single_device_optax_state(precision, opt_name):
  params = uneven_params()
  opt = OPTIMIZERS[opt_name]()
  row = zj.memory_report(params, opt, n_devices=N, precision=precision, stages=(0,))[0]
  mixed = precision != "fp32"
  floats = {k: v for k, v in params.items() if jnp.issubdtype(v.dtype, jnp.floating)}
  ref_params = {k: (v.astype(jnp.bfloat16) if mixed and k in floats else v)
                for k, v in params.items()}
  ref_src = {k: v.astype(jnp.float32) if k in floats else v for k, v in params.items()}
  ref_opt = jax.jit(optax.masked(opt, {k: k in floats for k in params}).init)(ref_src)
  assert row.params == sum(x.nbytes for x in jax.tree.leaves(ref_params))
  assert row.optimizer_state == sum(x.nbytes for x in jax.tree.leaves(ref_opt))
  assert row.gradients == sum(ref_params[k].nbytes for k in floats)
  assert row.master == (sum(v.nbytes for v in floats.values()) if mixed else 0)


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "fp32"), (2, "bf16"), (3, "bf16")])
def test_gradient_bytes_equal_the_reduced_gradient_blocks(mesh, stage, precision):
  """Stage 1 all-reduces full gradients; stages 2-3 keep one padded block each."""
  params = {k: v for k, v in uneven_params().items() if k != "ids"}
  pdt = jnp.bfloat16 if precision == "bf16" else jnp.float32
  grads = [jnp.ones(v.shape, pdt) for v in jax.tree.leaves(params)]
  layouts = [leaf_layout(g.shape, N) for g in grads]
  if stage == 1:
    reduce = lambda gs: [jax.lax.psum(g, "data") for g in gs]
    specs = [P() for _ in grads]
  else:
    reduce = lambda gs: [collectives.reduce_scatter(g, l, collectives.Comm.over("data"), out_dtype=pdt)
                         for g, l in zip(gs, layouts)]
    specs = [l.spec("data") for l in layouts]
  reduced = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=([P() for _ in grads],),
                                  out_specs=specs))(grads)
  row = zj.memory_report(params, optax.sgd(0.1), n_devices=N, precision=precision)[stage]
  assert row.gradients == shard_bytes(reduced)


def test_comm_dtype_sets_the_gradient_bytes():
  params = {"w": jax.ShapeDtypeStruct((16, 8), jnp.float32)}
  rep = zj.memory_report(params, optax.sgd(0.1), n_devices=N, comm_dtype=jnp.bfloat16)
  assert rep[0].gradients == 16 * 8 * 2 and rep[2].gradients == 16 * 8 * 2 // N


def test_padding_of_uneven_leaves_is_counted_exactly():
  params = {"w": jax.ShapeDtypeStruct((9, 7), jnp.float32),  # split dim 1, padded to 8
            "b": jax.ShapeDtypeStruct((5,), jnp.float32),    # padded to 8
            "s": jax.ShapeDtypeStruct((), jnp.float32)}      # replicated
  row = zj.memory_report(params, optax.sgd(0.1), n_devices=N, stages=(3,))[3]
  assert row.params == (9 * 1 + 1 + 1) * 4


def test_mixed_precision_adam_follows_the_zero_paper_formulas():
  """bf16 Adam on even leaves: DP 16 psi, stage 1 4 psi + 12 psi/N, 2: 2 psi + 14 psi/N, 3:
  14 psi/N (the paper's 16 psi/N less the split bf16 copy: the fp32 master is the parameter).

  The only extra is Adam's replicated int32 step count (4 bytes).
  """
  params = {"a": jax.ShapeDtypeStruct((64, 128), jnp.float32),
            "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
  psi = 64 * 128 + 256
  rep = zj.memory_report(params, optax.adam(1e-3), n_devices=N, precision="bf16")
  count = 4
  assert rep[0].total == 16 * psi + count
  assert rep[1].total == 4 * psi + 12 * psi // N + count
  assert rep[2].total == 2 * psi + 14 * psi // N + count
  assert rep[3].total == 14 * psi // N + count
  assert rep.n_params == psi and rep.n_trainable == psi


def test_one_device_makes_every_stage_plain_data_parallelism():
  params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in uneven_params().items()}
  rep = zj.memory_report(params, optax.adam(1e-3), n_devices=1, precision="bf16")
  assert len({r.total for r in rep.rows[:3]}) == 1
  # less stage 3's bf16 copy, which it does not keep beside the fp32 master
  assert rep[3].total == rep[0].total - rep[0].params + rep[3].params


def test_compiled_memory_arguments_are_the_state_and_batch_shards(mesh):
  params = uneven_params()
  step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-3), mesh=mesh, stage=2,
                                    precision="bf16")
  state = step.init(params)
  batch = {"x": jnp.ones((16, 9), jnp.float32)}
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  cm = zj.compiled_memory(step, shapes, batch)
  batch_bytes = 16 * 9 * 4 // N
  assert cm.argument == shard_bytes(state) + batch_bytes
  assert cm.alias == shard_bytes(state)  # the donated state is reused for the new one
  assert cm.peak == cm.argument + cm.output - cm.alias + cm.temp
  assert "peak" in str(cm)


def test_table_names_every_stage_and_its_ratio_to_dp():
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
  rep = zj.memory_report(params, optax.adamw(1e-3), n_devices=4, precision="bf16")
  table = str(rep)
  assert table == rep.to_markdown()
  for name in ("DP (replicated)", "ZeRO-1", "ZeRO-2", "ZeRO-3", "1.00x", "0.22x"):
    assert name in table
  assert "1,048,576 parameters" in table
  assert rep.as_dict()[3]["total"] == rep[3].total
  with pytest.raises(KeyError, match="stages="):
    zj.memory_report(params, optax.sgd(0.1), n_devices=4, stages=(1, 2))[0]


def test_errors_name_the_leaf_and_the_fix():
  with pytest.raises(TypeError, match=r"params\['b'\] is a float"):
    zj.memory_report({"a": jnp.ones(3), "b": 1.0}, optax.sgd(0.1), n_devices=2)
  with pytest.raises(ValueError, match="each stage must be 0"):
    zj.memory_report({"a": jnp.ones(3)}, optax.sgd(0.1), n_devices=2, stages=(4,))
  with pytest.raises(ValueError, match="n_devices"):
    zj.memory_report({"a": jnp.ones(3)}, optax.sgd(0.1), n_devices=0)
  with pytest.raises(ValueError, match="precision="):
    zj.memory_report({"a": jnp.ones(3)}, optax.sgd(0.1), n_devices=2, precision="fp8")


def test_format_bytes_uses_binary_units():
  from zero_jax.step.memory import format_bytes
  assert format_bytes(512) == "512 B"
  assert format_bytes(1536) == "1.5 KiB"
  assert format_bytes(3 * 2 ** 30) == "3 GiB"
  assert math.isclose(float(format_bytes(124.4e6 * 16).split()[0]), 1.85, rel_tol=0.01)


def test_prefetch_with_a_hop_across_hosts_counts_a_layer_gradient_reduced_within_the_host():
  """hpZ or a replica axis: zj.scan also carries layer i+2's gradient, reduced within the
  host, while its hop across hosts waits one iteration (f32, 4 layers of 64 x 64)."""
  params = {"layers": jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)}
  layer = 64 * 64 * 4
  mesh = jax.sharding.AbstractMesh((2, 4), ("hosts", "data"))
  kw = dict(stacked=True, prefetch=1, stages=(3,), mesh=mesh)
  flat = zj.memory_report(params, optax.sgd(0.1), axis_name=("hosts", "data"), **kw)[3]
  hpz = zj.memory_report(params, optax.sgd(0.1), axis_name=("hosts", "data"), hpz_axis="data",
                         **kw)[3]
  hybrid = zj.memory_report(params, optax.sgd(0.1), replica_axis="hosts", **kw)[3]
  assert flat.prefetch == 2 * layer
  assert hpz.prefetch == 2 * layer + layer // 4 and hybrid.prefetch == 2 * layer + layer // 4
  # hpZ and a replica axis: also layer i+3's, reduced over every data axis (2 x 2 here)
  both = zj.memory_report(params, optax.sgd(0.1),
                          mesh=jax.sharding.AbstractMesh((2, 2, 2), ("hosts", "group", "data")),
                          axis_name=("group", "data"), hpz_axis="data", replica_axis="hosts",
                          stacked=True, prefetch=1, stages=(3,))[3]
  assert both.prefetch == 2 * layer + layer // 2 + layer // 4
