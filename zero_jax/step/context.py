"""Where a call of the step runs: the mesh context, and Auto mode inside.

The user's mesh may have Explicit or Auto axes, and the step may be called
inside or outside ``jax.set_mesh(mesh)``. Inside the user's context the state
and outputs live on the user's mesh (Explicit axes stay Explicit, as code in
that context expects); elsewhere on the Auto view of the same devices, whose
arrays mix with any other (`zero_jax.step.spec.StepSpec.working_mesh`). Either way
the step computes in Auto mode (``jax.sharding.auto_axes`` when the context
has Explicit axes), so its sharding constraints and ``shard_map``s are written
once, against the Auto view.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from zero_jax.step.spec import StepSpec

def device_put(tree, sharding):
  """``jax.device_put`` that also places typed PRNG keys on a multi-process mesh."""
  def put(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.device_put(jax.random.key_data(x), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)
  return jax.tree.map(put, tree)


def on_working_mesh(spec: StepSpec, state):
  """``state`` on the mesh this call works on (`StepSpec.working_mesh`), moved without a
  copy if it is not there; as it is when traced."""
  mesh = spec.working_mesh()
  first = state.step
  if isinstance(first, jax.core.Tracer) or \
      getattr(getattr(first, "sharding", None), "mesh", mesh) == mesh:
    return state
  move = lambda x: jax.device_put(x, jax.sharding.NamedSharding(
      mesh, x.sharding.spec, memory_kind=x.sharding.memory_kind))
  return jax.tree.map(move, state)


def mesh_context(spec: StepSpec):
  """The context a call runs in: the user's ``jax.set_mesh(mesh)`` if they are in it,
  else the Auto view of the mesh (see `StepSpec.working_mesh`)."""
  if spec.in_user_context():
    return contextlib.nullcontext()
  try:
    return jax.set_mesh(spec.auto_mesh)
  except ValueError:  # inside a user's jit: their context stands
    return contextlib.nullcontext()


def in_auto(spec: StepSpec, fn, out_specs):
  """``fn`` traced in Auto mode: wrapped in ``auto_axes`` when the context has Explicit axes.

  ``out_specs(*args)`` gives PartitionSpecs for ``fn``'s output (a prefix).
  """
  def run(*args):
    context = jax.sharding.get_abstract_mesh()
    if not any(t == jax.sharding.AxisType.Explicit for t in context.axis_types):
      return fn(*args)
    one = lambda *a: (fn(*a),)  # auto_axes wants a tuple of outputs
    return jax.sharding.auto_axes(one, out_sharding=(out_specs(*args),))(*args)[0]
  return run


def run(spec: StepSpec, fn, *args):
  """``fn(*args)`` in the call's mesh context (`mesh_context`), JAX's refusal to close over
  an Explicit-axes array explained (`closure_error`)."""
  with mesh_context(spec):
    try:
      return fn(*args)
    except NotImplementedError as e:
      err = closure_error(e)
      if err is None:
        raise
      raise err from None


def closure_error(e: NotImplementedError):
  if "Closing over inputs to shard_map" not in str(e):
    return None
  return ValueError(
      "loss_fn closes over an array that lives on the mesh's Explicit axes (made under "
      "jax.set_mesh, or placed with a sharding on an Explicit mesh); JAX cannot close over such "
      "an array inside the step's shard_map. Pass it in instead: as a leaf of the params marked "
      "trainable=False (it keeps its param_specs split), in the batch (one row per example), or "
      f"in model_state=; or make it a plain array (np.asarray(x)). JAX said: {e}")
