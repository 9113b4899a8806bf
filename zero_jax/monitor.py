"""Warnings for training that cannot progress, read from finished metrics only.

Every step with non-finite gradients is skipped (it changes nothing but the
loss scale), so a run whose parameters hold a NaN, or whose fp16 loss
overflows at any scale, would skip every step forever while reporting a
plausible loss. `StallWatch` warns once (``RuntimeWarning``) when the dynamic
loss scale sits at its minimum and steps still overflow, or, without dynamic
scaling, when `STALL_IN_A_ROW` steps in a row were skipped. It looks only at
metrics that are already computed (``jax.Array.is_ready``), so it never makes
the host wait for the device; a warning comes at most a few steps late.
"""

from __future__ import annotations

import collections
import warnings

import jax

STALL_IN_A_ROW = 3  # skipped steps in a row that warn without a dynamic loss scale


class StallWatch:
  """Warns once when steps keep being skipped (reads finished metrics only, never blocks)."""

  def __init__(self):
    self.pending = collections.deque(maxlen=8)
    self.warned = False

  def observe(self, metrics, loss_scale):
    self.pending.append((metrics["skipped_in_a_row"], metrics["loss_scale"], loss_scale))
    while self.pending and self.pending[0][0].is_ready() and not self.warned:
      in_a_row, scale, ls_state = self.pending.popleft()
      if jax.process_count() > 1 and not in_a_row.is_fully_addressable:
        continue
      self._check(int(in_a_row), float(scale), ls_state)

  def _check(self, in_a_row, scale, ls_state):
    at_min = ls_state.dynamic and scale <= ls_state.min_scale and in_a_row >= 2
    if not (at_min or (not ls_state.dynamic and in_a_row >= STALL_IN_A_ROW)):
      return
    self.warned = True
    why = (f"the dynamic loss scale sits at its minimum ({ls_state.min_scale:g}) and steps "
           f"still overflow" if at_min else f"the last {in_a_row} steps were all skipped")
    warnings.warn(
        f"zero_jax: training is not progressing: {why}, because their gradients were not "
        f"finite (metrics['grads_finite'] is False; metrics['skipped_steps'] counts skipped "
        f"steps). Likely causes: NaN or inf in the parameters (check step.get_params(state)); "
        f"a loss that is NaN or inf for this data (log metrics['loss']); in fp16, values "
        f"beyond its range that no loss scale fixes (try precision='bf16', a lower learning "
        f"rate or max_grad_norm=).", RuntimeWarning, stacklevel=3)
