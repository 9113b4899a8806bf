"""The optimizer: what the step accepts, and what identifies it beyond its state's structure.

`as_transformation` takes what users pass as an optimizer (an optax
``GradientTransformation``, or an ``optax.MultiSteps``) and refuses the rest
with the fix.

Two optax transformations can make states of the same structure and still be
different optimizers: ``adam``, ``nadam``, ``radam`` and ``yogi`` all keep a
``ScaleByAdamState``. A state (or a checkpoint) made by one and run by another
trains on silently with the wrong update. `optimizer_signature` names the
optimizer by what it *does*: the functions its ``init``/``update`` are built
from (``scale_by_adam.<locals>.update_fn``, ...) and the flags they
close over (``nesterov=True``, strings, dtypes), walking the
closures of ``chain``, ``masked``, ``multi_transform`` and the like.

Numbers, integer or floating (learning rate, betas, epsilon, weight decay:
``optax.adam(1)`` resumes as ``optax.adam(0.5)``), schedules and the user's
own functions (a schedule, a mask) are hyperparameters, not identity: changing
them on a resumed run is allowed and does not change the signature. A change
that matters to the state (a schedule where a constant was, a mask) changes
the state's layout, which a restore compares leaf by leaf.

Example:
  >>> import optax, zero_jax.step.signature as sig
  >>> sig.optimizer_signature(optax.adam(1e-3)) == sig.optimizer_signature(optax.adam(3e-4))
  True
  >>> sig.optimizer_signature(optax.adamw(1, weight_decay=0)) == sig.optimizer_signature(
  ...     optax.adamw(0.5, weight_decay=0.01))
  True
  >>> sig.optimizer_signature(optax.adam(1e-3)) == sig.optimizer_signature(optax.nadam(1e-3))
  False
"""

from __future__ import annotations

import hashlib
import types

import numpy as np
import optax

_HYPERPARAMETER_MODULES = ("optax.schedules", "optax._src.schedule")


def _is_number(value, legacy: bool) -> bool:
  if isinstance(value, (int, np.integer)):
    return not legacy
  kinds = np.inexact if legacy else np.number
  return isinstance(value, (float, np.floating)) or (
      hasattr(value, "shape") and np.issubdtype(getattr(value, "dtype", None) or np.int8, kinds))


def _describe(value, seen: set, out: list, *, rule: bool = False, legacy: bool = False) -> None:
  """Appends tokens that identify ``value`` (a closure cell's content) to ``out``.

  ``rule``: ``value`` is the ``init`` or ``update`` of a transformation (the user's own
  transformations are identity; the user's other functions are hyperparameters).
  ``legacy``: the tokens zero_jax wrote before integers and the user's functions were
  hyperparameters (issue 48), to recognise checkpoints written then. For optimizers
  with neither, both give the same tokens.
  """
  kw = {"legacy": legacy}
  if isinstance(value, types.FunctionType):
    module = value.__module__ or ""
    if module.startswith(_HYPERPARAMETER_MODULES) or not (
        legacy or rule or module.split(".")[0] == "optax"):
      out.append("schedule")  # a schedule, a mask or label function: a hyperparameter
      return
    if id(value) in seen:
      out.append("<cycle>")
      return
    seen.add(id(value))
    out.append(f"{module}:{value.__qualname__}(")
    for cell in value.__closure__ or ():
      try:
        content = cell.cell_contents
      except ValueError:  # an empty cell
        continue
      _describe(content, seen, out, **kw)
    out.append(")")
  elif isinstance(value, (bool, np.bool_, str, type(None))):
    out.append(repr(value))
  elif isinstance(value, (int, np.integer)) and legacy:
    out.append(f"int:{int(value)}")
  elif _is_number(value, legacy):
    out.append("float")  # a hyperparameter, int or float (also a NumPy or JAX array)
  elif isinstance(value, tuple) and not legacy and hasattr(value, "init") and hasattr(
      value, "update"):  # a GradientTransformation: its functions are its update rule
    out.append("[")
    for v in value:
      _describe(v, seen, out, rule=True)
    out.append("]")
  elif isinstance(value, (tuple, list)):
    out.append("[")
    for v in value:
      _describe(v, seen, out, **kw)
    out.append("]")
  elif isinstance(value, dict):
    out.append("{")
    for k in sorted(value, key=repr):
      out.append(repr(k) + ":")
      _describe(value[k], seen, out, **kw)
    out.append("}")
  elif isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
    out.append(f"dtype:{np.dtype(value).name}")
  elif hasattr(value, "init") and hasattr(value, "update"):  # a GradientTransformation
    out.append(type(value).__name__ + "<")
    _describe(value.init, seen, out, rule=True, **kw)
    _describe(value.update, seen, out, rule=True, **kw)
    out.append(">")
  elif callable(value):
    out.append("callable")  # masks, label functions, partials: configuration, not identity
  else:
    out.append(type(value).__name__)  # arrays and other data: their type only


def as_transformation(optimizer) -> optax.GradientTransformation:
  """The optax transformation behind ``optimizer``; a TypeError that says what to pass otherwise.

  Args:
    optimizer: an ``optax.GradientTransformation`` (returned as is) or an
      ``optax.MultiSteps`` (its ``gradient_transformation()``).
  """
  if isinstance(optimizer, optax.MultiSteps):
    return optimizer.gradient_transformation()
  if isinstance(optimizer, optax.GradientTransformation):
    return optimizer
  raise TypeError(f"optimizer must be an optax.GradientTransformation (e.g. "
                  f"optax.adamw(3e-4)) or an optax.MultiSteps; got {type(optimizer).__name__}.")


def optimizer_signature(optimizer, *, legacy: bool = False) -> str:
  """A short, stable name for what ``optimizer`` computes (see the module docstring).

  Args:
    optimizer: an ``optax.GradientTransformation``.
    legacy: the name zero_jax gave before integer hyperparameters and the
      user's schedules were hyperparameters (what older checkpoints record).

  Returns:
    ``"<outermost function>#<12 hex digits>"``: equal for the same optimizer
    with other hyperparameters (numbers, int or float) or schedules, different
    for another update rule or flag.
  """
  out: list[str] = []
  _describe(optimizer, set(), out, legacy=legacy)
  digest = hashlib.sha256(" ".join(out).encode()).hexdigest()[:12]
  names = [t[:-1].split(":", 1)[1].split(".")[0] for t in out if t.endswith("(") and ":" in t]
  names = [n for n in names if n not in ("chain", "with_extra_args_support", "init_empty_state")]
  head = names[0] if names else "optimizer"
  return f"{head}#{digest}"
