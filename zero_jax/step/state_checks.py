"""Whether a `TrainState` is one this step may run: alive, and with the meta it would make.

A step runs only states whose `StateMeta` it would have made itself (`check_state`); otherwise
the error names each difference (stage, precision, axes, optimizer, trainable or stacked
leaves, layouts) and how to convert the state."""

from __future__ import annotations

import dataclasses

import jax

from zero_jax.step.options import LeafOptions
from zero_jax.step.spec import StepSpec
from zero_jax.step.state import StateMeta, TrainState, build_meta, logical_params


def check_concrete(state, what: str) -> None:
  """Raises if ``state`` is abstract (`ShardedTrainStep.abstract_state`: shapes only), where
  ``what`` needs values."""
  if isinstance(getattr(state, "step", None), jax.ShapeDtypeStruct):
    raise TypeError(
        f"{what} got an abstract TrainState (step.abstract_state: shapes and shardings, no "
        f"values), which is for step.lower(state, batch) and for CheckpointManager.restore "
        f"to read into. Make one with values: step.init(params), or mngr.restore(step, "
        f"params_like).")


def check_alive(state, what: str) -> None:
  """Raises if ``state`` was donated to a step already (its buffers are gone)."""
  step = getattr(state, "step", None)
  if isinstance(step, jax.Array) and not isinstance(step, jax.core.Tracer) and \
      step.is_deleted():
    raise RuntimeError(
        f"this TrainState was already passed to the step, which donated its buffers to the "
        f"new state (donate=True, the default, so the step needs no second copy of the "
        f"state); it cannot be used again by {what}. Use the state the step returned "
        f"(state, metrics = step(state, batch)), or build the step with donate=False to "
        f"keep old states alive (at the cost of a second copy in memory).")



def _differences(mine: StateMeta, theirs: StateMeta, paths) -> list[str]:
  out = []
  names = ["ZeRO stage", "precision", "data axes (name, size)", "replica axes (name, size)",
           "model axes (name, size)", "optimizer", "offload"]
  for name, a, b in zip(names, mine.signature, theirs.signature):
    if a != b:
      out.append(f"{name}: the state's {b!r}, this step's {a!r}" + (
          " (the update rules differ where the states' types agree, as adam's, nadam's, "
          "radam's and yogi's do: make the step with the state's optimizer)"
          if name == "optimizer" and mine.opt_layouts == theirs.opt_layouts else ""))
  for what, a, b in (("trainable", mine.trainable, theirs.trainable),
                     ("stacked", mine.stacked, theirs.stacked),
                     ("lookup", mine.lookup or (False,) * len(paths),
                      theirs.lookup or (False,) * len(paths))):
    if a != b:
      leaves = [p for p, x, y in zip(paths, a, b) if x != y][:6]
      out.append(f"{what}= differs for params{', params'.join(leaves)}")
  if mine.param_layouts != theirs.param_layouts and not out:
    leaves = [p for p, x, y in zip(paths, mine.param_layouts, theirs.param_layouts)
              if x != y][:6]
    out.append(f"parameter layouts (param_specs= or device count) differ for "
               f"params{', params'.join(leaves)}")
  if mine.opt_layouts != theirs.opt_layouts and not out:
    out.append("the optimizer state's leaves differ (another optimizer or its options)")
  if mine.whole != theirs.whole and not out:
    out.append("whole_leaf_update= differs (which leaves move home, or their homes)")
  if mine.module != theirs.module and not out:
    out.append("the NNX module's structure differs")
  if mine.master_in_params != theirs.master_in_params and not out:
    out.append("where the float32 master copy lives: "
               + ("in params (stage 3 without hpz_axis or offload)" if theirs.master_in_params
                  else "beside a half-precision copy (hpz_axis= or offload=)")
               + " in the state, "
               + ("in params" if mine.master_in_params else "beside a half-precision copy")
               + " for this step")
  return out


def check_meta(expected: StateMeta, state_meta: StateMeta, paths) -> None:
  """Raises ValueError naming what differs between a state's meta and the step's."""
  diffs = _differences(expected, state_meta, paths)
  if diffs:
    raise ValueError(
        "this TrainState was not made by this step, and running it would be silently wrong:\n  "
        + "\n  ".join(diffs) + "\nMake the state with this step's init (step.init(params)), or "
        "convert a trained one: save it with zj.CheckpointManager and restore it into this "
        "step (restoring handles another device count or ZeRO stage; the optimizer, "
        "precision and trainable leaves must match).")


def check_state(spec: StepSpec, optimizer, state, what: str, options: LeafOptions, *,
                known: dict, abstract: bool = False) -> None:
  """Raises unless ``state`` is a live `TrainState` that a step with these options makes.

  Args:
    spec, optimizer, options: the step's.
    state: what the user passed.
    what: the caller, for messages ("the step", "get_params", ...).
    known: ``{id(meta): meta}`` of metas already checked (updated): the
      comparison runs once per meta, not on every call.
    abstract: whether an abstract state (shapes only) will do (``lower``).
  """
  if not isinstance(state, TrainState):
    raise TypeError(f"state must be the TrainState returned by step.init(params), got "
                    f"{type(state).__name__}.")
  check_alive(state, what)
  if not abstract:
    check_concrete(state, what)
  meta = state.meta
  if known.get(id(meta)) is meta:
    return
  if options.param_specs is None:  # as the state holds them (read from the arrays at init)
    options = dataclasses.replace(options, param_specs=jax.tree.unflatten(
        jax.tree.structure(state.params), [l.model_spec() for l in meta.param_layouts]))
  expected = build_meta(spec, optimizer, logical_params(meta, state.params), options,
                        module=meta.module)[1]
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(state.params)[0]]
  check_meta(expected, meta, paths)
  known[id(meta)] = meta
