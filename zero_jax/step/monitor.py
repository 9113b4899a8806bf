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
a row). After each step it looks only at metrics that are already computed
(``jax.Array.is_ready``), so the host does not wait for the device; a warning
comes a few steps late, and at the latest when the user reads the results:
``get_params``/``get_model``, a checkpoint ``save``, ``wait_until_finished``
or ``close``, the step object's end, or interpreter exit (`StallWatch.flush`,
`deliver`). In a multi-process run every process reads its own copy of the
replicated metrics and warns.
"""

from __future__ import annotations

import atexit
import collections
import math
import os
import sys
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np

STALL_IN_A_ROW = 3  # skipped steps in a row that warn without a dynamic loss scale
SKIPPED, LOSS_NONFINITE, GRADS_NONFINITE, NO_WEIGHT, NEGATIVE_WEIGHT = 1, 2, 4, 8, 16
MAX_PENDING = 32  # queued steps beyond which the oldest is read even if the host must wait
_READ = ("health", "step", "loss", "skipped_in_a_row", "loss_scale")  # the metrics read
_WATCHES: "weakref.WeakSet[StallWatch]" = weakref.WeakSet()
_at_exit = False
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # zero_jax/


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
        "max_grad_norm=); gradients whose global norm exceeds float32 (about 1.8e19): "
        "scale the loss down.")


def _why(bits: int, step: int) -> str:
  if bits & NO_WEIGHT:
    return (f"step {step} was skipped: its WeightedLoss weight summed over the global batch "
            f"is not positive (every example is padding, or weights cancel), so the "
            f"weighted mean is undefined (a single device would get NaN); the parameters, "
            f"optimizer state and model state are unchanged and metrics['skipped_steps'] "
            f"counts it. Check the batch's mask/weights.")
  what = ("both the loss and the gradient were not finite" if bits & LOSS_NONFINITE else
          "the loss was finite but the gradient was not (an element is inf or NaN, or the "
          "sum of squares for its global norm overflowed float32)")
  return (f"step {step} was skipped because {what} (metrics['grads_finite'] is False; "
          f"metrics['skipped_steps'] counts skipped steps). Without a dynamic loss scale "
          f"there is no overflow to expect, so this points to data or model trouble. " + _FIX)


_OWN_COUNT = ("a loss that divides by its own count (e.g. sum(loss * mask) / sum(mask)) is NaN "
              "on a device whose examples are all padding; return zj.WeightedLoss(total="
              "sum(loss * mask), weight=sum(mask)) instead: the step then divides by the "
              "global count.")


def _nan_loss(treedef, layouts) -> str:
  """The causes of a NaN loss with a finite gradient, the parameters without elements first
  (a mean over none of them is 0/0, and its gradient, empty, is finite)."""
  paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, range(len(layouts))))
  empty = [f"params{jax.tree_util.keystr(p)} {tuple(l.shape)}"
           for (p, _), l in zip(paths[0], layouts) if 0 in l.shape]
  mean = "jnp.mean (or any mean) of an array without elements is NaN (0/0) while its gradient "
  if not empty:
    return "Likely cause: " + _OWN_COUNT + f" Or a term of the loss takes a mean over no elements: {mean}is finite."
  return (f"The parameters {', '.join(empty[:4])} have no elements, and {mean}(empty) is "
          f"finite: leave such leaves out of the loss, or use jnp.sum (0 over no elements). "
          f"Otherwise: " + _OWN_COUNT)


class StallWatch:
  """Warns about skipped steps and suspicious losses, each kind once per step object.

  `observe` queues a step's metrics and reads those already computed, never
  blocking; `flush` reads every queued one, waiting for the device if it must.
  The step flushes in ``get_params`` (and so ``get_model``); `deliver` flushes
  every live watch, which `zero_jax.CheckpointManager` does in ``save``,
  ``wait_until_finished`` and ``close``, and which runs at interpreter exit; a
  watch whose step is garbage collected flushes then. So a run that stops a
  step after the trouble still hears of it.
  """

  def __init__(self, weights_block: int | None = None):
    self.weights_block = weights_block  # quantized weights (qwZ): values per block
    self.pending: collections.deque = collections.deque()
    self.warned: set[str] = set()
    self.note = ""
    self.latest = lambda: None  # the newest state, while the user holds it
    _WATCHES.add(self)
    _register_at_exit()

  def observe(self, metrics, state, new_state):
    """Queues a step's metrics; reads those ready (and the oldest beyond `MAX_PENDING`).

    ``state``: the `TrainState` the step started from (its static parts are read: the
    loss-scale policy, the parameters' paths and shapes; its arrays may be donated);
    ``new_state``: the one it returned, whose weights a skip warning checks while the
    user holds it (a weak reference)."""
    self.latest = weakref.ref(new_state)
    ls = state.loss_scale
    self.pending.append(({k: metrics[k] for k in _READ}, (ls.dynamic, ls.min_scale),
                         (jax.tree.structure(state.params), state.meta.param_layouts)))
    while self.pending and (len(self.pending) > MAX_PENDING or _done(self.pending[0][0])):
      self._read(*self.pending.popleft())

  def flush(self, note: str = ""):
    """Reads every queued step's metrics (waiting for them), warning as `observe` would.

    ``note``: said after each warning where it is not raised at the user's call.
    """
    self.note = note
    try:
      while self.pending:
        self._read(*self.pending.popleft())
    finally:
      self.note = ""

  def __del__(self):
    try:
      self.flush(" (Reported as the step object was deleted.)")
    except Warning:  # a warning filter made it an error: that is for the user to see
      raise
    except Exception:  # pylint: disable=broad-except  (arrays gone at interpreter teardown)
      self.pending.clear()

  def _read(self, m, loss_scale, params):
    if m["health"].is_deleted():  # the user deleted the metrics (or donated them)
      return
    bits = int(_host(m["health"]))
    if bits:
      self._check(bits, {k: _host(v) for k, v in m.items()}, loss_scale, params)

  def _warn(self, kind: str, message: str):
    """Warns once per kind, at the user's line that called into zero_jax."""
    if kind not in self.warned:
      self.warned.add(kind)
      warnings.warn("zero_jax: " + message + self.note, RuntimeWarning,
                    stacklevel=2 if self.note else _user_level())

  def _check(self, bits: int, m, loss_scale, params):
    dynamic, min_scale = loss_scale
    if bits & NEGATIVE_WEIGHT:
      self._warn("negative", f"step {int(m['step'])}: a WeightedLoss weight is negative on "
                 f"some device; weights are counts (of tokens, examples), and a negative one "
                 f"makes the weighted mean meaningless. Use weights >= 0 (e.g. the mask).")
    if bits & LOSS_NONFINITE and not bits & (GRADS_NONFINITE | NO_WEIGHT):
      self._warn("nan_loss", f"step {int(m['step'])}: metrics['loss'] is {float(m['loss'])} "
                 f"while the gradient is finite (the step was applied). " + _nan_loss(*params))
    if bits & SKIPPED and (bits & NO_WEIGHT or not dynamic) and "skipped" not in self.warned:
      self._warn("skipped", _why(bits, int(m["step"])) +
                 ("" if bits & NO_WEIGHT else
                  _nonfinite_weights(self.latest(), self.weights_block)))
    if bits & SKIPPED:
      self._check_stall(int(m["skipped_in_a_row"]), float(m["loss_scale"]), dynamic, min_scale)

  def _check_stall(self, in_a_row, scale, dynamic, min_scale):
    at_min = dynamic and scale <= min_scale and in_a_row >= 2
    if not (at_min or (not dynamic and in_a_row >= STALL_IN_A_ROW)):
      return
    why = (f"the dynamic loss scale sits at its minimum ({min_scale:g}) and steps "
           f"still overflow" if at_min else f"the last {in_a_row} steps were all skipped")
    if "stall" not in self.warned:
      self._warn("stall", f"training is not progressing: {why}, because their gradients were "
                 f"not finite (metrics['grads_finite'] is False) or, with a WeightedLoss, "
                 f"their weight was zero; metrics['skipped_steps'] counts skipped steps. " +
                 _FIX + _nonfinite_weights(self.latest(), self.weights_block))


def _nonfinite_weights(state, weights_block: int | None) -> str:
  """Names the parameter leaves of ``state`` that hold NaN or inf, counted in this process's
  blocks (each device counts its own; no collective, so processes need not agree); "" when
  there are none or the state is gone (donated, deleted, not held). ``weights_block``: the
  block size of quantized weight gathers, or None."""
  if state is None:
    return ""
  bad = []
  paths = jax.tree_util.tree_flatten_with_path(state.params)[0]
  try:
    for (path, x), layout in zip(paths, state.meta.param_layouts):
      if not jnp.issubdtype(x.dtype, jnp.inexact):
        continue
      n = sum(int(jnp.sum(~jnp.isfinite(s.data))) for s in x.addressable_shards
              if s.replica_id == 0)
      if n:
        bad.append(f"params{jax.tree_util.keystr(path)} ({n} of {math.prod(layout.shape)} "
                   f"values)")
  except Exception:  # pylint: disable=broad-except  (donated by a later step: nothing to say)
    return ""
  if not bad:
    return ""
  qwz = "" if weights_block is None else (
      f" With quantized weights (qwZ) a non-finite weight spoils its whole block of "
      f"{weights_block} values as they are gathered, so every step that reads any value of "
      f"that block is skipped, even when the batch never reads the bad value itself (the "
      f"exact step trains on).")
  return (f" The parameters hold non-finite weights: {', '.join(bad[:4])}: a step whose "
          f"loss reads one is not finite.{qwz} Repair those values (params = "
          f"step.get_params(state), fix them, step.init(params)) or restore a checkpoint.")


def deliver(note: str = "") -> None:
  """Flushes every live `StallWatch`: pending warnings are raised now.

  Example:
    >>> deliver()   # nothing pending: nothing happens
  """
  for watch in list(_WATCHES):
    watch.flush(note)


def _deliver_at_exit() -> None:
  deliver(" (Reported at interpreter exit.)")


def _register_at_exit() -> None:
  """`deliver` at interpreter exit, before JAX's own exit hook frees the devices (atexit
  runs hooks in reverse order of registration, and JAX registers its hook on import)."""
  global _at_exit
  if not _at_exit:
    atexit.register(_deliver_at_exit)
    _at_exit = True


def _done(metrics) -> bool:
  health = metrics["health"]
  return health.is_deleted() or health.is_ready()


def _host(x):
  """A replicated scalar's value from this process's copy (also in multi-process runs,
  where the global array is not fully addressable)."""
  return np.asarray(x.addressable_data(0))


def _user_level() -> int:
  """The ``stacklevel`` of the first frame outside zero_jax (the user's call), seen from
  the caller of ``warnings.warn``."""
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  # abspath: a module imported through a path such as "benchmarks/../zero_jax" keeps the
  # ".." in its code's file name.
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
    frame, level = frame.f_back, level + 1
  return level
