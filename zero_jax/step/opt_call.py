"""How the step calls the user's ``opt.update``: with ``value=`` the global loss for an
optimizer that takes extra arguments, as single-device code passes it."""

from __future__ import annotations

import re

import optax


def optimizer_update(opt, grads, opt_state, params, loss):
  """``opt.update``, with ``value=`` the step's global loss for an optimizer that takes extra
  arguments (``optax.GradientTransformationExtraArgs``: ``reduce_on_plateau``,
  ``polyak_sgd``, ...), as single-device code passes it; an extra argument the step cannot
  give (a line search's ``value_fn=``, ``grad=``) is a TypeError naming it."""
  if not isinstance(opt, optax.GradientTransformationExtraArgs):
    return opt.update(grads, opt_state, params)
  try:
    return opt.update(grads, opt_state, params, value=loss)
  except TypeError as e:
    missing = re.search(r"missing \d+ required keyword-only arguments?: (.*)$", str(e))
    if missing is None:
      raise
    names = ", ".join(f"{n}=" for n in re.findall(r"'(\w+)'", missing.group(1)))
    raise TypeError(
        f"the optimizer's update needs {names}, which the step cannot give: it passes only "
        f"value=, the step's loss over the global batch (as opt.update(grads, state, params, "
        f"value=loss) on one device). Line searches (optax.scale_by_backtracking_linesearch, "
        f"scale_by_zoom_linesearch, optax.lbfgs) need value_fn= and grad= to evaluate the "
        f"loss again at other parameters on the whole batch; use an optimizer without them "
        f"(optax.contrib.reduce_on_plateau and optax.polyak_sgd need only value=).") from None
