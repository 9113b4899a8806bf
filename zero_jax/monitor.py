"""Warnings about what a step did, read from finished metrics only.

Each step reports ``metrics["health"]``, an int32 of bits (`SKIPPED`,
`LOSS_NONFINITE`, `GRADS_NONFINITE`, `NO_WEIGHT`, `NEGATIVE_WEIGHT`; 0 for a
healthy step). `StallWatch` reads it (and the rest only when a bit is set) and
warns (``RuntimeWarning``), each kind once per step object: the first skipped
step in a mode without a dynamic loss scale, where a non-finite value means
data or model trouble (an fp16 dynamic scale skips its early steps by design);
a `WeightedLoss` step of weight zero (skipped); negative weights; a NaN loss
with a finite gradient; and training that cannot progress (the dynamic scale
at its minimum and steps still overflow, or `STALL_IN_A_ROW` skipped steps in
a row). It looks only at metrics that are already computed
(``jax.Array.is_ready``), so it never makes the host wait for the device; a
warning comes at most a few steps late.
"""

from __future__ import annotations

import collections
import warnings

import jax
import jax.numpy as jnp

STALL_IN_A_ROW = 3  # skipped steps in a row that warn without a dynamic loss scale
SKIPPED, LOSS_NONFINITE, GRADS_NONFINITE, NO_WEIGHT, NEGATIVE_WEIGHT = 1, 2, 4, 8, 16


def health(applied, loss, grads_finite, weight=None) -> jax.Array:
  """The step's health bits (see the module docstring), an int32 scalar.

  Example:
    >>> import jax.numpy as jnp
    >>> int(health(jnp.bool_(False), jnp.float32(jnp.nan), jnp.bool_(False)))
    7
  """
  bits = [(~applied, SKIPPED), (~jnp.isfinite(loss), LOSS_NONFINITE),
          (~grads_finite, GRADS_NONFINITE)]
  if weight is not None:
    bits += [(~(weight[0] > 0), NO_WEIGHT), (weight[1], NEGATIVE_WEIGHT)]
  return sum(jnp.where(b, v, 0) for b, v in bits).astype(jnp.int32)


_FIX = ("Likely causes: NaN or inf in the parameters (check step.get_params(state)); a loss "
        "that is NaN or inf for this data (log metrics['loss']); in fp16, values beyond its "
        "range that no loss scale fixes (try precision='bf16', a lower learning rate or "
        "max_grad_norm=).")


def _why(bits: int, step: int) -> str:
  if bits & NO_WEIGHT:
    return (f"step {step} was skipped: its WeightedLoss weight summed over the global batch "
            f"is not positive (every example is padding, or weights cancel), so the "
            f"weighted mean is undefined (a single device would get NaN); the parameters, "
            f"optimizer state and model state are unchanged and metrics['skipped_steps'] "
            f"counts it. Check the batch's mask/weights.")
  what = ("both the loss and the gradient were not finite" if bits & LOSS_NONFINITE else
          "the loss was finite but the gradient was not")
  return (f"step {step} was skipped because {what} (metrics['grads_finite'] is False; "
          f"metrics['skipped_steps'] counts skipped steps). Without a dynamic loss scale "
          f"there is no overflow to expect, so this points to data or model trouble. " + _FIX)


class StallWatch:
  """Warns about skipped steps and suspicious losses (reads finished metrics, never blocks).

  Each kind of warning comes once per step object.
  """

  def __init__(self):
    self.pending = collections.deque(maxlen=8)
    self.warned: set[str] = set()

  def observe(self, metrics, loss_scale):
    self.pending.append((metrics, loss_scale))
    while self.pending and self.pending[0][0]["health"].is_ready():
      m, ls_state = self.pending.popleft()
      if jax.process_count() > 1 and not m["health"].is_fully_addressable:
        continue
      bits = int(m["health"])
      if bits:
        self._check(bits, m, ls_state)

  def _warn(self, kind: str, message: str, level: int = 5):
    """Warns once per kind, at the user's call of the step (``level`` frames up)."""
    if kind not in self.warned:
      self.warned.add(kind)
      warnings.warn("zero_jax: " + message, RuntimeWarning, stacklevel=level)

  def _check(self, bits: int, m, ls_state):
    if bits & NEGATIVE_WEIGHT:
      self._warn("negative", f"step {int(m['step'])}: a WeightedLoss weight is negative on "
                 f"some device; weights are counts (of tokens, examples), and a negative one "
                 f"makes the weighted mean meaningless. Use weights >= 0 (e.g. the mask).")
    if bits & LOSS_NONFINITE and not bits & (GRADS_NONFINITE | NO_WEIGHT):
      self._warn("nan_loss", f"step {int(m['step'])}: metrics['loss'] is {float(m['loss'])} "
                 f"while the gradient is finite (the step was applied). A loss that divides "
                 f"by its own count (e.g. sum(loss * mask) / sum(mask)) is NaN on a device "
                 f"whose examples are all padding; return zj.WeightedLoss(total=sum(loss * "
                 f"mask), weight=sum(mask)) instead: the step then divides by the global "
                 f"count.")
    if bits & SKIPPED and (bits & NO_WEIGHT or not ls_state.dynamic):
      self._warn("skipped", _why(bits, int(m["step"])))
    if bits & SKIPPED:
      self._check_stall(int(m["skipped_in_a_row"]), float(m["loss_scale"]), ls_state)

  def _check_stall(self, in_a_row, scale, ls_state):
    at_min = ls_state.dynamic and scale <= ls_state.min_scale and in_a_row >= 2
    if not (at_min or (not ls_state.dynamic and in_a_row >= STALL_IN_A_ROW)):
      return
    why = (f"the dynamic loss scale sits at its minimum ({ls_state.min_scale:g}) and steps "
           f"still overflow" if at_min else f"the last {in_a_row} steps were all skipped")
    self._warn("stall", f"training is not progressing: {why}, because their gradients were "
               f"not finite (metrics['grads_finite'] is False) or, with a WeightedLoss, their "
               f"weight was zero; metrics['skipped_steps'] counts skipped steps. " + _FIX,
               level=6)
