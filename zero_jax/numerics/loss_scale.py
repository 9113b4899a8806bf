"""Loss scaling for fp16 as small pure functions over a pytree state.

The state holds only arrays; the hyperparameters (``dynamic``, ``period``, ``factor``,
``min_scale``) are static pytree metadata, so they survive ``jax.jit`` and tree round trips.

Example:
  >>> import jax.numpy as jnp, zero_jax as zj
  >>> ls = zj.dynamic_loss_scale()
  >>> scaled = zj.scale_loss(ls, jnp.float32(0.5))      # 0.5 * 2**15
  >>> grads = zj.unscale_grads(ls, {"w": jnp.ones(3, jnp.float16) * scaled})
  >>> ls = zj.adjust_loss_scale(ls, zj.all_finite(grads))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class LossScaleState:
  """Loss-scale state. Array fields are scalars; the rest is static.

  Attributes:
    scale: f32[] the factor the loss is multiplied by.
    good_steps: i32[] finite steps since the scale last changed.
    skipped_steps: i32[] total steps skipped for non-finite gradients.
    skipped_in_a_row: i32[] steps skipped since the last finite one.
    dynamic: whether the scale adapts (static).
    period: finite steps before the scale grows (static).
    factor: growth factor; the backoff divides by it (static).
    min_scale: the scale never falls below this (static).
  """
  scale: jax.Array
  good_steps: jax.Array
  skipped_steps: jax.Array
  skipped_in_a_row: jax.Array
  dynamic: bool = struct.field(pytree_node=False, default=False)
  period: int = struct.field(pytree_node=False, default=2000)
  factor: float = struct.field(pytree_node=False, default=2.0)
  min_scale: float = struct.field(pytree_node=False, default=1.0)


def _state(scale, **static) -> LossScaleState:
  return LossScaleState(scale=jnp.asarray(scale, jnp.float32),
                        good_steps=jnp.zeros((), jnp.int32),
                        skipped_steps=jnp.zeros((), jnp.int32),
                        skipped_in_a_row=jnp.zeros((), jnp.int32), **static)


def dynamic_loss_scale(init: float = 2.0**15, *, period: int = 2000,
                       factor: float = 2.0, min_scale: float = 1.0) -> LossScaleState:
  """A scale that backs off on overflow and grows after ``period`` finite steps.

  Example:
    >>> import zero_jax as zj
    >>> s = zj.dynamic_loss_scale(8.0, period=3, min_scale=2.0)
    >>> float(zj.adjust_loss_scale(s, False).scale)
    4.0

  Args:
    init: the first scale (default 2**15).
    period: finite steps in a row after which the scale is multiplied by
      ``factor`` (default 2000).
    factor: growth factor; a non-finite step divides by it (default 2).
    min_scale: the scale never falls below this (default 1).

  Returns:
    A `LossScaleState` with ``dynamic=True``.
  """
  if not (math.isfinite(init) and init >= min_scale > 0 and period >= 1 and factor > 1):
    raise ValueError(f"dynamic_loss_scale needs a finite init >= min_scale > 0, period >= 1 "
                     f"and factor > 1; got init={init}, min_scale={min_scale}, "
                     f"period={period}, factor={factor}.")
  return _state(init, dynamic=True, period=int(period), factor=float(factor),
                min_scale=float(min_scale))


def _policy(state: LossScaleState) -> str:
  """The static part of a loss-scale state, in words."""
  if not state.dynamic:
    return "static"
  return (f"dynamic (period={state.period}, factor={state.factor:g}, "
          f"min_scale={state.min_scale:g})")


def check_same_policy(step_scale: LossScaleState, state_scale: LossScaleState) -> None:
  """Raises ValueError when a train state's loss-scale policy is not its step's."""
  key = lambda s: (s.dynamic, s.period, s.factor, s.min_scale) if s.dynamic else ()
  if key(step_scale) != key(state_scale):
    mine, theirs = _policy(step_scale), _policy(state_scale)
    raise ValueError(
        f"this TrainState's loss scale is {theirs}, this step's loss_scale= makes it "
        f"{mine}; running it would silently keep the state's policy. Build the step with the "
        f"loss_scale= the state was made with, or save the state with zj.CheckpointManager "
        f"and restore it into this step (the policy is then the step's; a dynamic scale "
        f"continues from the saved value, a static one is the step's).")


def static_loss_scale(scale: float) -> LossScaleState:
  """A fixed scale. Steps with non-finite gradients are still skipped and counted.

  Example:
    >>> import jax.numpy as jnp, zero_jax as zj
    >>> float(zj.scale_loss(zj.static_loss_scale(128.0), jnp.float32(0.5)))
    64.0
  """
  if not (math.isfinite(scale) and scale > 0):
    raise ValueError(f"static_loss_scale needs a positive, finite scale, got {scale}.")
  return _state(scale)


def no_loss_scale() -> LossScaleState:
  """Scale 1, never changes (non-finite steps are still skipped and counted)."""
  return _state(1.0)


def _wide(x):
  """``x`` in at least float32 (float64 and complex keep their precision)."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def scale_loss(state: LossScaleState, loss: jax.Array) -> jax.Array:
  """``loss * scale``, computed in at least float32 (a scaled fp16 loss may exceed 65504).

  Example:
    >>> import jax, jax.numpy as jnp, zero_jax as zj
    >>> s = zj.dynamic_loss_scale()
    >>> w = jnp.full(2, 0.25, jnp.float16)
    >>> grads = jax.grad(lambda w: zj.scale_loss(s, jnp.sum(w * w)))(w)  # 16384 in fp16
    >>> zj.unscale_grads(s, grads).tolist()
    [0.5, 0.5]
  """
  return _wide(loss) * state.scale.astype(_wide(loss).dtype)


def unscale_grads(state: LossScaleState, grads):
  """Divides every leaf by the scale, after upcasting it to at least float32.

  Upcasting first matters: ``g / scale`` in fp16 underflows for small ``g``
  (and a scale of 2**16 is not even representable in fp16). float64 and
  complex leaves keep their dtype.

  Returns:
    ``grads`` with every half-precision leaf float32.
  """
  return jax.tree.map(lambda g: _wide(g) / state.scale.astype(jnp.finfo(_wide(g).dtype).dtype), grads)


def all_finite(tree, axis_name: str | None = None) -> jax.Array:
  """One bool: every element of every leaf is finite.

  Inside ``shard_map`` pass ``axis_name`` so that every device gets the same
  answer (a device whose slice overflowed makes all of them skip).

  Example:
    >>> import jax.numpy as jnp, zero_jax as zj
    >>> bool(zj.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]
  ok = jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)
  if axis_name is not None:
    ok = jax.lax.pmin(ok.astype(jnp.int32), axis_name).astype(bool)
  return ok


def adjust_loss_scale(state: LossScaleState, grads_finite: jax.Array, *,
                      applied: jax.Array | None = None) -> LossScaleState:
  """The state after a step whose gradients were (or were not) finite.

  Dynamic: a non-finite step divides the scale by ``factor`` (not below
  ``min_scale``) and restarts the count; ``period`` finite steps in a row
  multiply it by ``factor`` (unless that would overflow float32: a scale of
  inf could never back off again). Static scales only count skipped steps.

  Args:
    state: the `LossScaleState` the step used.
    grads_finite: bool scalar, whether that step's gradients were finite.
    applied: bool scalar, whether the step was applied (default
      ``grads_finite``); a finite step that was skipped for another reason
      (a `WeightedLoss` of weight zero) counts as skipped but does not move
      the scale.

  Returns:
    The next `LossScaleState` (same static fields).
  """
  grads_finite = jnp.asarray(grads_finite, bool)
  applied = grads_finite if applied is None else jnp.asarray(applied, bool)
  skipped = state.skipped_steps + jnp.where(applied, 0, 1).astype(jnp.int32)
  in_a_row = jnp.where(applied, 0, state.skipped_in_a_row + 1).astype(jnp.int32)
  if not state.dynamic:
    return state.replace(skipped_steps=skipped, skipped_in_a_row=in_a_row)
  good = jnp.where(grads_finite, state.good_steps + 1, 0)
  grow = good >= state.period
  grown = state.scale * state.factor
  grown = jnp.where(jnp.isfinite(grown), grown, state.scale)
  scale = jnp.where(grads_finite,
                    jnp.where(grow, grown, state.scale),
                    jnp.maximum(state.scale / state.factor, state.min_scale))
  good = jnp.where(grow, 0, good).astype(jnp.int32)
  return state.replace(scale=scale.astype(jnp.float32), good_steps=good, skipped_steps=skipped,
                       skipped_in_a_row=in_a_row)
