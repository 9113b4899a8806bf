"""Row lookups on an embedding table the stage-3 step leaves split (``lookup=``): `take`.

At stage 3 a parameter is gathered whole before ``loss_fn`` uses it; for an embedding table
that is only looked up (``table[ids]``) that moves the whole table twice a step (the gather,
and its transpose's reduce-scatter) for the few rows the batch reads. Leaves marked
``lookup=`` are instead left split and reach ``loss_fn`` as a `LookupTable`; ``take(table,
ids)`` then moves only the looked-up rows:

* the table is split along a dimension after the first (the feature dimension ``d`` of a
  ``[V, d]`` table, padded to a multiple of the device count), so that every device holds
  every row and a slice of its features;
* each device's ids are all-gathered over the gather axes (integers: small);
* each device takes its feature slice of every gathered id's row;
* an all-to-all sends each device its own ids' slices from every device: whole rows.

Per device that sends ``(n - 1) / n`` of its own rows ``[tokens, d]`` (and the ids), once
each way (the backward pass is the all-to-all back and a scatter-add into the local slice);
never the table. ``zero_jax.gather`` on a `LookupTable` gives the whole table (one
all-gather, e.g. for tied output logits ``x @ table.T``). At stages 1-2 (and with
``gather_once=True``) the leaf is whole and `take` is plain indexing, so one loss runs at
every stage; outside the step `take` on an array is ``table[ids]``.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp

from zero_jax.comm.axes import axes_size, make_varying, varying_axes
from zero_jax.comm.layout import unpad
from zero_jax.layers.stacked import ShardedParam

_step = threading.local()


@jax.tree_util.register_pytree_node_class
class LookupTable(ShardedParam):
  """A stage-3 ``lookup=`` leaf inside ``loss_fn``: this device's block of the table.

  The block holds every row and a slice of the other dimensions (`Layout.dim` >= 1, or the
  whole leaf when it has one dimension). Use it with `take` (rows) or `zero_jax.gather`
  (the whole table); as an array it raises.
  """

  def __jax_array__(self):
    raise TypeError(
        f"params{self.path} is a lookup table (lookup=): at stage 3 it stays split, and was "
        f"used as an array. Look rows up with zj.take(table, ids), or call zj.gather(table) "
        f"where the whole table is needed (tied output logits: x @ zj.gather(table).T); or "
        f"do not mark it lookup=.")

  def __getitem__(self, index):
    raise TypeError(
        f"params{self.path} is a lookup table (lookup=) and was indexed (table[...]); at "
        f"stage 3 it stays split: look rows up with zj.take(table, ids) (it equals "
        f"table[ids]), or index zj.gather(table). An nnx.Embed indexes its table when called "
        f"(model.embed(ids), model.embed.attend(x)): call zj.take(model.embed.embedding, ids) "
        f"and use zj.gather(model.embed.embedding) for attend.")

  def __repr__(self):
    return f"LookupTable(params{self.path}, shape={self.shape}, layout={self.layout})"


@contextlib.contextmanager
def in_stage3_loss(gathered: dict):
  """Marks the loss being traced by a stage-3 step: ``gathered`` maps ``id`` of each
  parameter it gathered whole (not marked ``lookup=``) to its path, so that `take` on one
  names it."""
  before = getattr(_step, "gathered", {})
  _step.gathered = gathered
  try:
    yield
  finally:
    _step.gathered = before


def _unwrap(table):
  """An ``nnx.Variable``'s value (``model.embed.embedding``), or ``table`` itself."""
  raw = getattr(table, "get_raw_value", None)
  return raw() if callable(raw) else table


def _check_ids(ids, where: str):
  ids = jnp.asarray(ids) if not hasattr(ids, "dtype") else ids
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"zj.take({where}, ids): ids have dtype {ids.dtype}; they index rows, so "
                    f"they must be integers (e.g. tokens.astype(jnp.int32)).")
  return ids


def _in_range(ids, rows: int):
  """``ids`` as ``table[ids]`` reads them: negative ones count from the end, and the
  others are clamped to ``[0, rows - 1]``."""
  return jnp.clip(jnp.where(ids < 0, ids + rows, ids), 0, rows - 1)


def take(table, ids):
  """Rows ``table[ids]`` of an embedding table, moving only those rows at stage 3.

  Inside ``loss_fn`` on a leaf marked ``lookup=`` (a `LookupTable` at stage 3) each
  device gets the rows of its own ``ids``: the ids are all-gathered and the rows come
  back by an all-to-all (see `zero_jax.layers.lookup`); the gradient flows back the same
  way. Elsewhere (stages 1-2, ``gather_once=True``, outside the step) it is plain
  indexing. Ids follow ``table[ids]``: a negative id counts from the end, an id out of
  range is clamped to the first or last row (no error: ids are traced values).

  Example:
    >>> import jax.numpy as jnp, zero_jax as zj
    >>> table = jnp.arange(12.0).reshape(4, 3)
    >>> zj.take(table, jnp.array([[0, 3], [3, -1]])).shape
    (2, 2, 3)
    >>> zj.take(table, jnp.array([1, 7]))  # 7 is out of range: clamped, as table[ids]
    Array([[ 3.,  4.,  5.],
           [ 9., 10., 11.]], dtype=float32)

    In a step: ``zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, stage=3,
    lookup={"embed": True, ...})`` with ``h = zj.take(params["embed"], batch["ids"])``
    in ``loss_fn`` (the stage 3 guide, "Embedding lookups on the split table").

  Args:
    table: the table, ``[rows, ...]``: a `LookupTable` (stage 3, ``lookup=``), an array,
      or an ``nnx.Variable`` holding either (``model.embed.embedding``).
    ids: integer array of any shape, this device's ids.

  Returns:
    ``[*ids.shape, *table.shape[1:]]``, equal to ``table[ids]`` on the whole table.

  Raises:
    TypeError: ids that are not integers; at stage 3, a parameter not marked
      ``lookup=`` (the step gathered it whole, which the lookup meant to avoid) or a
      ``stacked=`` leaf.
  """
  table = _unwrap(table)
  if isinstance(table, LookupTable):
    ids = _check_ids(ids, f"params{table.path}")
    return _split_take(table, _in_range(ids, table.layout.shape[0]))
  if isinstance(table, ShardedParam):
    raise TypeError(f"zj.take got params{table.path}, a stacked leaf (stacked=); take looks "
                    f"rows up in a table marked lookup=. Mark the table lookup= instead of "
                    f"stacked=, or index zj.gather(layer) inside the loop over layers.")
  path = getattr(_step, "gathered", {}).get(id(table))
  if path is not None:
    raise TypeError(
        f"zj.take got params{path}, which is not marked lookup=: at stage 3 the step "
        f"gathered the whole table before loss_fn for this lookup. Add it to lookup= (e.g. "
        f"lookup={{...: True}} at its path, or an NNX filter such as "
        f"nnx.PathContains(...)), so that it stays split and only the looked-up rows move.")
  ids = _check_ids(ids, "table")
  if not hasattr(table, "shape") or not table.shape:
    raise TypeError(f"zj.take takes a table with at least one dimension (rows first); got "
                    f"{type(table).__name__} of shape {getattr(table, 'shape', None)}.")
  return jnp.take(table, _in_range(ids, table.shape[0]), axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rows(block, ids, dtype):
  """``jnp.take(block.astype(dtype), ids, axis=0)`` with only the taken rows cast (the
  table's `ShardedParam.gather_dtype`, as a gather casts what it moves): its gradient is
  that of the cast block, summed in ``dtype`` (where ids repeat) and widened at the end."""
  return jnp.take(block, ids, axis=0).astype(dtype)


def _rows_fwd(block, ids, dtype):
  return _rows(block, ids, dtype), (block, ids)


def _rows_bwd(dtype, res, ct):
  block, ids = res
  half = make_varying(jnp.zeros(block.shape, dtype), varying_axes(block))
  g, = jax.vjp(lambda b: jnp.take(b, ids, axis=0), half)[1](ct)
  return g.astype(block.dtype), None


_rows.defvjp(_rows_fwd, _rows_bwd)


def _take_rows(table: LookupTable, ids):
  """This block's rows ``ids``, in the table's gather dtype."""
  if table.gather_dtype is None:
    return jnp.take(table.block, ids, axis=0)
  return _rows(table.block, ids, jnp.dtype(table.gather_dtype))


def _split_take(table: LookupTable, ids):
  """`take` on a stage-3 block: every device's ids, this block's slice of their rows, and
  each device's own rows back (the all-to-all)."""
  layout, axes = table.layout, table.comm.gather_axes
  if layout.dim is None or axes_size(axes) == 1:  # the whole leaf is here
    return unpad(_take_rows(table, ids), _shifted(layout, ids.ndim))
  every = jax.lax.all_gather(ids, axes, axis=0, tiled=False)  # [n, *ids.shape]
  rows = _take_rows(table, every)  # [n, *ids.shape, *block.shape[1:]]
  dim = ids.ndim + layout.dim  # the split dimension in ``rows``
  mine = jax.lax.all_to_all(rows, axes, 0, dim, tiled=True)  # [1, *ids.shape, ...whole]
  return unpad(mine[0], _shifted(layout, ids.ndim))


def _shifted(layout, k: int):
  """``layout`` of the rows of ``k``-dimensional ids (the table's first dimension
  replaced by ``k`` ones), for `unpad`."""
  return layout._replace(shape=(1,) * k + tuple(layout.shape[1:]),
                         dim=None if layout.dim is None else layout.dim - 1 + k)
