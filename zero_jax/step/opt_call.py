"""How the step calls the user's ``opt.update``: with ``value=`` the global loss for an
optimizer that takes extra arguments, as single-device code passes it."""

from __future__ import annotations

import re

import optax


def optimizer_update(opt, grads, opt_state, params, loss):
  """``opt.update``, with ``value=`` the step's global loss for an optimizer that takes extra
  arguments (``optax.GradientTransformationExtraArgs``: ``reduce_on_plateau``,
  ``polyak_sgd``, ...), as single-device code passes it; one whose update takes no
  ``value=`` (``optax.contrib.sam``, which takes only ``grad_fn=``) is called without it.
  An extra argument the step cannot give (a line search's ``value_fn=``, ``grad=``, sam's
  ``grad_fn=`` with ``opaque_mode=True``) is a TypeError naming it."""
  if not isinstance(opt, optax.GradientTransformationExtraArgs):
    return opt.update(grads, opt_state, params)
  try:
    return opt.update(grads, opt_state, params, value=loss)
  except TypeError as e:
    if "unexpected keyword argument 'value'" not in str(e):
      _refuse_missing(e, takes_value=True)
  try:
    return opt.update(grads, opt_state, params)
  except TypeError as e:
    _refuse_missing(e, takes_value=False)
  except ValueError as e:  # sam(opaque_mode=True): "grad_fn must be provided ..."
    if "grad_fn" not in str(e):
      raise
    _refuse(["grad_fn"])


def _refuse_missing(e: TypeError, *, takes_value: bool):
  """Raises ``e`` again, or for missing keyword-only arguments the refusal naming them."""
  missing = re.search(r"missing \d+ required keyword-only arguments?: (.*)$", str(e))
  if missing is None:
    raise e
  names = re.findall(r"'(\w+)'", missing.group(1))
  if not takes_value and names == ["value"]:
    raise TypeError(
        "part of the optimizer needs value= (the loss: optax.contrib.reduce_on_plateau, "
        "optax.polyak_sgd) and part refuses it (optax.contrib.sam's update takes only "
        "grad_fn=), so no call can serve both, on one device either. Use them in separate "
        "runs, or wrap the one that refuses value= so that it ignores it.") from None
  _refuse(names)


def _refuse(names):
  listed = ", ".join(f"{n}=" for n in names)
  raise TypeError(
      f"the optimizer's update needs {listed}, which the step cannot give: it passes only "
      f"value=, the step's loss over the global batch (as opt.update(grads, state, params, "
      f"value=loss) on one device). Line searches "
      f"(optax.scale_by_backtracking_linesearch, scale_by_zoom_linesearch, optax.lbfgs) need "
      f"value_fn= and grad= to evaluate the loss again at other parameters on the whole "
      f"batch, optax.contrib.sam(opaque_mode=True) needs grad_fn= to take gradients there; "
      f"use an optimizer without them (optax.contrib.reduce_on_plateau and optax.polyak_sgd "
      f"need only value=; optax.contrib.sam with its default opaque_mode=False needs "
      f"nothing).") from None
