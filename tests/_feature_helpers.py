"""Shared helpers for the feature tests (accumulation, trainable, model state, stage 3).

A single-device reference step (plain ``jax.jit`` + optax, no sharding, no
micro-batches), tree comparison, and a reader for the collectives in compiled
HLO text that tells which of them run inside a ``while`` loop (the
``lax.scan`` over micro-batches).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero_jax.comm import hlo as hlo_lib
from zero_jax.comm.hlo import replica_groups, shapes_in  # noqa: F401 (re-exported)

N = 8
RTOL = 1e-5
ATOL = 1e-6


def assert_tree_close(actual, expected, rtol=RTOL, atol=ATOL, what=""):
  """Same structure, and every leaf close (dtypes must agree)."""
  assert jax.tree.structure(actual) == jax.tree.structure(expected), what
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                          jax.tree.leaves(expected)):
    a, b = np.asarray(a), np.asarray(b)
    where = f"{what}{jax.tree_util.keystr(path)}"
    assert a.shape == b.shape and a.dtype == b.dtype, (where, a.shape, a.dtype, b.shape, b.dtype)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=where)


def is_float(x):
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def reference_run(loss_fn, optimizer, params, batches, *, mask=None, has_aux=False):
  """Plain single-device training: full-batch gradient, optax update.

  Args:
    mask: None (every float leaf trains) or a full tree of bools. Frozen leaves
      are not differentiated, get a zero gradient, and the optimizer is
      ``optax.masked(optimizer, mask)``, so they have no optimizer state, do
      not enter global norms or weight decay, and are never updated.

  Returns:
    (params after each step, loss of each step, aux of each step).
  """
  treedef = jax.tree.structure(params)
  leaves = jax.tree.leaves(params)
  flags = ([is_float(x) for x in leaves] if mask is None else
           [bool(m) for m in jax.tree.leaves(mask)])
  opt = optimizer if all(flags) else optax.masked(optimizer, jax.tree.unflatten(treedef, flags))

  def merge(train, frozen):
    it_t, it_f = iter(train), iter(frozen)
    return jax.tree.unflatten(treedef, [next(it_t) if f else next(it_f) for f in flags])

  @jax.jit
  def step(leaves, opt_state, batch):
    train = [x for x, f in zip(leaves, flags) if f]
    frozen = [x for x, f in zip(leaves, flags) if not f]
    fn = lambda t: loss_fn(merge(t, frozen), batch)
    (loss, aux), g = jax.value_and_grad(
        (lambda t: fn(t)) if has_aux else (lambda t: (fn(t), None)), has_aux=True)(train)
    grads = merge(g, [jnp.zeros_like(x) for x in frozen])
    updates, opt_state = opt.update(grads, opt_state, jax.tree.unflatten(treedef, leaves))
    ups = jax.tree.leaves(updates)
    new = [(x + u).astype(x.dtype) if f else x for x, u, f in zip(leaves, ups, flags)]
    return new, opt_state, loss, aux

  leaves = [jnp.asarray(x) for x in leaves]
  opt_state = opt.init(jax.tree.unflatten(treedef, leaves))
  out, losses, auxes = [], [], []
  for b in batches:
    leaves, opt_state, loss, aux = step(leaves, opt_state, b)
    out.append(jax.tree.unflatten(treedef, leaves))
    losses.append(loss)
    auxes.append(aux)
  return out, losses, auxes


def assert_stage3_equals_stage2_equals_reference(run3, run2, loss_fn, optimizer, params,
                                                 batches):
  """``run3``/``run2``: (step, state, losses) of a stage-3 and a stage-2 run on ``batches``."""
  (step3, state3, losses3), (step2, state2, losses2) = run3, run2
  ref, ref_losses, _ = reference_run(loss_fn, optimizer, params, batches)
  p3, p2 = step3.get_params(state3), step2.get_params(state2)
  assert_tree_close(p3, p2, rtol=1e-6, what="stage 3 vs 2")
  assert_tree_close(p3, ref[-1], what="stage 3 vs reference")
  np.testing.assert_allclose(losses3, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(losses2, ref_losses, rtol=1e-5)


# ------------------------------------------------------------------ HLO text
def collectives(hlo):
  """``[(op, result_shape_text, in_loop)]`` for each collective in compiled HLO text."""
  return [(c.op, c.shape_text, c.in_loop) for c in hlo_lib.collectives(hlo)]


def collective_groups(hlo):
  """``[(op, result_shape_text, groups)]`` for every collective in compiled HLO text."""
  return [(c.op, c.shape_text, c.groups) for c in hlo_lib.collectives(hlo)]


def gradient_collectives(colls):
  """Reduce-scatters and all-reduces that carry an array of more than one element."""
  return [c for c in colls if c[0] in ("reduce-scatter", "all-reduce")
          and any(np.prod(s) > 1 for s in shapes_in(c[1]))]


def shard_bytes(tree, device):
  """Bytes of ``tree``'s shards that live on ``device``."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)
