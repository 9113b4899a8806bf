"""Shared helpers for the feature tests (accumulation, trainable, model state, stage 3).

A single-device reference step (plain ``jax.jit`` + optax, no sharding, no
micro-batches), tree comparison, and a reader for the collectives in compiled
HLO text that tells which of them run inside a ``while`` loop (the
``lax.scan`` over micro-batches).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

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
_OP = re.compile(r"=\s*(.+?)\s+(all-reduce|reduce-scatter|all-gather|all-to-all|"
                 r"collective-permute)(?:-start)?\(")
_HEAD = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(hlo):
  comps, cur = {}, None
  for line in hlo.splitlines():
    m = _HEAD.match(line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
    elif cur is not None:
      if line.strip() == "}":
        cur = None
      else:
        comps[cur].append(line)
  return comps


def collectives(hlo):
  """``[(op, result_shape_text, in_loop)]`` for each collective in compiled HLO text.

  ``in_loop`` is True for collectives in a ``while`` body or condition, or in
  any computation those call.
  """
  comps = _computations(hlo)
  todo = []
  for lines in comps.values():
    for line in lines:
      if " while(" in line:
        todo += re.findall(r"(?:body|condition)=%?([\w.\-]+)", line)
  in_loop = set()
  while todo:
    c = todo.pop()
    if c in in_loop or c not in comps:
      continue
    in_loop.add(c)
    for line in comps[c]:
      todo += _CALLED.findall(line)
      for group in _BRANCHES.findall(line):
        todo += [x.strip().lstrip("%") for x in group.split(",")]
  out = []
  for name, lines in comps.items():
    for line in lines:
      m = _OP.search(line)
      if m:
        out.append((m.group(2), m.group(1), name in in_loop))
  return out


def shapes_in(shape_text):
  """Every array shape in an HLO result type, e.g. '(f32[2,3]{1,0}, f32[])' -> [(2, 3), ()]."""
  return [tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", shape_text)]


def gradient_collectives(colls):
  """Reduce-scatters and all-reduces that carry an array of more than one element."""
  return [c for c in colls if c[0] in ("reduce-scatter", "all-reduce")
          and any(np.prod(s) > 1 for s in shapes_in(c[1]))]


_GROUPS_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\],\s*device_ids=\(\[([\d,]+)\]"
                          r"(?:T\(([\d,]+)\))?\)\s*\{([^}]*)\}")


def _mesh_groups(m):
  """Groups of the mesh form: ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}``."""
  axes = [(n.strip().strip("'"), int(v)) for n, v in
          (a.split("=") for a in m.group(1).split(","))]
  dims = [int(d) for d in m.group(2).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if m.group(3):
    ids = ids.transpose([int(d) for d in m.group(3).split(",")])
  ids = ids.reshape([v for _, v in axes])
  reduced = {a.strip().strip("'") for a in m.group(4).split(",")}
  order = [i for i, (n, _) in enumerate(axes) if n not in reduced] + \
          [i for i, (n, _) in enumerate(axes) if n in reduced]
  size = int(np.prod([v for n, v in axes if n in reduced]))
  return [tuple(int(d) for d in g) for g in ids.transpose(order).reshape(-1, size)]


def replica_groups(line):
  """The device groups of one HLO collective, as a list of tuples of device ids.

  Reads the forms XLA prints: ``{{0,1},{2,3}}``, the iota form ``[2,4]<=[8]`` /
  ``[4,2]<=[2,4]T(1,0)`` (iota over the second shape, transposed, reshaped to
  the first), and the mesh form ``mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0))
  {'a'}`` (devices on a mesh, grouped along the named axes).
  """
  m = _GROUPS_MESH.search(line)
  if m:
    return _mesh_groups(m)
  m = _GROUPS_EXPLICIT.search(line)
  if m:
    return [tuple(int(d) for d in g.split(",") if d)
            for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = _GROUPS_IOTA.search(line)
  if m:
    shape = [int(d) for d in m.group(1).split(",")]
    dims = [int(d) for d in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(d) for d in m.group(3).split(",")])
    return [tuple(int(d) for d in g) for g in ids.reshape(shape[0], -1)]
  return None


def collective_groups(hlo):
  """``[(op, result_shape_text, groups)]`` for every collective in compiled HLO text."""
  out = []
  for line in hlo.splitlines():
    m = _OP.search(line)
    if m:
      out.append((m.group(2), m.group(1), replica_groups(line)))
  return out


def shard_bytes(tree, device):
  """Bytes of ``tree``'s shards that live on ``device``."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)
