"""Calling the user's ``loss_fn`` inside the step, and reading what it returns.

``loss_fn`` returns a mean loss or a `WeightedLoss`, optionally with ``aux`` and new model
state. The checks here run at trace time and name the problem and its fix: a loss already
averaged over the step's axes, a non-scalar loss, outputs of the wrong shape, collectives over
axes the step does not map."""

from __future__ import annotations

import inspect
import os
import traceback
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from zero_jax.comm.axes import varying_axes
from zero_jax.layers import nnx as nnx_lib
from zero_jax.layers import prefetch


@struct.dataclass
class WeightedLoss:
  """A loss given as a sum and its weight; the step takes the global weighted mean.

  Return it from ``loss_fn`` in place of a mean loss when examples count
  unequally, e.g. a sequence model whose loss is the sum over non-padding
  tokens divided by their number. The step then sums ``total`` and ``weight``
  over every device and micro-batch and uses ``sum(total) / sum(weight)`` as
  the loss (``metrics["loss"]``) and its gradient, exactly as single-device
  code that divides by the whole global batch's weight. Averaging each
  device's ratio instead would weight devices with few real tokens too much.

  Example:
    >>> import jax.numpy as jnp, zero_jax as zj
    >>> def loss_fn(params, batch):
    ...   per_token = jnp.square(batch["x"] @ params["w"] - batch["y"]).sum(-1)
    ...   mask = batch["mask"]                     # 1 for real tokens, 0 for padding
    ...   return zj.WeightedLoss(total=(per_token * mask).sum(), weight=mask.sum())

  Attributes:
    total: f32[] the sum of the per-example (per-token) losses.
    weight: f32[] their total weight (count); it is not differentiated.
  """
  total: jax.Array
  weight: jax.Array


class LossOutput(NamedTuple):
  """What one call of ``loss_fn`` gave, on one device.

  Attributes:
    value: the scalar the step differentiates: the mean loss, or the
      `WeightedLoss` total.
    weight: the `WeightedLoss` weight (stop-gradient), or None for a mean loss.
    aux: ``aux`` (``has_aux=True``) or None.
    model_state: the new model state, or None.
  """
  value: jax.Array
  weight: Any
  aux: Any
  model_state: Any


def _expected(has_aux: bool, has_ms: bool) -> str:
  if not (has_aux or has_ms):
    return "loss"
  return "(loss, " + ", ".join((["aux"] if has_aux else []) +
                               (["new_model_state"] if has_ms else [])) + ")"


def split_output(out, has_aux: bool, has_ms: bool):
  n_out = 1 + has_aux + has_ms
  if n_out == 1:
    if isinstance(out, (tuple, list)):
      raise TypeError(f"loss_fn returned a {type(out).__name__} of length {len(out)}; it "
                      f"must return a scalar loss (or a zj.WeightedLoss), or pass "
                      f"has_aux=True if it returns (loss, aux).")
    return out, None, None
  if not (isinstance(out, (tuple, list)) and len(out) == n_out):
    raise TypeError(f"loss_fn must return {_expected(has_aux, has_ms)} (has_aux={has_aux}, "
                    f"model state {'given' if has_ms else 'not given'} to init); it "
                    f"returned {_described(out)}.")
  rest = list(out[1:])
  aux = rest.pop(0) if has_aux else None
  return out[0], aux, (rest.pop(0) if has_ms else None)


def _described(out) -> str:
  """What a loss returned, as the user wrote it: an array by shape and dtype (not the
  tracer type JAX wraps it in), a tuple or list by length."""
  if isinstance(out, (tuple, list)):
    return f"a {type(out).__name__} of length {len(out)}"
  if hasattr(out, "shape") and hasattr(out, "dtype"):
    return f"one array of shape {tuple(out.shape)} {out.dtype}"
  return f"a {type(out).__name__}"


def _scalar(x, what: str):
  ok = hasattr(x, "shape") and x.shape == () and jnp.issubdtype(jnp.result_type(x), jnp.floating)
  if not ok:
    raise TypeError(f"loss_fn must return a scalar floating {what}; it returned "
                    f"{getattr(x, 'shape', type(x).__name__)} {getattr(x, 'dtype', '')}. "
                    f"Reduce it with .mean() (or .sum() inside a zj.WeightedLoss), or pass "
                    f"has_aux=True if it returns (loss, aux).")


def _check_not_averaged(value, batch_axes) -> None:
  """A loss that already varies over none of the batch axes was averaged by the user."""
  missing = [a for a in batch_axes if a not in varying_axes(value)]
  if missing:
    raise ValueError(
        f"loss_fn returned a loss that is the same on every device of axis {missing[0]!r}: "
        f"it was already averaged (or summed) over the step's axes {batch_axes}, e.g. with "
        f"lax.pmean(loss, {missing[0]!r}) as pmap-era code does. The step averages the "
        f"losses and gradients of the devices itself, so the update would be 1/N of the "
        f"right one (N devices) while the reported loss looks right. Return "
        f"the loss of this device's examples only (drop the pmean/psum); for a weighted "
        f"mean over the global batch return zj.WeightedLoss(total, weight). Collectives on "
        f"intermediate values (cross-device BatchNorm) are fine.")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _note_per_device_shapes(e: Exception, batch) -> None:
  """A shape error of the user's loss (raised outside zero_jax) shows the shapes of this
  device's part of the batch, not the global ones the user passed: say so on the error."""
  frames = traceback.extract_tb(e.__traceback__)
  inner = os.path.abspath(frames[-1].filename) if frames else ""
  ours = inner.startswith(_PACKAGE) and inner != os.path.abspath(__file__)
  if "shape" not in str(e) or ours:  # zero_jax's own errors say what they mean
    return
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not leaves:
    return
  path, x = leaves[0]
  e.add_note(f"zero_jax: loss_fn runs on each device's rows of the global batch, so the "
             f"shapes in this error are per device (here batch{jax.tree_util.keystr(path)} is "
             f"{tuple(np.shape(x))}): the fix is in the loss, for the global shapes too.")


def _axis_error(e: AssertionError, batch_axes, mesh_axes):
  frames = traceback.extract_tb(e.__traceback__)
  if str(e) or not frames or "jax/_src" not in frames[-1].filename.replace("\\", "/"):
    return None
  where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}"
  return ValueError(
      f"loss_fn failed with a bare AssertionError from inside JAX ({where}). Inside the step "
      f"this is what a collective raises when it names an axis the step does not map: "
      f"lax.psum/pmean/all_gather, nn.BatchNorm(axis_name=...) or nnx.BatchNorm(axis_name=...) "
      f"may only name the step's batch axes {batch_axes} (the mesh's axes are {mesh_axes}; "
      f"other axes are partitioned automatically and take no collectives). Use "
      f"axis_name={batch_axes[0]!r} in the model (BatchNorm statistics are then synchronised "
      f"over the global batch), drop the axis_name (each device's statistics, averaged by the "
      f"step), or name the mesh axis as the model does (e.g. jax.make_mesh((8,), ('batch',)) "
      f"with axis_name='batch' for Flax's ImageNet ResNet).")


def call_loss(loss_fn, params, batch, *, model_state, rng, has_aux: bool, batch_axes,
              mesh_axes, check_averaged: bool = True, gathered_whole: bool = False
              ) -> LossOutput:
  """Calls ``loss_fn`` on one device's values and checks what it returns.

  Args:
    loss_fn: the user's ``loss_fn(params, batch[, model_state=][, rng=])``.
    params: the parameters as the loss sees them.
    batch: this device's (micro-)batch.
    model_state: the model state, or None.
    rng: this device's key, or None.
    has_aux: whether ``loss_fn`` returns ``aux``.
    batch_axes: the manual axes the batch is split over (for the checks).
    mesh_axes: all axes of the mesh (for messages).
    check_averaged: check that the loss is not already averaged over devices.
    gathered_whole: a stage-3 step without stacked leaves (a `zero_jax.scan` over a
      parameter warns).

  Returns:
    A `LossOutput`.
  """
  kwargs = {}
  if model_state is not None:
    kwargs["model_state"] = model_state
  if rng is not None:
    kwargs["rng"] = rng
  check_keywords(loss_fn, kwargs)
  try:
    with prefetch.in_step_loss(params if gathered_whole else None):
      out = loss_fn(params, batch, **kwargs)
  except AssertionError as e:
    err = _axis_error(e, batch_axes, mesh_axes)
    if err is None:
      raise
    raise err from e
  except (TypeError, ValueError) as e:
    _note_per_device_shapes(e, batch)
    raise
  loss, aux, new_ms = split_output(out, has_aux, model_state is not None)
  if isinstance(loss, WeightedLoss):
    _scalar(loss.total, "WeightedLoss.total")
    weight = jax.lax.stop_gradient(jnp.asarray(loss.weight, jnp.float32))
    if weight.shape != ():
      raise TypeError(f"WeightedLoss.weight must be a scalar (the total weight of this "
                      f"device's examples), got shape {weight.shape}; sum it.")
    value = loss.total
  else:
    _scalar(loss, "loss (the mean over the examples it is given)")
    value, weight = loss, None
  if check_averaged:
    _check_not_averaged(value, batch_axes)
  if model_state is not None:
    check_new_model_state(new_ms, model_state)
  return LossOutput(value, weight, aux, new_ms)


def _aval(x) -> str:
  return f"{jnp.result_type(x)}{list(np.shape(x))}"


def check_keywords(loss_fn, kwargs, names=("model_state", "rng")) -> None:
  """Raises TypeError when ``loss_fn`` requires one of ``names`` that init lacked, or takes
  none of one that init got (``kwargs``: what the step passes)."""
  try:
    params = inspect.signature(loss_fn).parameters
  except (TypeError, ValueError):  # a callable without a signature: let the call say
    return
  any_keyword = any(p.kind is p.VAR_KEYWORD for p in params.values())
  for name in names:
    p = params.get(name)
    if name in kwargs and not any_keyword and (p is None or p.kind is p.POSITIONAL_ONLY):
      raise TypeError(
          f"init got {name}=, so the step calls loss_fn with the keyword {name}= (" +
          ("a key for every step, device and micro-batch" if name == "rng" else
           "the model state, returned updated") + f"), but loss_fn"
          f"{inspect.signature(loss_fn)} takes no {name}. Add it (def loss_fn(params, batch, "
          f"*, {name}): ...), or leave {name}= out of init.")
    if p is not None and p.default is p.empty and name not in kwargs and \
        p.kind is not p.VAR_KEYWORD:
      raise TypeError(
          f"loss_fn requires {name}=, but the state was made without one: the step passes "
          f"{name}= only when init got it. Pass it to init, e.g. step.init(params, "
          f"{name}={'jax.random.key(0)' if name == 'rng' else 'batch_stats'}), or give "
          f"loss_fn's {name} a default.")


def check_rng(rng) -> None:
  """Raises TypeError for an ``init(rng=...)`` that is not a PRNG key (at ``init``)."""
  if rng is None:
    return
  dtype = getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and \
      np.shape(rng) == ():
    return
  if dtype == np.uint32 and np.shape(rng) in ((2,), (4,)):  # a raw key (jax.random.PRNGKey)
    return
  got = _aval(rng) if dtype is not None else f"{type(rng).__name__} {rng!r}"
  raise TypeError(f"rng= must be one PRNG key (jax.random.key(seed)); got {got}. "
                  f"The step derives a key for every step, device and micro-batch from it.")


def check_model_state(model_state) -> None:
  """Raises TypeError naming a model-state leaf that is not an array (at ``init``)."""
  for path, x in jax.tree_util.tree_flatten_with_path(model_state)[0]:
    try:
      jnp.result_type(x)
    except TypeError:
      raise TypeError(
          f"model_state{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an array; "
          f"every model-state leaf must be an array (jnp.asarray(...), a PRNG key from "
          f"jax.random.key). Keep other values out of the state (e.g. in the loss function's "
          f"closure).") from None


def check_new_model_state(new_ms, model_state) -> None:
  """Raises TypeError naming the leaf where ``loss_fn``'s new model state differs in
  structure, shape or dtype from the one it was given."""
  given, given_def = jax.tree_util.tree_flatten_with_path(model_state)
  got, got_def = jax.tree_util.tree_flatten_with_path(new_ms)
  if got_def != given_def:
    before = {jax.tree_util.keystr(p) for p, _ in given}
    after = {jax.tree_util.keystr(p) for p, _ in got}
    diff = ([f"model_state{k} is missing" for k in sorted(before - after)] +
            [f"model_state{k} is new" for k in sorted(after - before)])
    raise TypeError(
        f"loss_fn must return the new model state with the structure of the one given to "
        f"init: {'; '.join(diff[:4]) or f'{got_def} against {given_def}'}. Return every leaf "
        f"it was given (the updated values, or the same ones), and no others.")
  for (path, old), (_, new) in zip(given, got):
    if np.shape(new) == np.shape(old) and jnp.result_type(new) == jnp.result_type(old):
      continue
    keys = any(jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key) for x in (old, new))
    fix = ("A key stays a key and nothing else becomes one: the step itself derives a fresh "
           "stream from each key leaf for every step, device and micro-batch and keeps the "
           "stored key, so return it unchanged" if keys else "Cast it back (.astype)")
    raise TypeError(
        f"loss_fn returned model_state{jax.tree_util.keystr(path)} as {_aval(new)}; it was "
        f"given as {_aval(old)}. The new model state keeps each leaf's shape and dtype (the "
        f"step averages it over devices and feeds it back in). {fix}.")


def module_loss(loss_fn: Callable, module: nnx_lib.ModuleDef, wrt, has_aux: bool, *,
                evaluate: bool = False) -> Callable:
  """The pure-function loss for a module's ``loss_fn(model, batch)``.

  ``evaluate``: the module is set as ``model.eval()`` sets it before the call (Dropout off,
  BatchNorm reading its running statistics; `zero_jax.layers.nnx.eval_mode`).

  Returns:
    ``loss(params, batch, *, model_state, rng=None)`` returning ``(loss,
    new_model_state)`` or ``(loss, aux, new_model_state)``, as the step
    calls a loss with model state.
  """
  def loss(params, batch, *, model_state, rng=None):
    model = nnx_lib.merge(module, params, model_state)
    if evaluate:
      nnx_lib.eval_mode(model)
    check_keywords(loss_fn, {} if rng is None else {"rng": rng}, names=("rng",))
    out = loss_fn(model, batch) if rng is None else loss_fn(model, batch, rng=rng)
    value, aux, _ = split_output(out, has_aux, False)
    _, _, new_state = nnx.split(model, wrt, ...)
    nnx_lib.check_same_variables(model_state, new_state)
    return (value, aux, new_state) if has_aux else (value, new_state)
  return loss
