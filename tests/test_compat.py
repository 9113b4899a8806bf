"""Each private API zero_jax reaches into (`zero_jax._compat`) still exists and works.

A JAX, Orbax or Python upgrade that removes one fails here, naming the function.
"""

import threading

import jax
import jax.numpy as jnp
import pytest

from zero_jax import _compat


def test_every_private_api_is_listed_and_called_here():
  called = {"coordination_client", "register_before_thread_pools_exit", "eval_equation",
            "orbax_temporary_path_class", "orbax_tmp_dir_suffix", "preemption_notice_key"}
  assert set(_compat.ALL) == called, "a new _compat function needs its test here"


def test_coordination_client_is_none_before_initialize():
  assert _compat.coordination_client() is None, "coordination_client: jax internals moved"


def test_register_before_thread_pools_exit_uses_threadings_hook():
  assert hasattr(threading, "_register_atexit"), \
      "register_before_thread_pools_exit: Python removed threading._register_atexit"
  _compat.register_before_thread_pools_exit(lambda: None)


def test_eval_equation_evaluates_a_jaxpr_equation():
  jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0).jaxpr
  env = {jaxpr.invars[0]: jnp.float32(0.5)}
  for eqn in jaxpr.eqns:
    args = [env[v] if not hasattr(v, "val") else v.val for v in eqn.invars]
    out = _compat.eval_equation(eqn, args)
    env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
  assert float(env[jaxpr.outvars[0]]) == pytest.approx(2 * float(jnp.sin(0.5))), \
      "eval_equation: eqn.ctx.manager or Primitive.get_bind_params changed"


def test_orbax_temporary_path_class_has_the_hooks_we_override(tmp_path):
  cls = _compat.orbax_temporary_path_class(tmp_path)
  for name in ("finalize", "get", "get_final"):
    assert hasattr(cls, name), f"orbax_temporary_path_class: Orbax's class lost {name}"


def test_orbax_tmp_dir_suffix_is_a_string():
  suffix = _compat.orbax_tmp_dir_suffix()
  assert isinstance(suffix, str) and suffix, "orbax_tmp_dir_suffix: Orbax renamed it"


def test_preemption_notice_key_is_the_one_jaxlibs_sync_manager_watches():
  import mmap
  import pathlib
  import jaxlib
  key = _compat.preemption_notice_key().encode()
  found = []
  for lib in pathlib.Path(jaxlib.__file__).parent.glob("*.so"):
    with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      found += [lib.name] if m.find(key) != -1 else []
  assert found, "preemption_notice_key: jaxlib's preemption sync manager no longer names it"
