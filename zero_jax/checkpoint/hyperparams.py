"""Hyperparameters of a restored state: which the checkpoint keeps, which the step sets.

``inject_hyperparams`` keeps a constant hyperparameter in the optimizer state and
reads it from there, so a restored state brings the checkpoint's learning rate
along even when the step was built with another one. `reconcile` finds such
differences, says which value is in force, and takes the step's values when
asked (``restore(..., hyperparams="step")``). `static_scale` gives a static loss
scale the step's value: a static scale is the step's policy, not training state.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

CHOICES = (None, "checkpoint", "step")
_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def check_choice(choice) -> None:
  if choice not in CHOICES:
    raise ValueError(f"hyperparams={choice!r}: choose 'checkpoint' (keep the values saved "
                     f"in the optimizer state) or 'step' (the values the step's optimizer "
                     f"was built with), or leave it None (keep the saved ones, warn if they "
                     f"differ).")


def _is_hp_state(x) -> bool:
  return isinstance(x, _STATES)


def _hp_nodes(opt_state) -> list:
  """The ``inject_hyperparams`` states inside an optimizer state, in tree order."""
  return [x for x in jax.tree.leaves(opt_state, is_leaf=_is_hp_state) if _is_hp_state(x)]


def _fresh(optimizer, params) -> list:
  """The step optimizer's initial ``inject_hyperparams`` states, from one-element params
  (hyperparameters do not depend on the parameters' shapes, but take their dtype from the
  params': give ``params`` in the dtypes the step's optimizer is initialized on)."""
  tiny = jax.tree.map(lambda x: jnp.zeros((1,) * len(np.shape(x)), x.dtype), params)
  try:
    return _hp_nodes(optimizer.init(tiny))
  except Exception:  # an optimizer that needs real shapes: nothing to compare  # noqa: BLE001
    return []


def _scheduled(node) -> set:
  """The hyperparameters a schedule recomputes from its own state at every update (their
  value in ``hyperparams`` is the last one computed, never read)."""
  return set(getattr(node, "hyperparams_states", None) or ())


def _differences(restored: list, fresh: list) -> list[tuple[int, str, float, float]]:
  out = []
  for n, (r, f) in enumerate(zip(restored, fresh)):
    for k, v in f.hyperparams.items():
      if k in _scheduled(f):
        continue
      saved = np.asarray(jax.device_get(r.hyperparams.get(k)))
      if saved.shape == np.shape(v) and not np.array_equal(saved, np.asarray(v)):
        out.append((n, k, saved.item() if saved.size == 1 else saved, np.asarray(v).item()))
  return out


def reconcile(opt_state, optimizer, params, choice, where: str):
  """``opt_state`` (restored) with its injected hyperparameters as ``choice`` says.

  Args:
    opt_state: the restored optimizer state.
    optimizer: the step's optax transformation (as masked for frozen leaves).
    params: the parameters' tree as the step's optimizer is initialized on it (shapes and
      dtypes: float32 for the leaves a bf16 or fp16 policy trains from a float32 master;
      `zero_jax.step.state.optimizer_view`).
    choice: None (keep the checkpoint's values and warn where they differ from
      the step's), ``"checkpoint"`` (keep them, silently) or ``"step"`` (take
      the step optimizer's initial values).
    where: the checkpoint, for messages.
  """
  check_choice(choice)
  restored = _hp_nodes(opt_state)
  if not restored or choice == "checkpoint":
    return opt_state
  fresh = _fresh(optimizer, params)
  diffs = _differences(restored, fresh)
  if not diffs:
    return opt_state
  if choice is None:
    fmt = lambda v: f"{v:.6g}" if np.ndim(v) == 0 else str(v)
    listing = "; ".join(f"{k}: checkpoint {fmt(a)} vs step {fmt(b)}" for _, k, a, b in diffs)
    warnings.warn(
        f"{where} was saved with other optax.inject_hyperparams values than this step's "
        f"optimizer starts with ({listing}). inject_hyperparams reads a constant "
        f"hyperparameter from the optimizer state, so the checkpoint's values are in force "
        f"(a scheduled one is recomputed from its own step count, and not compared). "
        f"Pass restore(..., hyperparams='step') to use the step's values, or "
        f"hyperparams='checkpoint' to keep the saved ones without this warning.", stacklevel=3)
    return opt_state
  swap = {id(r): f for r, f in zip(restored, fresh)}

  def take_step(node):
    if not _is_hp_state(node) or id(node) not in swap:
      return node
    fresh_node = swap[id(node)]
    hps = {k: v if k in _scheduled(fresh_node) else
           jax.device_put(jnp.asarray(fresh_node.hyperparams[k], v.dtype), v.sharding)
           for k, v in node.hyperparams.items()}
    return node._replace(hyperparams=hps)
  return jax.tree.map(take_step, opt_state, is_leaf=_is_hp_state)


def static_scale(loss_scale, step_scale):
  """The restored ``loss_scale`` (a `zero_jax.LossScaleState`), with the step's value
  ``step_scale`` (its ``loss_scale=``) when the scale is static; a dynamic one continues
  from the saved value."""
  if loss_scale.dynamic:
    return loss_scale
  mine = np.asarray(step_scale.scale, loss_scale.scale.dtype)
  return loss_scale.replace(scale=jax.device_put(mine, loss_scale.scale.sharding))
