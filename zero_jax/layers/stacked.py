"""Gathering stacked layers one at a time inside ``loss_fn`` (stages 2 and 3).

Leaves marked ``stacked=`` reach ``loss_fn`` as a `ShardedParam`; `gather` on one layer's slice
inside a ``lax.scan`` (under ``jax.checkpoint``) keeps only a layer or two whole at stage 3, and
at stage 2 reduce-scatters each layer's gradient inside the backward loop. At stage 1 and
outside the step `gather` is the identity. See the docs' stage 3 guide."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zero_jax.comm.axes import make_varying, varying_axes
from zero_jax.comm.collectives import (Comm, all_gather_many, axes_size, gather_in_loss,
                                       in_gather_dtype, plan_buckets, psum, reduce_outer_many,
                                       reduce_scatter_many, scatter_in_loss)
from zero_jax.layers import nnx as nnx_lib
from zero_jax.comm.layout import Layout, local_storage_shape, unpad


ONE = 1 << 62  # a bucket size no layer reaches


@jax.tree_util.register_pytree_node_class
class ShardedParam:
  """A stage-3 stacked leaf (or a slice of it) that `gather` has not gathered yet.

  A pytree whose children are the device's block (and at stage 2 the whole
  value), so ``lax.scan``, ``jax.tree.map`` and Flax's lifted transforms slice
  it along its leading (stacking) dimension like the array it stands for.
  Elementwise functions mapped over it that way are exact too (the stand-ins
  that receive the reduced gradients hold the device's weights); one that mixes
  elements (a norm, a sum) sees a block, not the leaf: apply it after `gather`.

  Attributes:
    block: this device's block: the storage view's block of the whole stacked
      leaf, or of a slice of it along leading dimensions. At stage 2 the
      stand-in whose gradient is the reduced gradient of the slice (the
      device's block of ``full``).
    layout: the `Layout` of the whole stacked leaf (static).
    comm: the step's communication record (static): the axes it is split and
      gathered over, buckets (one `gather` call moves the small leaves it is
      given together) and the wire format.
    path: the leaf's ``keystr`` path, for error messages (static).
    full: stage 2: the whole value of the slice (replicated); None at stage 3.
    batch_axes: stage 2: the axes its gradient is local to (static); () at stage 3.
    sink: stage 3 with hpZ or replica axes: the device's block of the weights
      split over every data axis, whose gradient is the slice's gradient reduced over every
      axis (the block's is not taken); None otherwise.
    gather_dtype: the dtype `gather` casts the block (the slice it gathers) to just before
      its all-gather (static): the compute dtype where the block is the step's float32
      master (stage 3 under ``"bf16"``/``"fp16"``); None: the block's own. The gradient
      comes back in the block's dtype, reduced in this one.
  """

  def __init__(self, block, layout: Layout, comm: Comm, path: str, full=None,
               batch_axes: tuple = (), sink=None, gather_dtype=None):
    self.block = block
    self.layout = layout
    self.comm = comm
    self.path = path
    self.full = full
    self.batch_axes = batch_axes
    self.sink = sink
    self.gather_dtype = gather_dtype

  @property
  def axis_name(self) -> tuple:
    """The mesh axes its block is split over (and gathered over)."""
    return self.comm.gather_axes if self.full is None else self.comm.data_axes

  def tree_flatten(self):
    return (self.block, self.full, self.sink), (self.layout, self.comm, self.path,
                                                self.batch_axes, self.gather_dtype)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], aux[0], aux[1], aux[2], children[1], aux[3], children[2], aux[4])

  def _replace(self, **changes) -> "ShardedParam":
    kw = dict(block=self.block, layout=self.layout, comm=self.comm, path=self.path,
              full=self.full, batch_axes=self.batch_axes, sink=self.sink,
              gather_dtype=self.gather_dtype)
    return type(self)(**{**kw, **changes})

  def with_block(self, block) -> "ShardedParam":
    """The same leaf with another block (same shape and dtype)."""
    return self._replace(block=block)

  def in_one_bucket(self) -> "ShardedParam":
    """The same leaf, moved with every other such leaf of its dtype and kind (no bucket
    size), exactly as one collective per leaf in its own layout (`Comm.pack`), which XLA:GPU's
    combiners join (`zero_jax.step.compile_options`): `zero_jax.scan` moves a layer so, one
    collective per direction, with no copy into or out of a joined buffer."""
    return self._replace(comm=dataclasses.replace(self.comm, bucket_bytes=ONE, pack=False))

  @property
  def wire_dtype(self):
    """The dtype its gather moves and returns (`gather_dtype`, else the block's)."""
    return jnp.dtype(self.gather_dtype or self.block.dtype)

  @property
  def differentiated(self) -> int:
    """Which of its flattened children the step differentiates: the sink where there is
    one (it comes after the block), else the block (at stage 2 itself a stand-in)."""
    return 0 if self.sink is None else 1

  @property
  def shape(self) -> tuple[int, ...]:
    """Logical shape of what `gather` returns (the slice's, when sliced)."""
    drop = len(self.layout.shape) - len(getattr(self.block, "shape", self.layout.shape))
    return self.layout.shape[drop:]

  def __jax_array__(self):
    raise TypeError(
        f"params{self.path} is a stacked leaf (stacked=) and was used as an array "
        f"without zero_jax.gather (at stage 3 it is sharded; at stage 2 gather reduces its "
        f"gradient inside the loop). Call zj.gather(...) on it where it is used, ideally on "
        f"one layer's slice inside the loop over layers (e.g. in the lax.scan body), or do "
        f"not mark it stacked=.")

  def __getitem__(self, index):
    full = None if self.full is None else self.full[index]
    sink = None if self.sink is None else self.sink[index]
    return self._replace(block=self.block[index], full=full, sink=sink)

  def __repr__(self):
    return f"ShardedParam(params{self.path}, shape={self.shape}, layout={self.layout})"


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _scatter_on_backward(blocks, fulls, layouts, comm: Comm, batch_axes, groups):
  """Stage 2: ``fulls`` (made local to the device); the transpose sends their gradients
  to ``blocks``, reduced as ``comm`` says (reduce-scattered over the data axes,
  all-reduced over the replica axes), the small ones together (``groups``)."""
  del blocks, layouts, comm, groups
  return [jax.lax.pcast(f, batch_axes, to="varying") for f in fulls]


def _scatter_fwd(blocks, fulls, layouts, comm, batch_axes, groups):
  out = _scatter_on_backward(blocks, fulls, layouts, comm, batch_axes, groups)
  return out, [jnp.zeros((), b.dtype) for b in blocks]


def _scatter_bwd(layouts, comm, batch_axes, groups, zeros, cts):
  del batch_axes
  gs = reduce_scatter_many(cts, layouts, groups, comm)
  return ([g.astype(z.dtype) for g, z in zip(gs, zeros)],
          [jnp.zeros(ct.shape, ct.dtype) for ct in cts])


_scatter_on_backward.defvjp(_scatter_fwd, _scatter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _gather_into_sinks(sinks, blocks, layouts, comm: Comm, groups, dtypes):
  """Stage 3 with hpZ or replica axes: ``blocks`` gathered over the gather axes (in
  ``dtypes``); the transpose sends their gradients to ``sinks`` reduced over every axis:
  over the gather axes (the gather's transpose), then across hosts and replicas
  (`reduce_outer_many`), so that the whole reduction runs where the layer's backward does."""
  del sinks
  return all_gather_many(_local(blocks, comm), list(layouts), groups, comm, to="varying",
                         dtypes=dtypes)


def _local(blocks, comm: Comm) -> list:
  """Blocks made device-varying over the axes they are replicated on (the other data
  axes, the replica axes): their gradients are the device's own until reduced."""
  return [make_varying(b, comm.outer_axes + comm.replica_axes) for b in blocks]


def _sinks_fwd(sinks, blocks, layouts, comm, groups, dtypes):
  out = _gather_into_sinks(sinks, blocks, layouts, comm, groups, dtypes)
  return out, ([jnp.zeros((), s.dtype) for s in sinks], blocks)


def _sinks_bwd(layouts, comm, groups, dtypes, res, cts):
  zeros, blocks = res
  gs = scatter_in_loss(list(cts), _local(blocks, comm), layouts, groups, comm, dtypes=dtypes)
  gs = reduce_outer_many(gs, layouts, groups, comm)
  return [g.astype(z.dtype) for g, z in zip(gs, zeros)], [jnp.zeros_like(b) for b in blocks]


_gather_into_sinks.defvjp(_sinks_fwd, _sinks_bwd)


def _sliced_layout(x: ShardedParam) -> tuple[Layout, tuple, int]:
  """The layout of the piece ``x`` holds, its block shape, and how many leading dims it lost."""
  layout = x.layout
  drop = len(layout.shape) - x.block.ndim  # leading dimensions indexed away
  # The step's shard_map is manual over the data axes only: model-split dimensions
  # keep their full size here (the compiler splits them), so only the data split counts.
  local = local_storage_shape(Layout(layout.shape, layout.dim, layout.padded),
                              axes_size(x.axis_name))
  shape = layout.shape[drop:]
  if drop == 0 and x.block.ndim:  # a range of layers, e.g. block[:-1]
    local = (x.block.shape[0],) + local[1:]
    shape = (x.block.shape[0],) + shape[1:]
  if not (0 <= drop and (layout.dim is None or drop <= layout.dim)
          and tuple(x.block.shape) == local[drop:]):
    raise ValueError(
        f"zero_jax.gather got a piece of params{x.path} with block shape "
        f"{tuple(x.block.shape)}; it gathers the stacked leaf (block shape {local}), a range "
        f"of its layers, or one layer (block shape {local[1:]}), e.g. in the body of a "
        f"lax.scan over the leaf. Index only the leading dimension before gathering, and the "
        f"other dimensions after.")
  dim = None if layout.dim is None else layout.dim - drop
  return Layout(shape, dim, layout.padded if dim is not None else 0), local, drop


_STAGE2, _SINK, _STAGE3 = "stage 2", "sink", "stage 3"


def _kind(x: ShardedParam) -> str:
  """How a `ShardedParam` is gathered and its gradient reduced (see `gather_many`)."""
  return _STAGE2 if x.full is not None else _STAGE3 if x.sink is None else _SINK


def _plan(xs: list) -> list[tuple[str, list[int], tuple, tuple]]:
  """How one `gather_many` call moves the `ShardedParam`s ``xs`` split over the data
  axes: per kind, ``(kind, their indices, sliced layouts, buckets)``."""
  sliced = [_sliced_layout(x)[0] for x in xs]
  plans = []
  for kind in (_STAGE2, _SINK, _STAGE3):
    idx = [i for i, x in enumerate(xs) if _kind(x) == kind and sliced[i].dim is not None]
    if idx:
      layouts = tuple(sliced[i] for i in idx)
      groups = plan_buckets(layouts, [xs[i].wire_dtype for i in idx],
                            bucket_bytes=xs[idx[0]].comm.bucket_bytes)
      plans.append((kind, idx, layouts, groups))
  return plans


def gather_many(xs: list) -> list:
  """Full values of the `ShardedParam`s ``xs`` (one layer's, or whole stacks), the small
  ones moved together; their gradients are reduced on the way back.

  The one mechanism of `gather` and `zero_jax.scan`: at stage 2 the value is
  here and the transpose reduce-scatters its gradient (into the zero block);
  at stage 3 the block is cast to its `ShardedParam.gather_dtype` and
  all-gathered over the gather axes, and the transpose reduce-scatters over
  them (with hpZ or replica axes, on into the sink over every axis). Only what
  is gathered is cast: inside a loop, one layer's slice. `scatter_many` is that
  transpose, for a caller that runs the backward pass itself.
  """
  # replicated (not split): as they are, in the gather's dtype
  out = [x.full if x.full is not None else _replicated(x) for x in xs]
  for kind, idx, layouts, groups in _plan(xs):
    first, blocks = xs[idx[0]], [xs[i].block for i in idx]
    dtypes = tuple(xs[i].gather_dtype for i in idx)
    if kind == _STAGE2:  # the value is here; reduce the gradient on the way back
      got = _scatter_on_backward(blocks, [jax.lax.stop_gradient(xs[i].full) for i in idx],
                                 layouts, first.comm, first.batch_axes, groups)
    elif kind == _SINK:
      got = _gather_into_sinks([xs[i].sink for i in idx],
                               [jax.lax.stop_gradient(b) for b in blocks], layouts,
                               first.comm, groups, dtypes)
    else:
      got = gather_in_loss(blocks, list(layouts), groups, first.comm, dtypes=dtypes)
    for i, g in zip(idx, got):
      out[i] = g
  return out


def _own_sum_axes(x: ShardedParam) -> tuple:
  """The batch axes a stage-3 leaf split over no axis does not vary over, where its
  gradient's sum over them must be `zero_jax.comm.collectives.psum`'s, not the one JAX writes
  for an unvarying value used beside varying ones: in bfloat16 beside model axes on CPU
  (`Comm.bf16_sums_in_f32`: XLA:CPU cannot compile JAX's). Else ()."""
  c = x.comm
  if (x.full is not None or not c.bf16_sums_in_f32
      or x.wire_dtype != jnp.bfloat16
      or _sliced_layout(x)[0].dim is not None):
    return ()
  return tuple(a for a in c.data_axes + c.replica_axes if a not in varying_axes(x.block))


def _replicated(x: ShardedParam):
  """A stage-3 leaf split over no axis, in its gather dtype: as it is, or (`_own_sum_axes`)
  made varying, its gradient summed by `_summed_on_backward`."""
  value = in_gather_dtype([x.block], [x.gather_dtype])[0]
  axes = _own_sum_axes(x)
  return _summed_on_backward(value, axes, x.comm) if axes else value


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _summed_on_backward(value, axes: tuple, comm: Comm):
  """``value`` made varying over ``axes``; the transpose sums its gradient over them with
  `zero_jax.comm.collectives.psum` (as JAX's own transpose would, in float32 where ``comm``
  says). `zero_jax.scan`'s backward runs its layers' pullbacks itself: `scatter_inner` sums
  there."""
  return make_varying(value, axes)


def _summed_fwd(value, axes, comm):
  return _summed_on_backward(value, axes, comm), None


def _summed_bwd(axes, comm, _, ct):
  return (psum(ct, axes, comm),)


_summed_on_backward.defvjp(_summed_fwd, _summed_bwd)


def scatter_many(xs: list, cts: list) -> list:
  """`gather_many`'s transpose: the gradients of the values it returned for ``xs`` ->
  gradients of what the step differentiates (`ShardedParam.differentiated`): stage 2's
  and the sinks' reduced as ``comm`` says, plain stage 3's reduce-scattered over the
  gather axes. A replicated leaf's comes back local, as it is. A plain stage-3 leaf's (and
  a replicated one's) stays in the dtype it was gathered in (`ShardedParam.gather_dtype`),
  for the caller to widen to the block's: a loop over layers keeps its stacked gradient in
  half precision, widened once after it. It is `scatter_outer` of `scatter_inner`."""
  return scatter_outer(xs, scatter_inner(xs, cts))


def has_outer_hop(xs: list) -> bool:
  """Whether reducing the gradients of ``xs`` takes a second hop (hpZ's or a replica
  axis's, across hosts) after the one over the gather axes: `scatter_outer` moves data."""
  return any(kind == _SINK for kind, *_ in _plan(xs))


def scatter_inner(xs: list, cts: list) -> list:
  """The first hop of `scatter_many`: every gradient reduced over its gather axes (a sink's
  stays split over them only, for `scatter_outer`)."""
  out = list(cts)
  for i, x in enumerate(xs):  # replicated leaves that `gather_many` made varying
    axes = _own_sum_axes(x)
    if axes and cts[i] is not None:
      out[i] = psum(cts[i], axes, x.comm)
  for kind, idx, layouts, groups in _plan(xs):
    first, sub = xs[idx[0]], [cts[i] for i in idx]
    if kind == _STAGE2:
      got = [g.astype(xs[i].block.dtype) for i, g in
             zip(idx, reduce_scatter_many(sub, layouts, groups, first.comm))]
    else:  # in the dtype gathered in (`ShardedParam.gather_dtype`)
      blocks = [xs[i].block for i in idx]
      got = scatter_in_loss(sub, _local(blocks, first.comm) if kind == _SINK else blocks,
                            layouts, groups, first.comm,
                            dtypes=[xs[i].gather_dtype for i in idx])
    for i, g in zip(idx, got):
      out[i] = g
  return out


def scatter_outer(xs: list, gs: list, *, over: str = "all") -> list:
  """The second hop of `scatter_many`, on `scatter_inner`'s result: a sink's gradient
  reduced across hosts and replicas (`reduce_outer_many`); the others as they are. A
  separate call, so that a loop can issue it one layer after the first hop. ``over``:
  ``"all"``, or one part of it (``"data"``: the reduce-scatter over the other data axes,
  then ``"replicas"``: the all-reduce over the replica axes), for a loop that issues the
  two a layer apart (`hops`)."""
  out = list(gs)
  for kind, idx, layouts, groups in _plan(xs):
    if kind == _SINK:
      comm = xs[idx[0]].comm
      comm = {"all": comm, "data": dataclasses.replace(comm, replica_axes=()),
              "replicas": dataclasses.replace(comm, outer_axes=())}[over]
      got = reduce_outer_many([gs[i] for i in idx], layouts, groups, comm)
      for i, g in zip(idx, got):
        out[i] = g if over == "data" else g.astype(xs[i].sink.dtype)
  return out


def hops(xs: list) -> list:
  """`scatter_many` of ``xs`` as the collectives a backward loop issues one layer apart
  (each ``hop(xs, gs) -> gs``): all at once; within the host, then across (hpZ or replica
  axes); or within the host, across the data axes, then across the replicas (both)."""
  sinks = [p for kind, idx, _, _ in _plan(xs) if kind == _SINK for p in [xs[idx[0]]]]
  if not sinks:
    return [scatter_many]
  if any(p.comm.outer_axes and p.comm.replica_axes for p in sinks):
    return [scatter_inner, functools.partial(scatter_outer, over="data"),
            functools.partial(scatter_outer, over="replicas")]
  return [scatter_inner, scatter_outer]


def gather(tree: Any) -> Any:
  """Gathers every `ShardedParam` in ``tree``; other leaves pass through unchanged.

  Call it inside ``loss_fn`` on the layer's slice of a ``stacked=`` leaf,
  where the layer uses it. At stages 1-2 and outside the step, ``tree`` holds
  plain arrays and comes back as it is. Put the loop body under
  ``jax.checkpoint`` so that the backward pass gathers each layer again
  instead of keeping every gathered layer alive.

  Example:
    >>> import jax, jax.numpy as jnp, zero_jax as zj
    >>> def loss_fn(params, batch):
    ...   @jax.checkpoint  # the backward pass gathers each layer again
    ...   def layer(h, w):  # w: one layer's slice of params["layers"]
    ...     return jnp.tanh(h @ zj.gather(w)), None
    ...   h, _ = jax.lax.scan(layer, batch["x"], params["layers"])
    ...   return jnp.mean((h - batch["y"]) ** 2)
    >>> params = {"layers": jnp.zeros((4, 3, 3))}  # 4 layers, stacked
    >>> batch = {"x": jnp.ones((2, 3)), "y": jnp.ones((2, 3))}
    >>> float(loss_fn(params, batch))  # plain arrays: gather is the identity
    1.0

    With ``zj.make_sharded_train_step(loss_fn, opt, mesh=mesh, stage=3,
    stacked={"layers": True})`` each device holds 1/N of every layer and
    gathers one layer at a time.

  Args:
    tree: a pytree whose leaves are arrays or `ShardedParam`s, or an
      ``nnx.Module`` (one layer of an ``nnx.scan``-ned block, see
      `zero_jax.layers.nnx`): the module with its parameters gathered and its other
      variables its own, so that what it updates is kept.

  Returns:
    The same tree with every `ShardedParam` replaced by the full logical
    array (of its slice), identical on every device of the axis.
  """
  is_sharded = lambda x: isinstance(x, ShardedParam)
  if nnx_lib.is_module(tree):  # its BatchNorm statistics and Rngs stay its own
    return nnx_lib.gather_module(tree, is_sharded, gather)
  leaves, treedef = jax.tree.flatten(tree, is_leaf=is_sharded)
  idx = [i for i, x in enumerate(leaves) if is_sharded(x)]
  if not idx:
    return tree
  for i, full in zip(idx, gather_many([leaves[i] for i in idx])):
    leaves[i] = full
  return jax.tree.unflatten(treedef, leaves)
