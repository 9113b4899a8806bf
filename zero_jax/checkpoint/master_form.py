"""States whose parameters are their float32 master copies, on disk in the layout of the others.

At stage 3 with ``precision="bf16"``/``"fp16"`` a state keeps each master leaf once, in
float32, as its parameter (`zero_jax.step.state.master_in_params`). A checkpoint of it holds
what every other mixed-precision state holds: the parameters in the compute dtype (the master
rounded, as the step's loss sees it) beside the float32 master. So it restores onto any stage
and device count, and checkpoints written before this layout (a half-precision copy beside the
master at stage 3), or at stages 1-2, restore into it: the master is read, the half copy read
and dropped.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> step = zj.make_sharded_train_step(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(0.1),
  ...                                   mesh=mesh, stage=3, precision="bf16")
  >>> state = step.init({"w": jnp.ones((16, 4))})
  >>> state.params["w"].dtype, state.master         # the master is the parameter
  (dtype('float32'), None)
  >>> saved = saved_form(state)
  >>> saved.params["w"].dtype, saved.master[0].dtype  # as a checkpoint holds it
  (dtype(bfloat16), dtype('float32'))
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from zero_jax.step.state import TrainState


def _split(state: TrainState, half) -> TrainState:
  """``state`` with each master leaf's parameter ``half(leaf, dtype)`` and the float32 leaf
  moved to ``master`` (the layout of a state with a half-precision copy)."""
  meta = state.meta
  leaves = jax.tree.leaves(state.params)
  master = [leaves[i] if meta.master[i] else None for i in meta.train_idx]
  params = [half(x, meta.param_dtypes[i]) if meta.master[i] else x
            for i, x in enumerate(leaves)]
  return state.replace(params=jax.tree.unflatten(jax.tree.structure(state.params), params),
                       master=master,
                       meta=dataclasses.replace(meta, master_in_params=False))


@functools.partial(jax.jit, static_argnums=1)
def _cast(x, dtype):
  """``x`` rounded to ``dtype`` where it lies (elementwise: the sharding carries over)."""
  return x.astype(dtype)


def saved_form(state: TrainState) -> TrainState:
  """What a checkpoint of ``state`` holds: for a state whose parameters are its master
  copies, the master in ``master`` and the parameters rounded to the compute dtype (new
  arrays on the same devices, 1/N of the model in bf16/fp16 each); any other state as it is."""
  if not state.meta.master_in_params:
    return state
  return _split(state, _cast)


def abstract_saved(target: TrainState) -> TrainState:
  """`saved_form` of an abstract state (``step.abstract_state``): what to read a checkpoint
  into."""
  if not target.meta.master_in_params:
    return target
  return _split(target, lambda x, dtype: jax.ShapeDtypeStruct(x.shape, dtype,
                                                              sharding=x.sharding))


def into_step(state: TrainState, target: TrainState) -> TrainState:
  """A state read in the saved form, in the form of ``target`` (the abstract state of the step
  it continues with): where ``target``'s parameters are its master copies, each master leaf
  becomes the parameter and the half-precision copy read beside it is dropped."""
  meta = target.meta
  if not meta.master_in_params:
    return state
  leaves = list(jax.tree.leaves(state.params))
  for i, m in zip(meta.train_idx, state.master):
    if meta.master[i]:
      leaves[i] = m
  return state.replace(params=jax.tree.unflatten(jax.tree.structure(state.params), leaves),
                       master=None, meta=meta)
