"""Collectives over the data and replica axes for leaves in their `Layout`.

They run inside ``shard_map`` and receive the step's communication record,
`Comm`, whole: which axes a parameter is gathered over, which further axes
its gradient is reduced over, the dtype and buckets on the wire, and whether
weights and gradients travel as block-quantized integers (ZeRO++: see
`zero_jax.comm.quantize`). A new wire format is a change to this module and to
`Comm` only. Buckets (small leaves moved as one buffer, one row per device)
and the hops of a reduction are explained in the docs ("How it works").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zero_jax.comm import quantize
from zero_jax.comm.axes import as_tuple as _axes, axes_size
from zero_jax.comm.layout import Layout, pad, unpad

DEFAULT_BUCKET_BYTES = 4 * 2**20


class Quantize(NamedTuple):
  """ZeRO++ quantized communication (``quantize=`` of `make_sharded_train_step`).

  Values travel as signed integers with one float32 scale per block of
  ``block_size`` elements (symmetric, absolute maximum); they are
  dequantized and summed in float32 on arrival. The master copy, the
  optimizer state and the update stay exact.

  Example:
    >>> import zero_jax as zj
    >>> zj.Quantize(weights=True, grads=True, block_size=256)
    Quantize(weights=True, grads=True, block_size=256, grad_bits=8, across_only=False)

  Attributes:
    weights: qwZ: parameter all-gathers carry int8 (stage 3's gathers in the
      loss and hpZ's refresh; the parameter rebuild at stages 1-2).
    grads: qgZ: gradient reduce-scatters are all-to-alls of ``grad_bits``
      integers, one hop per group of axes, summed in float32.
    block_size: elements per scale (a positive multiple of 2).
    grad_bits: 8 or 4 (4: two values per byte).
    across_only: quantize only the hops across hosts (the replica axes and
      the data axes outside ``hpz_axis=``); hops within a host stay exact.
  """
  weights: bool = True
  grads: bool = True
  block_size: int = 256
  grad_bits: int = 8
  across_only: bool = False


class Wire(NamedTuple):
  """How one hop carries its values: integer width and block size (static)."""
  bits: int
  block_size: int


@dataclasses.dataclass(frozen=True)
class Comm:
  """How the step's collectives move data (static, hashable).

  Attributes:
    gather_axes: a parameter (block) is all-gathered over these, and its
      gradient reduce-scattered over them first (the data axes, or with hpZ
      the axes within a host).
    outer_axes: the other data axes (hpZ): the gradient's second
      reduce-scatter hop and the refresh of the secondary copy.
    replica_axes: the reduced block is all-reduced over these (hybrid).
    reduce_dtype: the gradient's dtype on the wire (``comm_dtype=``), or None.
    bucket_bytes: leaves below this many bytes move together (0: never).
    quantize: the `Quantize` record, or None (exact).
    forward_only: the loss's gathers are not differentiated (``step.evaluate``,
      ``step.apply``): `gather_in_loss` returns device-invariant values, like a
      replicated input's, which code mixes with replicated values freely (a loop carry).
    bf16_sums_in_f32: sum bfloat16 in float32 and round back (`psum`, `psum_scatter`).
      XLA:CPU aborts compiling a bfloat16 sum inside a ``shard_map`` that leaves axes to
      the compiler (the model axes of ``param_specs=``: "Invalid binary instruction opcode
      copy"); it sums bfloat16 in float32 anyway, so the result is the same, bit for bit.
      Set for CPU meshes with model axes only (XLA:GPU sums bfloat16 on the wire).
    pack: how an exact group of several leaves travels: joined into one buffer, one
      collective (True: small leaves' buckets, one collective on any backend), or with
      its leaves split along their first dimension (already the contiguous rows NCCL
      moves) in collectives of their own and the others joined, which XLA's combiners join
      into one variadic collective where the compile options let them (False:
      `zero_jax.scan`'s layers, whose joined buffer cost a copy of every weight into and
      out of it). The other leaves stay joined: gathered alone, XLA:GPU lays their whole
      stacked leaf out transposed to suit NCCL (measured: more memory and bytes). Quantized
      wires are always packed (their int8 bytes are one buffer).
  """
  gather_axes: tuple[str, ...]
  outer_axes: tuple[str, ...] = ()
  replica_axes: tuple[str, ...] = ()
  reduce_dtype: Any = None
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  quantize: Quantize | None = None
  forward_only: bool = False
  bf16_sums_in_f32: bool = False
  pack: bool = True

  @classmethod
  def over(cls, data_axes, **kwargs) -> "Comm":
    """The record of a plain ZeRO step over ``data_axes`` (a name or a tuple)."""
    return cls(gather_axes=_axes(data_axes), **kwargs)

  @property
  def data_axes(self) -> tuple[str, ...]:
    """Every axis the ZeRO state is split over, gather axes first."""
    return self.gather_axes + self.outer_axes

  def wire(self, kind: str, across: bool) -> Wire | None:
    """The integer format of a ``kind`` ("weights" or "grads") hop, or None (exact)."""
    q = self.quantize
    if q is None or not getattr(q, kind) or (q.across_only and not across):
      return None
    return Wire(8 if kind == "weights" else q.grad_bits, q.block_size)

  def reduce_hops(self) -> list[tuple[tuple[str, ...], Wire | None]]:
    """The reduce-scatter hops of a gradient: within the gather axes, then across."""
    hops = [(self.gather_axes, self.wire("grads", False))]
    if self.outer_axes:
      hops.append((self.outer_axes, self.wire("grads", True)))
    return hops

  def per_leaf(self, hops) -> bool:
    """Whether a group's reduction over ``hops`` (and the replica axes) may move leaves in
    collectives of their own: unpacked (``pack=False``) and exact at every hop."""
    return (not self.pack and all(w is None for _, w in hops)
            and (not self.replica_axes or self.wire("grads", True) is None))


def _wide(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def _summed_in_f32(collective, x, comm: Comm, *args, **kwargs):
  if comm.bf16_sums_in_f32 and x.dtype == jnp.bfloat16:
    return collective(x.astype(jnp.float32), *args, **kwargs).astype(x.dtype)
  return collective(x, *args, **kwargs)


def psum(x: jax.Array, axes, comm: Comm) -> jax.Array:
  """``lax.psum(x, axes)``, summed in float32 where ``comm.bf16_sums_in_f32`` says."""
  return _summed_in_f32(jax.lax.psum, x, comm, _axes(axes))


def psum_scatter(x: jax.Array, axes, comm: Comm, **kwargs) -> jax.Array:
  """``lax.psum_scatter(x, axes, **kwargs)``, in float32 where ``comm.bf16_sums_in_f32``
  says."""
  return _summed_in_f32(jax.lax.psum_scatter, x, comm, _axes(axes), **kwargs)


# ------------------------------------------------------------ one hop, pieces
# A bucket's leaves travel as a list of pieces, one array per leaf, each with the rows of
# the devices (``(n, L_i)``) or one device's row (``(L_i,)``). An exact collective moves
# them as one concatenated buffer; a quantized one quantizes each where it lies and
# concatenates only the int8 wire (`zero_jax.comm.quantize`).
_joined, _split = quantize.join_pieces, quantize.split_pieces


def _lengths(pieces) -> list:
  return [p.shape[-1] for p in pieces]


def scatter_pieces(pieces, axes, wire: Wire | None, comm: Comm) -> list:
  """``(n, L_i)`` pieces -> this device's ``(L_i,)`` pieces summed over ``axes`` (n = their
  size), in one collective."""
  if wire is None:
    out = psum_scatter(_joined(pieces), axes, comm, scatter_dimension=0, tiled=True)
    return _split(out[0], _lengths(pieces))
  out = quantize.scatter_pieces(pieces, (_axes(axes),), block_size=wire.block_size,
                                bits=wire.bits)
  return [o.astype(_wide(p.dtype)) for o, p in zip(out, pieces)]


def gather_pieces(pieces, axes, wire: Wire | None, *, to: str) -> list:
  """This device's ``(L_i,)`` pieces -> ``(n, L_i)``, every device's, in one collective
  (int8 on the wire if ``wire``)."""
  if wire is None:
    out = jax.lax.all_gather(_joined(pieces), _axes(axes), axis=0, tiled=False, to=to)
    return _split(out, _lengths(pieces))
  out = quantize.gather_pieces(pieces, _axes(axes), block_size=wire.block_size,
                               bits=wire.bits, to=to)
  return [o.astype(p.dtype) for o, p in zip(out, pieces)]


def reduce_pieces(pieces, comm: Comm, hops=None) -> list:
  """``(n, L_i)`` pieces over the data axes -> this device's summed ``(L_i / n,)`` pieces,
  then all-reduced over the replica axes. Each hop carries 1/its size of the previous one."""
  hops = comm.reduce_hops() if hops is None else hops
  out = [p.reshape(-1) for p in pieces]
  for axes, wire in hops:
    n = axes_size(axes)
    if n > 1:
      out = scatter_pieces([o.reshape(n, -1) for o in out], axes, wire, comm)
  wire = comm.wire("grads", True)
  if not comm.replica_axes:
    return out
  if wire is None:
    return _split(psum(_joined(out), comm.replica_axes, comm), _lengths(out))
  summed = quantize.psum_pieces(out, comm.replica_axes, block_size=wire.block_size,
                                bits=wire.bits)
  return [s.astype(_wide(o.dtype)) for s, o in zip(summed, out)]


def _rows(x: jax.Array, layout: Layout, n: int) -> jax.Array:
  """Padded storage view -> ``(n, block size)``: row ``d`` is device ``d``'s block."""
  return jnp.moveaxis(pad(x, layout), layout.dim, 0).reshape(n, -1)


def _block(row: jax.Array, like: jax.Array, layout: Layout, n: int) -> jax.Array:
  """One device's row -> its storage block (split dimension back in place), for a leaf
  whose (logical, possibly model-local) value is shaped like ``like``."""
  shape = [s + (layout.pad_amount if d == layout.dim else 0) for d, s in enumerate(like.shape)]
  moved = [shape[layout.dim] // n] + [s for d, s in enumerate(shape) if d != layout.dim]
  return jnp.moveaxis(row.reshape(moved), 0, layout.dim)


def _alone(g, layouts, per_leaf: bool) -> tuple[list, list]:
  """A group's leaves that travel alone (with ``per_leaf``: those split along their first
  dimension, already contiguous rows) and those joined into one buffer (the rest)."""
  alone = [i for i in g if per_leaf and layouts[i].dim == 0]
  return alone, [i for i in g if i not in alone]


def _reduce_alone(x: jax.Array, layout: Layout, comm: Comm, hops) -> jax.Array:
  """`reduce_pieces` of one leaf split along its first dimension, in its own collectives:
  per hop a ``psum_scatter`` of the padded leaf's contiguous rows (the same blocks and sums
  as the joined form), then the all-reduce over the replica axes."""
  out = pad(x, layout)
  for axes, _ in hops:
    if axes_size(axes) > 1:
      out = jax.lax.psum_scatter(out, _axes(axes), scatter_dimension=0, tiled=True)
  return jax.lax.psum(out, comm.replica_axes) if comm.replica_axes else out


def _reduce_buckets(xs, layouts, groups, comm: Comm, hops, n: int) -> list:
  """Each group of ``xs`` through `reduce_pieces` (one collective per hop), back to blocks;
  where ``comm`` says (`Comm.per_leaf`), its leaves split along their first dimension each
  in collectives of their own."""
  hops = comm.reduce_hops() if hops is None else hops
  out = [None] * len(xs)
  for g in groups:
    alone, g = _alone(g, layouts, comm.per_leaf(hops))
    for i in alone:
      out[i] = _reduce_alone(xs[i], layouts[i], comm, hops)
    if not g:
      continue
    mine = reduce_pieces([_rows(xs[i], layouts[i], n) for i in g], comm, hops)
    for i, piece in zip(g, mine):
      out[i] = _block(piece, xs[i], layouts[i], n)
  return out


# ------------------------------------------------------------ gradients
def reduce_scatter(x: jax.Array, layout: Layout, comm: Comm, *, out_dtype=None) -> jax.Array:
  """Sum of ``x`` over the data and replica axes, each device keeping its block.

  The leaf is cast to ``comm.reduce_dtype`` for the wire, reduced over the
  hops of ``comm`` and cast to ``out_dtype`` (default: ``x``'s dtype promoted
  to at least float32). A layout replicated over the data axes (``dim=None``)
  is all-reduced.
  """
  out_dtype = out_dtype or _wide(x.dtype)
  wire = x.astype(comm.reduce_dtype or x.dtype)
  if layout.dim is None:
    return psum(wire, comm.data_axes + comm.replica_axes, comm).astype(out_dtype)
  n = axes_size(comm.data_axes)
  if n > 1 and comm.quantize is None:  # one collective, as XLA likes it
    out = psum_scatter(pad(wire, layout), comm.data_axes, comm,
                       scatter_dimension=layout.dim, tiled=True)
    if comm.replica_axes:
      out = psum(out, comm.replica_axes, comm)
    return out.astype(out_dtype)
  return _block(reduce_pieces([_rows(wire, layout, n)], comm)[0], x, layout, n).astype(out_dtype)


def all_reduce(x: jax.Array, axes, comm: Comm, *, out_dtype=None) -> jax.Array:
  """Sum of ``x`` over ``axes`` (stage 1), in ``comm.reduce_dtype`` on the wire."""
  out_dtype = out_dtype or _wide(x.dtype)
  return psum(x.astype(comm.reduce_dtype or x.dtype), axes, comm).astype(out_dtype)


def reduce_scatter_many(xs, layouts, groups, comm: Comm) -> list:
  """`reduce_scatter` of every leaf of ``xs``, one collective per group of ``groups``."""
  n = axes_size(comm.data_axes)
  many = [g for g in groups if len(g) > 1 and n > 1]
  wire = [x.astype(comm.reduce_dtype or x.dtype) for x in xs]
  out = _reduce_buckets(wire, layouts, many, comm, None, n)
  for g in groups:
    for i in g:
      out[i] = reduce_scatter(xs[i], layouts[i], comm) if out[i] is None else \
          out[i].astype(_wide(xs[i].dtype))
  return out


def reduce_outer_many(gs, layouts, groups, comm: Comm) -> list:
  """Gradient blocks already reduced over the gather axes -> this device's blocks of the
  data axes, all-reduced over the replica axes: stage 3's hops across hosts (hpZ's outer
  reduce-scatter, hybrid's all-reduce), one collective per group of ``groups``."""
  n = axes_size(comm.outer_axes) if comm.outer_axes else 1
  hops = [(comm.outer_axes, comm.wire("grads", True))] if comm.outer_axes else []
  subs = [l if l.dim is None else Layout(g.shape, l.dim, g.shape[l.dim])
          for g, l in zip(gs, layouts)]
  out = _reduce_buckets(gs, subs, [g for g in groups if subs[g[0]].dim is not None], comm,
                        hops, n)
  for i, l in enumerate(subs):
    if l.dim is None:
      out[i] = psum(gs[i], comm.outer_axes + comm.replica_axes, comm)
  return out


# ------------------------------------------------------------ parameters
def all_gather(block: jax.Array, layout: Layout, comm: Comm, *, axes=None,
               to: str = "invarying", whole: bool = True) -> jax.Array:
  """Rebuilds a leaf from each device's storage block over ``axes`` (default
  ``comm.gather_axes``), unpadded to its logical shape when ``whole``.

  ``to="invarying"`` gives a value every device agrees on (returnable with
  ``P()``); ``to="varying"`` is what a differentiated gather inside the loss
  needs, so that its transpose is a reduce-scatter of local gradients.
  """
  return all_gather_many([block], [layout], ((0,),), comm, axes=axes, to=to, whole=whole)[0]


def _gather_one(block, layout: Layout, axes, *, to: str, whole: bool):
  if layout.dim is None:
    return block
  if to == "varying" and axes_size(axes) == 1:
    return unpad(block, layout) if whole else block
  full = jax.lax.all_gather(block, axes, axis=layout.dim, tiled=True, to=to)
  return unpad(full, layout) if whole else full


def _from_rows(rows, block_shape, layout: Layout, whole: bool):
  """``(n, L)`` gathered rows of one leaf -> the leaf (split dimension in place)."""
  rest = [s for d, s in enumerate(block_shape) if d != layout.dim]
  full = jnp.moveaxis(rows.reshape([-1] + rest), 0, layout.dim)
  return unpad(full, layout) if whole else full


def in_gather_dtype(blocks, dtypes=None) -> list:
  """``blocks`` in the dtype they are gathered in: each cast to its entry of ``dtypes`` (None
  there, or no ``dtypes``: as it is). A float32 master block gathered in bfloat16 is cast
  here, just before its collective, as FSDP2 casts the shard: the wire carries the half
  dtype, and the cast is only ever of what this gather moves (a layer's slice inside a
  loop), never of a whole stacked leaf. Differentiated, the cast's transpose widens the
  reduced half-precision gradient back to the block's dtype, exactly."""
  if dtypes is None:
    return list(blocks)
  return [b if d is None else b.astype(d) for b, d in zip(blocks, dtypes)]


def all_gather_many(blocks, layouts, groups, comm: Comm, *, axes=None, to: str = "invarying",
                    whole: bool = True, dtypes=None) -> list:
  """`all_gather` of every block of ``blocks``, one collective per group of ``groups``.

  With quantized weights (`Comm.wire`) the blocks travel as int8
  (`zero_jax.comm.quantize`), every device's own block included, so that all
  devices see the same values. ``dtypes``: per block, the dtype to gather it in
  (`in_gather_dtype`), or None. In exact groups of an unpacked ``comm``
  (`Comm.pack`) the leaves split along their first dimension travel alone, one
  ``all_gather`` each.
  """
  blocks = in_gather_dtype(blocks, dtypes)
  axes = comm.gather_axes if axes is None else _axes(axes)
  wire = comm.wire("weights", bool(set(axes) - set(comm.gather_axes)))
  out = [None] * len(blocks)
  n = axes_size(axes)
  for g in groups:
    w = wire if jnp.issubdtype(blocks[g[0]].dtype, jnp.floating) else None  # ints: exact
    alone, g = _alone(g, layouts, w is None and not comm.pack)
    for i in alone:
      out[i] = _gather_one(blocks[i], layouts[i], axes, to=to, whole=whole)
    if not g:
      continue
    if w is None and (len(g) == 1 or n == 1) or layouts[g[0]].dim is None:
      for i in g:
        out[i] = _gather_one(blocks[i], layouts[i], axes, to=to, whole=whole)
      continue
    rows = [jnp.moveaxis(blocks[i], layouts[i].dim, 0).reshape(-1) for i in g]
    for i, piece in zip(g, gather_pieces(rows, axes, w, to=to)):
      out[i] = _from_rows(piece, blocks[i].shape, layouts[i], whole)
  return out


def _transposed_by_jax(comm: Comm, blocks) -> bool:
  """Whether JAX's transpose of the exact gather (a reduce-scatter in the blocks' dtypes) is
  the gradient: not when quantized, nor when it would sum bfloat16 where XLA:CPU cannot
  (`Comm.bf16_sums_in_f32`); then `_gather_own_transpose`'s backward reduces."""
  exact = comm.wire("weights", False) is None and comm.wire("grads", False) is None
  return exact and not (comm.bf16_sums_in_f32 and
                        any(b.dtype == jnp.bfloat16 for b in blocks))


def gather_in_loss(blocks, layouts, groups, comm: Comm, *, dtypes=None) -> list:
  """Stage 3's differentiated gather over the gather axes: its transpose reduce-scatters
  the local gradients over them (quantized as ``comm`` says, in a ``custom_vjp``); with
  ``comm.forward_only`` a gather to device-invariant values, with no transpose. ``dtypes``:
  per block, the dtype to gather it in (`in_gather_dtype`), or None."""
  blocks = in_gather_dtype(blocks, dtypes)
  if comm.forward_only:
    return all_gather_many(blocks, layouts, groups, comm, to="invarying")
  if _transposed_by_jax(comm, blocks):
    return all_gather_many(blocks, layouts, groups, comm, to="varying")
  return _gather_own_transpose(tuple(blocks), tuple(layouts), tuple(groups), comm)


def scatter_in_loss(cts, blocks, layouts, groups, comm: Comm, *, dtypes=None) -> list:
  """The transpose of `gather_in_loss`: gradients of the gathered leaves -> gradients of
  ``blocks``, reduce-scattered over the gather axes (quantized as ``comm`` says), for a
  caller that runs the backward pass itself (`zero_jax.scan`). They stay in the dtype the
  blocks were gathered in (``dtypes``, as for `gather_in_loss`): the caller widens them
  where the reduction ends."""
  blocks = in_gather_dtype(blocks, dtypes)
  if _transposed_by_jax(comm, blocks):
    gather = lambda bs: all_gather_many(bs, layouts, groups, comm, to="varying")
    return list(jax.linear_transpose(gather, list(blocks))(list(cts))[0])
  return list(_own_transpose_bwd(tuple(layouts), tuple(groups), comm, None, tuple(cts))[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_own_transpose(blocks, layouts, groups, comm):
  return all_gather_many(list(blocks), layouts, groups, comm, to="varying")


def _own_transpose_fwd(blocks, layouts, groups, comm):
  return _gather_own_transpose(blocks, layouts, groups, comm), None


def _own_transpose_bwd(layouts, groups, comm, _, cts):
  n = axes_size(comm.gather_axes)
  hop = [(comm.gather_axes, comm.wire("grads", False))]
  out = [None] * len(cts)
  for g in groups:
    idx = [i for i in g if layouts[i].dim is not None]
    for i in g:
      if layouts[i].dim is None:
        out[i] = cts[i]
    if not idx:
      continue
    mine = reduce_pieces([_rows(cts[i], layouts[i], n) for i in idx],
                         Comm(comm.gather_axes, bf16_sums_in_f32=comm.bf16_sums_in_f32), hop)
    for i, piece in zip(idx, mine):
      out[i] = _block(piece, cts[i], layouts[i], n).astype(cts[i].dtype)
  return (tuple(out),)


_gather_own_transpose.defvjp(_own_transpose_fwd, _own_transpose_bwd)


# -------------------------------------------------------------------- buckets
def plan_buckets(layouts, dtypes, *, bucket_bytes: int, alone=None) -> tuple[tuple[int, ...], ...]:
  """Groups of leaf indices that move together (static; in leaf order).

  A leaf split over the data axes only, whose padded storage is smaller than
  ``bucket_bytes``, joins the open bucket of its dtype until that would pass
  ``bucket_bytes``; every other leaf (large, replicated, split over model
  axes, or marked in ``alone``: stacked layers) is a group of its own.
  ``bucket_bytes=0`` puts every leaf alone.
  """
  groups, open_ = [], {}
  alone = alone or [False] * len(layouts)
  for i, (l, dt) in enumerate(zip(layouts, dtypes)):
    size = math.prod(l.storage_shape) * jnp.dtype(dt).itemsize
    if l.dim is None or l.has_model or size >= bucket_bytes or alone[i]:
      groups.append([i])
      continue
    key = jnp.dtype(dt)
    g = open_.get(key)
    if g is None or g[1] + size > bucket_bytes:
      g = open_[key] = [[i], size]
      groups.append(g[0])
    else:
      g[0].append(i)
      g[1] += size
  return tuple(tuple(g) for g in groups)
