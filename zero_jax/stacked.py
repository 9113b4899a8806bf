"""Gathering stacked layers one at a time inside ``loss_fn`` (stage 3).

At stage 3 the step all-gathers every parameter leaf before calling
``loss_fn``. For a deep model that means the whole model is resident at once,
unless the compiler orders each gather next to its use and gathers again for
the backward pass, which XLA does not promise (XLA:CPU hoists all gathers to
the start of the step and merges the backward re-gathers into the forward ones;
see BENCHMARKS.md, "stages"). A loop does order them: when the per-layer
weights are stacked along a leading dimension and ``loss_fn`` scans over them,
a gather inside the loop body runs once per layer, and a ``jax.checkpoint`` on
the body makes the backward loop gather each layer again instead of keeping
it. Then only a layer or two are whole at any time.

Leaves marked ``stacked=`` in `make_sharded_train_step` are split along a
dimension other than the stacking one and, at stage 3, reach ``loss_fn`` as a
`ShardedParam`: the device's block, not yet gathered. ``loss_fn`` slices it
like the array it stands for (``lax.scan`` over it, or index the first
dimension) and calls `gather` on the slice where the layer uses it. At stages
1-2, and outside the step (a single-device reference), the same leaves are
plain arrays and `gather` returns them unchanged, so one ``loss_fn`` serves
every stage.
"""

from __future__ import annotations

from typing import Any

import jax

from zero_jax import nnx as nnx_lib
from zero_jax.layout import Layout, local_storage_shape, unpad


@jax.tree_util.register_pytree_node_class
class ShardedParam:
  """A stage-3 stacked leaf (or a slice of it) that `gather` has not gathered yet.

  A pytree with one child, the device's block, so ``lax.scan``, ``jax.tree.map``
  and Flax's lifted transforms slice it along its leading (stacking) dimension
  like the array it stands for.

  Attributes:
    block: this device's block: the storage view's block of the whole stacked
      leaf, or of a slice of it along leading dimensions.
    layout: the `Layout` of the whole stacked leaf (static).
    axis_name: the mesh axis it is split over (static).
    path: the leaf's ``keystr`` path, for error messages (static).
  """

  def __init__(self, block, layout: Layout, axis_name: str, path: str):
    self.block = block
    self.layout = layout
    self.axis_name = axis_name
    self.path = path

  def tree_flatten(self):
    return (self.block,), (self.layout, self.axis_name, self.path)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  @property
  def shape(self) -> tuple[int, ...]:
    """Logical shape of what `gather` returns (the slice's, when sliced)."""
    drop = len(self.layout.shape) - len(getattr(self.block, "shape", self.layout.shape))
    return self.layout.shape[drop:]

  def __jax_array__(self):
    raise TypeError(
        f"params{self.path} is a stacked leaf sharded at stage 3 and was used as an array "
        f"without zero_jax.gather. Call zj.gather(...) on it where it is used, ideally on "
        f"one layer's slice inside the loop over layers (e.g. in the lax.scan body), or do "
        f"not mark it stacked=.")

  def __getitem__(self, index):
    return ShardedParam(self.block[index], self.layout, self.axis_name, self.path)

  def __repr__(self):
    return f"ShardedParam(params{self.path}, shape={self.shape}, layout={self.layout})"


def _gather_one(x: ShardedParam) -> jax.Array:
  layout = x.layout
  drop = len(layout.shape) - x.block.ndim  # leading dimensions indexed away
  local = local_storage_shape(layout, jax.lax.axis_size(x.axis_name))
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
  if layout.dim is None:
    return x.block
  sliced = Layout(shape, layout.dim - drop, layout.padded)
  full = jax.lax.all_gather(x.block, x.axis_name, axis=sliced.dim, tiled=True, to="varying")
  return unpad(full, sliced)


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
      `zero_jax.nnx`): the module with its parameters gathered and its other
      variables its own, so that what it updates is kept.

  Returns:
    The same tree with every `ShardedParam` replaced by the full logical
    array (of its slice), identical on every device of the axis.
  """
  is_sharded = lambda x: isinstance(x, ShardedParam)
  if nnx_lib.is_module(tree):  # its BatchNorm statistics and Rngs stay its own
    return nnx_lib.gather_module(tree, is_sharded, gather)
  return jax.tree.map(lambda x: _gather_one(x) if is_sharded(x) else x, tree, is_leaf=is_sharded)
