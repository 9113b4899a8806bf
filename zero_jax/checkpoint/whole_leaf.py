"""``whole_leaf_update=`` states on disk: stored in their plain form, read into either form.

A checkpoint of a state with home slots (`zero_jax.step.whole_leaf`) holds the optimizer
state as the same step without ``whole_leaf_update=`` keeps it (`zero_jax.step.plain_state`),
so it restores like any other state: onto any device count and stage, and into a step with
or without the option (a step with it moves the state home after the read). Checkpoints
that older versions wrote in the home form (``WholeLeafState``) restore only into a step
with the option on the same device count; anything else is refused naming the option.
"""

from __future__ import annotations

import jax

from zero_jax.checkpoint.format import describe
from zero_jax.step import plain_state
from zero_jax.step.state import TrainState

_HOME_FORM = "WholeLeafState("


def saved_form(state: TrainState) -> TrainState:
  """What a checkpoint of ``state`` holds: its plain form (`plain_state.to_plain`)."""
  return plain_state.to_plain(state)


def _devices(tree) -> int:
  return len(jax.tree.leaves(tree)[0].sharding.device_set)


def read_target(saved: dict, target: TrainState, optimizer: str,
                where: str) -> tuple[TrainState, dict]:
  """The state to read a checkpoint's arrays into, and its description (`describe`, with the
  step's ``optimizer`` signature) to check the checkpoint's ``saved`` one against.

  Args:
    saved: the checkpoint's description.
    target: the abstract state of the step restored into.
    optimizer: that step's `zero_jax.step.signature.optimizer_signature`.
    where: the checkpoint, for messages.

  Raises:
    ValueError: a checkpoint in the home form, into a step without ``whole_leaf_update=``
      or on another device count; or a step whose home form has no plain one, restoring a
      checkpoint in the plain form. Each names ``whole_leaf_update``.
  """
  whole = target.meta.whole
  home_form = str(saved.get("opt_signature", "")).startswith(_HOME_FORM)
  if home_form and (whole is None or saved.get("num_devices") != _devices(target)):
    raise ValueError(
        f"{where} was written with whole_leaf_update= in the form that keeps each matrix's "
        f"optimizer state on its home device among {saved.get('num_devices')} (by an older "
        f"zero_jax, or for an optimizer whose state has no split form); it restores only "
        f"into a step with the same "
        f"whole_leaf_update= on {saved.get('num_devices')} devices (this step: "
        f"{'no whole_leaf_update=' if whole is None else f'{_devices(target)} devices'}). "
        f"Restore it there and save it again: checkpoints written now restore onto any device "
        f"count, with or without whole_leaf_update=.")
  if not home_form and whole is not None and whole.plain is None:
    raise ValueError(
        f"{where} holds an optimizer state split over the devices, and this step's "
        f"whole_leaf_update= keeps a state that cannot be made from it (its optimizer's state "
        f"differs with the leaves it updates). Restore into a step without whole_leaf_update=, "
        f"or into the whole_leaf_update= step on the device count that saved it.")
  into = target if home_form else plain_state.abstract_plain(target)
  mine = describe(into)
  mine["optimizer"] = optimizer
  return into, mine


def into_step(state: TrainState, target: TrainState) -> TrainState:
  """A restored ``state`` in the form of ``target``, the step's abstract state."""
  return plain_state.from_plain(state, target)
