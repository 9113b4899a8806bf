"""Stage 3 bf16 on compile-only H100s: no half-precision copy at rest, and the update in place.

A stacked stage-3 step whose peak is its update (16 layers of 1024 x 1024, 64 rows per GPU,
full remat, AdamW): Ψ/N = 2,099,200 parameters per GPU. The arguments must be exactly the
float32 master and Adam's two moments (12 bytes a parameter, plus the count), where the
previous layout (`zero_jax.step.state.master_in_params` False) also kept the bf16 copy (2 more);
and XLA:GPU's temporaries must not hold the whole new state: a ``lax.cond`` around the update
(what the step did before, and still does off GPUs) gave every new value a buffer of its own,
the select (`zero_jax.step.update.selects`) writes each over its old one.
"""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj
from _held import held_converts, held_shapes
from zero_jax.comm import hlo
from zero_jax.step import state as state_lib
from zero_jax.step import update as update_lib

L, D, N = 16, 1024, 8
PER_GPU = (L * D * D + L * D) // N  # both leaves split evenly over 8


def _loss(p, b):
  layer = lambda h, lp: (jnp.tanh(h @ lp["w"] + lp["b"]), None)
  h, _ = zj.scan(layer, b, p, policy=jax.checkpoint_policies.nothing_saveable)
  return jnp.mean(h.astype(jnp.float32) ** 2)


def _step(mesh):
  step = zj.make_sharded_train_step(_loss, optax.adamw(1e-3), mesh=mesh, stage=3,
                                    precision="bf16", stacked=True)
  params = {"w": jax.ShapeDtypeStruct((L, D, D), jnp.float32),
            "b": jax.ShapeDtypeStruct((L, D), jnp.float32)}
  batch = jax.ShapeDtypeStruct((N * 64, D), jnp.bfloat16)
  return step, step.abstract_state(params), batch


def _compiled(monkeypatch, *, half_copy=False, cond=False):
  with monkeypatch.context() as m:
    if half_copy:
      m.setattr(state_lib, "master_in_params", lambda spec: False)
    if cond:
      m.setattr(update_lib, "selects", lambda spec: False)
    step, state, batch = _step(zj.compile_only_mesh((N,), ("data",), gpu="h100"))
    return step.lower(state, batch).compile()


@pytest.fixture(scope="module")
def programs():
  mp = pytest.MonkeyPatch()
  try:
    return {k: _compiled(mp, **kw) for k, kw in {
        "new": {}, "half_copy": dict(half_copy=True), "cond": dict(cond=True)}.items()}
  finally:
    mp.undo()


def test_the_arguments_are_the_master_and_the_moments_only(programs):
  batch = 64 * D * 2  # each GPU's rows, bf16
  scalars = 64  # the step, the loss scale's scalars, Adam's count: a few 4-byte values
  new, old = (programs[k].memory_analysis().argument_size_in_bytes for k in ("new", "half_copy"))
  assert 12 * PER_GPU <= new - batch <= 12 * PER_GPU + scalars
  assert old - new == 2 * PER_GPU  # the bf16 copy the previous layout kept


def test_the_update_writes_in_place_where_a_cond_held_the_whole_new_state(programs):
  programs = {k: c.memory_analysis() for k, c in programs.items()}
  new_state = 12 * PER_GPU
  assert programs["cond"].temp_size_in_bytes >= new_state
  assert programs["new"].temp_size_in_bytes < new_state
  peak = lambda m: m.argument_size_in_bytes + m.temp_size_in_bytes
  assert peak(programs["new"]) <= peak(programs["half_copy"])


def test_each_layer_is_cast_at_its_gather_and_the_wire_stays_bf16(programs):
  """The float32 master block is cast one layer at a time, just before that layer's all-gather:
  XLA:GPU's train and evaluate programs hold no conversion of a whole stacked block to bf16
  (16 layers of w: [16,128,1024]; tests/_held.py: values inside a fusion, such as a convert XLA
  puts before the slice of one layer, are never stored), and every all-gather moves bf16
  (XLA:GPU keeps half-precision collectives as they are, where XLA:CPU widens them)."""
  step, state, batch = _step(zj.compile_only_mesh((N,), ("data",), gpu="h100"))
  texts = {"train": programs["new"].as_text(),
           "evaluate": step.jit(step.evaluate).lower(state, batch).compile().as_text()}
  for name, text in texts.items():
    assert "f32[16,128,1024]" in held_shapes(text)  # w's float32 master block, as held here
    for whole in ("bf16[16,128,1024]", "bf16[16,128]"):
      assert not held_converts(text, whole), (name, whole)
    gathers = [i.shape_text for i in map(hlo.parse_instruction, text.splitlines())
               if i is not None and i.op in ("all-gather", "all-gather-start")]
    types = {t for g in gathers for t in re.findall(r"(\w+)\[", g)}
    assert gathers and types == {"bf16"}, (name, gathers)
