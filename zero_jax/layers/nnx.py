"""The thin NNX layer: a Flax NNX module trained by the pure-function step.

``step.init(model)`` splits the module once (``wrt`` variables train; the others, BatchNorm
statistics and ``nnx.Rngs`` state, are model state); inside the step `zero_jax.step.loss.module_loss` merges each
device's values into a module for ``loss_fn(model, batch)`` and splits it again;
``step.get_model(state)`` gives a module back, in the mode it had at ``init``. See the docs'
NNX guide (``model.train()`` before ``init``, ``model.eval()`` after ``get_model``).

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> from flax import nnx
  >>> class Net(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.lin1, self.bn = nnx.Linear(3, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs)
  ...     self.drop, self.lin2 = nnx.Dropout(0.1, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)
  ...   def __call__(self, x):
  ...     return self.lin2(self.drop(nnx.relu(self.bn(self.lin1(x)))))
  >>> def loss_fn(model, batch):   # an nnx.Module; BatchNorm and Dropout update it
  ...   return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> step = zj.make_sharded_train_step(loss_fn, optax.adam(1e-2), mesh=mesh)  # wrt=nnx.Param
  >>> net = Net(nnx.Rngs(0))
  >>> net.train()                     # Dropout, BatchNorm: train mode before init
  >>> state = step.init(net)
  >>> batch = {"x": jnp.ones((jax.device_count(), 3)), "y": jnp.ones((jax.device_count(), 1))}
  >>> state, metrics = step(state, batch)
  >>> model = step.get_model(state)   # trained params, averaged statistics
  >>> model.eval()                    # then model(x), outside the step
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx
from flax.nnx import filterlib


OPTIMIZER_ERROR = (
    "optimizer is an nnx.Optimizer, which holds the model and an unsharded optimizer state; "
    "the step keeps both itself, sharded. Pass the optax transformation and give the module "
    "to init:\n"
    "  step = zj.make_sharded_train_step(loss_fn, tx, mesh=mesh, wrt=nnx.Param)  # tx: what "
    "nnx.Optimizer(model, tx, wrt=...) got (optimizer.tx)\n"
    "  state = step.init(model)              # in place of nnx.Optimizer(model, tx, wrt=...)\n"
    "  state, metrics = step(state, batch)   # loss_fn(model, batch) -> loss: no "
    "nnx.value_and_grad, no optimizer.update\n"
    "  model = step.get_model(state)")


@dataclasses.dataclass(frozen=True)
class ModuleDef:
  """What rebuilds a module from its states: `StateMeta.module` (static, hashable).

  Two modules of the same class and configuration have equal ``ModuleDef``s.

  Attributes:
    graphdef: the module's ``nnx.GraphDef`` (its structure and static attributes).
  """
  graphdef: nnx.GraphDef

  def __repr__(self):
    return f"ModuleDef({getattr(self.graphdef, 'type', type(None)).__name__})"


# ------------------------------------------------------------------- filters
def _is_var(x) -> bool:
  return isinstance(x, nnx.Variable)


def is_module(x) -> bool:
  return isinstance(x, nnx.Module)


def holds_variables(tree) -> bool:
  """Whether ``tree`` (e.g. an ``nnx.State``) holds ``nnx.Variable``s."""
  return any(_is_var(x) for x in jax.tree.leaves(tree, is_leaf=_is_var))


def is_nnx_filter(f) -> bool:
  """A Variable type, a tag string or one of ``flax.nnx.filterlib``'s filters."""
  return ((isinstance(f, type) and issubclass(f, nnx.Variable)) or isinstance(f, str)
          or type(f).__module__ == filterlib.__name__)


def filter_repr(f) -> str:
  """``nnx.Param`` for a Variable type, else ``repr``."""
  if isinstance(f, type) and issubclass(f, nnx.Variable):
    return f"nnx.{f.__name__}" if getattr(nnx, f.__name__, None) is f else f.__name__
  if isinstance(f, tuple):
    return "(" + ", ".join(map(filter_repr, f)) + ("," if len(f) == 1 else "") + ")"
  return repr(f)


def check_filter(f, option: str) -> None:
  """Raises TypeError unless ``f`` is an NNX filter (as ``nnx.Optimizer``'s ``wrt``)."""
  try:
    filterlib.to_predicate(f)
  except (TypeError, ValueError):  # flax's own message fails to format (a ValueError)
    raise TypeError(f"{option}={filter_repr(f)} is not an NNX filter; pass a Variable type "
                    f"(nnx.Param), a tag string, nnx.PathContains(...), nnx.All(...)/"
                    f"nnx.Any(...)/nnx.Not(...), a function (path, variable) -> bool, or a "
                    f"tuple of these.") from None


def _nnx_path(path) -> tuple:
  """A jax key path into an ``nnx.State`` -> NNX path parts (``('lin', 'kernel')``)."""
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(getattr(k, attr))
        break
  return tuple(parts)


def _variables(tree) -> list[tuple[tuple, Any, int]]:
  """``(nnx path, variable or leaf, number of array leaves)``, in flattening order."""
  return [(_nnx_path(path), v, len(jax.tree.leaves(v)) if _is_var(v) else 1)
          for path, v in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)[0]]


def _where(path, v) -> str:
  """``['bn']['mean'] (BatchStat)``: a variable for a message."""
  return "".join(f"[{k!r}]" for k in path) + f" ({type(v).__name__})"


def filter_flags(f, tree) -> list[bool]:
  """One bool per array leaf of ``tree``: does its Variable match the NNX filter ``f``."""
  pred = filterlib.to_predicate(f)
  return [bool(_is_var(v) and pred(p, v)) for p, v, n in _variables(tree) for _ in range(n)]


# ----------------------------------------------------------------- splitting
def check_params_state(params, wrt) -> None:
  """An ``nnx.State`` given as params must hold only ``wrt`` variables.

  ``step.init(nnx.state(model))`` would hand BatchNorm statistics (and RNG
  state) to the optimizer as parameters: moved by weight decay and Adam's
  noise on their zero gradients, and never by the module's own update.

  Raises:
    ValueError: naming the first such variables and the fix.
  """
  if not holds_variables(params):
    return
  pred = filterlib.to_predicate(wrt)
  other = [_where(p, v) for p, v, _ in _variables(params) if _is_var(v) and not pred(p, v)]
  if not other:
    return
  more = f" and {len(other) - 4} more" if len(other) > 4 else ""
  raise ValueError(
      f"params is an nnx.State holding variables that wrt={filter_repr(wrt)} does not select: "
      f"params{', params'.join(other[:4])}{more}. As params the optimizer would train them "
      f"(BatchNorm statistics moved by the optimizer, never by the module's own update). Pass "
      f"the module itself: state = step.init(model), with loss_fn(model, batch) receiving an "
      f"nnx.Module; the step then trains the wrt variables and carries the others as model "
      f"state. (Or, on the pure-function path, params=nnx.state(model, nnx.Param) and "
      f"model_state= the rest, which loss_fn returns updated.)")


def as_params(params, model_state, wrt) -> tuple[ModuleDef | None, Any, Any]:
  """``(ModuleDef or None, params, model_state)`` for what ``init`` was given.

  A module is split by ``wrt``; anything else is checked (`check_params_state`)
  and passed through.
  """
  if not is_module(params):
    check_params_state(params, wrt)
    return None, params, model_state
  if model_state is not None:
    raise TypeError("step.init(model) takes no model_state=: the module's variables that "
                    "wrt= does not select (BatchStat, RNG state, ...) are its model state.")
  graphdef, params, rest = nnx.split(params, wrt, ...)
  return ModuleDef(graphdef), params, rest


def merge(module: ModuleDef, params, model_state):
  """A new module from its ``params`` and ``model_state`` (inside a trace too)."""
  return nnx.merge(module.graphdef, params, model_state, copy=True)


def eval_mode(model) -> None:
  """Sets ``model`` (a fresh copy, e.g. from `merge`) as ``model.eval()`` does: every
  submodule with a ``deterministic`` attribute (``nnx.Dropout``) gets True, every one with
  ``use_running_average`` (``nnx.BatchNorm``) True; modules without them are left alone."""
  model.set_attributes(deterministic=True, use_running_average=True, raise_if_not_found=False)


def gather_module(module, is_sharded: Callable, gather: Callable):
  """``module`` with the variables whose value ``is_sharded`` replaced by ``gather`` of them.

  The module's other variables (BatchNorm statistics, ``nnx.Rngs`` state)
  are shared, not copied: what the returned module updates, ``module`` holds
  (so ``nnx.scan`` carries it out of the loop). With nothing sharded (stages
  1-2, outside the step) it is ``module`` itself.
  """
  graphdef, sharded, rest = nnx.split(module, lambda _, v: is_sharded(v.get_raw_value()), ...)
  if not jax.tree.leaves(sharded):
    return module
  return nnx.merge(graphdef, gather(sharded), rest)


def check_same_variables(before, after) -> None:
  if jax.tree.structure(before) == jax.tree.structure(after):
    return
  old, new = ({_where(p, v) for p, v, _ in _variables(t)} for t in (before, after))
  raise ValueError(
      f"loss_fn changed which variables the module holds (added: "
      f"{', '.join(sorted(new - old)) or 'none'}; removed or changed: "
      f"{', '.join(sorted(old - new)) or 'none'}). The step carries the variables the module "
      f"had at step.init(model): create every variable in __init__, and return what the "
      f"forward pass records as aux (has_aux=True) instead, e.g. out, found = "
      f"nnx.capture(model, nnx.Intermediate)(x) for self.sow, or nnx.pop it before returning.")
