"""Every private API of JAX, Orbax and Python that zero_jax uses, in one place.

Each function names what it reaches into and what public API would replace it.
``tests/test_compat.py`` calls each one, so an upgrade that removes one fails there,
naming it, instead of somewhere deep in a training run.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable


def coordination_client() -> Any:
  """The ``jax.distributed`` key-value store client, or None before ``initialize``.

  Private: ``jax._src.distributed.global_state.client``. Replace with a public
  accessor when JAX has one (``jax.distributed`` exposes none in 0.10).
  """
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  return jax_distributed.global_state.client


def register_before_thread_pools_exit(fn: Callable[[], None]) -> None:
  """Runs ``fn`` at interpreter exit *before* ``concurrent.futures`` shuts its pools.

  Private: ``threading._register_atexit`` (what ``concurrent.futures`` itself uses);
  ``atexit.register`` runs too late for a save on a pool thread to finish. Falls back
  to ``atexit.register`` if Python removes it.
  """
  getattr(threading, "_register_atexit", atexit.register)(fn)


def eval_equation(eqn, args: list) -> Any:
  """Evaluates one jaxpr equation on ``args`` under its context (sharding, named scopes).

  Private: ``eqn.ctx.manager`` and ``Primitive.get_bind_params``, as
  ``jax.core.eval_jaxpr`` does. Replace with a public per-equation evaluator if JAX
  adds one (``jax.core.eval_jaxpr`` evaluates whole jaxprs only).
  """
  with eqn.ctx.manager:
    return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))


def orbax_temporary_path_class(directory) -> type:
  """Orbax's default class for the temporary directory a step is written into.

  Private-ish: ``orbax.checkpoint.path.atomicity_defaults.
  get_default_temporary_path_class``, subclassed to write the integrity record before
  the commit (its ``finalize``, ``get`` and ``get_final``). Replace with a public
  "before commit" hook if Orbax adds one.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.path.atomicity_defaults.get_default_temporary_path_class(directory)


def orbax_tmp_dir_suffix() -> str:
  """The suffix of Orbax's temporary step directories (``ocp.path.step.TMP_DIR_SUFFIX``)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp.path.step.TMP_DIR_SUFFIX


def preemption_notice_key() -> str:
  """The coordination-service key through which JAX's preemption sync manager learns of a notice.

  Private: the ``RECEIVED_PREEMPTION_NOTICE`` key of XLA's
  ``preemption_sync_manager.cc``. Its C++ SIGTERM handler sets it (to an RFC 3339
  time); every process's manager watches it and then agrees on the sync point.
  zero_jax sets it for the other signals it watches. Replace with a public
  "notify preemption" call if JAX adds one.
  """
  return "RECEIVED_PREEMPTION_NOTICE"


# Functions above, by the name a failing upgrade should be reported under.
ALL = {
    "coordination_client": coordination_client,
    "register_before_thread_pools_exit": register_before_thread_pools_exit,
    "eval_equation": eval_equation,
    "orbax_temporary_path_class": orbax_temporary_path_class,
    "orbax_tmp_dir_suffix": orbax_tmp_dir_suffix,
    "preemption_notice_key": preemption_notice_key,
}
