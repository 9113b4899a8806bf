"""Precision policies: which dtype each copy of the parameters lives in.

``"fp32"`` casts nothing; ``"bf16"`` and ``"fp16"`` keep a float32 master copy (sharded) and
float32 optimizer state; ``"fp16_memory_efficient"`` keeps no master copy. fp16 defaults to
dynamic loss scaling. The reduction's dtype rule is in the docs' precision guide."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class Policy(NamedTuple):
  """A precision policy (static).

  Attributes:
    name: the policy's name.
    param_dtype: dtype of the parameters the loss sees and that are stored
      (None: each leaf keeps its own dtype).
    master_dtype: dtype of the sharded master copy, or None for no copy.
    dynamic_loss_scale: whether loss scaling is dynamic by default.
  """
  name: str
  param_dtype: jnp.dtype | None
  master_dtype: jnp.dtype | None
  dynamic_loss_scale: bool


POLICIES = {
    "fp32": Policy("fp32", None, None, False),
    "bf16": Policy("bf16", jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), False),
    "fp16": Policy("fp16", jnp.dtype(jnp.float16), jnp.dtype(jnp.float32), True),
    "fp16_memory_efficient": Policy("fp16_memory_efficient", jnp.dtype(jnp.float16), None, True),
}


def get_policy(precision: str) -> Policy:
  """The `Policy` called ``precision``; raises ValueError naming the choices."""
  if precision not in POLICIES:
    raise ValueError(f"precision={precision!r} is not a precision policy; choose one of "
                     f"{sorted(POLICIES)}.")
  return POLICIES[precision]


def is_trainable_dtype(dtype) -> bool:
  """Whether a leaf of ``dtype`` can train: every inexact dtype (real and complex), as in optax."""
  return jnp.issubdtype(dtype, jnp.inexact)


def _cast(policy: Policy, dtype) -> bool:
  return policy.param_dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def param_dtype(policy: Policy, dtype) -> np.dtype:
  """dtype a trainable leaf of ``dtype`` is stored in and seen by the loss."""
  return policy.param_dtype if _cast(policy, dtype) else jnp.dtype(dtype)


def optimizer_dtype(policy: Policy, dtype) -> np.dtype:
  """dtype the optimizer sees a trainable leaf of ``dtype`` in (its state's dtype)."""
  return jnp.dtype(jnp.float32) if _cast(policy, dtype) else jnp.dtype(dtype)


def has_master(policy: Policy, dtype) -> bool:
  """Whether a trainable leaf of ``dtype`` keeps a sharded float32 master copy."""
  return policy.master_dtype is not None and _cast(policy, dtype)


def warn_without_master(policy: Policy, paths, dtypes, trainable) -> None:
  """Warns when trainable leaves below float32 train without a float32 master copy.

  Under ``"fp32"`` each leaf keeps its dtype, so a bfloat16 (or float16) leaf
  is updated in that dtype: an update smaller than half its resolution (e.g.
  ``adam(1e-4)`` on weights near 1) rounds away and the leaf never changes.
  """
  if policy.name != "fp32":
    return
  low = [f"params{p} ({jnp.dtype(d).name})" for p, d, t in zip(paths, dtypes, trainable)
         if t and jnp.issubdtype(d, jnp.floating) and jnp.finfo(d).bits < 32]
  if low:
    more = f" and {len(low) - 6} more" if len(low) > 6 else ""
    warnings.warn(
        f"zero_jax: precision='fp32' trains every leaf in its own dtype, and "
        f"{', '.join(low[:6])}{more} {'is' if len(low) == 1 else 'are'} below float32 with "
        f"no float32 master copy: updates "
        f"smaller than their resolution are lost (with a small learning rate most entries "
        f"never change). Use precision='bf16' (bfloat16 compute with a sharded float32 "
        f"master copy), or cast these leaves to float32 before init.",
        RuntimeWarning, stacklevel=3)
