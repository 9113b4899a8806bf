"""Per-layer parameter trees to stacked ones and back, and Flax boxes in the step.

At stage 3, ``stacked=`` leaves are gathered one layer at a time inside a
loop over layers (`zero_jax.layers.stacked`), which needs the per-layer weights
stacked along a leading dimension, as ``nn.scan`` and ``lax.scan`` keep them.
Models written with a Python loop over blocks (Linen names them
``layers_0``, ``layers_1``, ...) and their checkpoints hold one subtree per
layer instead. `stack_layers` converts such trees (or a list of per-layer
trees) to the stacked form and `unstack_layers` converts back, so trained
weights move between the two models.

Linen parameters made with ``nn.with_partitioning`` or
``nn.with_logical_partitioning`` are boxed (``nn.Partitioned``): the box is a
pytree node holding the array and the names of its axes. Both helpers keep
the boxes and add or remove the name of the layer axis, as ``nn.scan`` does
with ``metadata_params={nn.PARTITION_NAME: ...}``. `check_boxes` is the
step's check that Flax can apply a box's sharding constraint inside the step.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict
from flax.core import meta as flax_meta


def _is_box(x) -> bool:
  return isinstance(x, flax_meta.AxisMetadata)


def _value(x):
  """The array in a box (no sharding constraint applied), or the leaf itself."""
  if isinstance(x, flax_meta.Partitioned):
    return x.unbox(apply_constraint=False)
  return x.unbox() if _is_box(x) else x


def _describe(x) -> str:
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  if shape is None or dtype is None:
    return type(x).__name__
  return f"{jnp.dtype(dtype).name}{list(shape)}"


def _stack_arrays(xs):
  if all(isinstance(x, jax.ShapeDtypeStruct) for x in xs):
    return jax.ShapeDtypeStruct((len(xs),) + tuple(xs[0].shape), xs[0].dtype)
  if all(isinstance(x, (np.ndarray, np.generic)) for x in xs):
    return np.stack(xs)
  return jnp.stack(xs)


def _without_layer_axis(box):
  """A stacked box's metadata for one layer (``remove_axis`` of the name it gave axis 0)."""
  name = box.names[0] if isinstance(box, flax_meta.Partitioned) and box.names else None
  return box.remove_axis(0, {flax_meta.PARTITION_NAME: name})


def _stack_trees(trees: Sequence[Any], partition_name, root) -> Any:
  """Per-layer trees -> one tree, every leaf (or box) stacked along a new first axis.

  ``root(i)`` names layer ``i`` in messages (``"layers[2]"``, ``"params['layers_2']"``).
  """
  if not trees:
    raise ValueError("stack_layers got no layers; pass at least one per-layer tree.")
  flat0, treedef = jax.tree_util.tree_flatten_with_path(trees[0], is_leaf=_is_box)
  columns = [[x] for _, x in flat0]
  for i, tree in enumerate(trees[1:], 1):
    flat, other = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)
    if other != treedef:
      raise ValueError(
          f"stack_layers: {root(i)} has another tree structure than {root(0)}: {other} "
          f"against {treedef}. Every layer must have the same parameters (and the same box "
          f"metadata); stack only the layers that repeat.")
    for (path, x), column in zip(flat, columns):
      a, b = _value(x), _value(column[0])
      if np.shape(a) != np.shape(b) or jnp.result_type(a) != jnp.result_type(b):
        where = jax.tree_util.keystr(path)
        raise ValueError(
            f"stack_layers: {root(i)}{where} is {_describe(a)}, {root(0)}{where} is "
            f"{_describe(b)}; stacked layers must have equal shapes and dtypes. Stack only "
            f"the layers that repeat, or cast them first.")
      column.append(x)
  out = []
  for column in columns:
    stacked = _stack_arrays([_value(x) for x in column])
    first = column[0]
    if _is_box(first):
      stacked = first.replace_boxed(stacked).add_axis(
          0, {flax_meta.PARTITION_NAME: partition_name})
    out.append(stacked)
  return jax.tree.unflatten(treedef, out)


def _unstack_tree(tree: Any, root: str) -> list:
  """A stacked tree -> one tree per index of the first axis of its leaves."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)
  if not flat:
    raise ValueError(f"unstack_layers: {root} has no leaves.")
  values = [_value(x) for _, x in flat]
  n = np.shape(values[0])[0] if np.ndim(values[0]) else None
  for (path, _), v in zip(flat, values):
    if n is None or not np.ndim(v) or np.shape(v)[0] != n:
      raise ValueError(
          f"unstack_layers: {root}{jax.tree_util.keystr(path)} is {_describe(v)} and "
          f"{root}{jax.tree_util.keystr(flat[0][0])} is {_describe(values[0])}: every leaf of "
          f"a stack has the layer dimension first, of one length. Unstack only the stacked "
          f"subtree.")
  layers = []
  for i in range(n):
    leaves = []
    for (_, x), v in zip(flat, values):
      one = (jax.ShapeDtypeStruct(v.shape[1:], v.dtype) if isinstance(v, jax.ShapeDtypeStruct)
             else v[i])
      if _is_box(x):
        one = _without_layer_axis(x).replace_boxed(one)
      leaves.append(one)
    layers.append(jax.tree.unflatten(treedef, leaves))
  return layers


def _rebuild(template: Mapping, items: dict) -> Mapping:
  return FrozenDict(items) if isinstance(template, FrozenDict) else items


def _keystr(path) -> str:
  return jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in path))


def _layer_keys(d: Mapping, prefix: str) -> dict[int, str]:
  pattern = re.compile(re.escape(prefix) + r"(\d+)")
  return {int(m.group(1)): k for k in d if isinstance(k, str) and (m := pattern.fullmatch(k))}


def _replace_layer_keys(tree, prefix: str, name: str, partition_name, path=()) -> tuple:
  """(tree with each run of ``prefix<i>`` keys replaced by ``name``, how many runs)."""
  if not isinstance(tree, Mapping):
    return tree, 0
  keys = _layer_keys(tree, prefix)
  count, items = 0, {}
  for k, v in tree.items():
    if k not in keys.values():
      items[k], c = _replace_layer_keys(v, prefix, name, partition_name, path + (k,))
      count += c
  if not keys:
    return _rebuild(tree, items), count
  where = f"params{_keystr(path)}"
  missing = sorted(set(range(max(keys) + 1)) - set(keys))
  if missing:
    raise ValueError(
        f"stack_layers: {where} has the keys {[keys[i] for i in sorted(keys)]} but no "
        f"{prefix}{missing[0]}; the layers to stack must be numbered 0, 1, ... without gaps.")
  if name in tree:
    raise ValueError(f"stack_layers: {where} already has a key {name!r}; pass another name= "
                     f"for the stacked layers.")
  items[name] = _stack_trees([tree[keys[i]] for i in range(len(keys))], partition_name,
                             lambda i: f"{where}[{keys[i]!r}]")
  return _rebuild(tree, items), count + 1


def _restore_layer_keys(tree, name: str, prefix: str, path=()) -> tuple:
  """(tree with each ``name`` key replaced by ``prefix<i>`` keys, how many)."""
  if not isinstance(tree, Mapping):
    return tree, 0
  count, items = 0, {}
  for k, v in tree.items():
    if k != name:
      items[k], c = _restore_layer_keys(v, name, prefix, path + (k,))
      count += c
      continue
    for i, layer in enumerate(_unstack_tree(v, f"params{_keystr(path + (k,))}")):
      if f"{prefix}{i}" in tree:
        raise ValueError(f"unstack_layers: params{_keystr(path)} already has a key "
                         f"{prefix}{i!s}; pass another prefix=.")
      items[f"{prefix}{i}"] = layer
    count += 1
  return _rebuild(tree, items), count


def stack_layers(layers: Any, prefix: str | None = None, *, name: str | None = None,
                 partition_name: str | None = None) -> Any:
  """Per-layer parameter trees -> one tree whose leaves have the layer dimension first.

  Two forms:

  * ``stack_layers([layer_0, layer_1, ...])``: a sequence of trees with equal
    structure, shapes and dtypes -> one tree of that structure, each leaf
    stacked along a new leading dimension.
  * ``stack_layers(params, "layers_", name="layers")``: in every dict of
    ``params`` holding the keys ``layers_0`` ... ``layers_{L-1}`` (Linen's
    names for a loop over a submodule), those keys are replaced by one key
    ``name`` (default: the prefix without its trailing ``_``) holding their
    stack. The result is the parameter tree of the same model written with
    ``nn.scan(..., variable_axes={"params": 0})`` named ``name``.

  Boxed leaves (``nn.Partitioned``, ``nn.LogicallyPartitioned``) stay boxed,
  the layer axis named ``partition_name`` (``None``: not split over any mesh
  axis), as ``nn.scan`` with ``metadata_params={nn.PARTITION_NAME:
  partition_name}`` names it. numpy leaves stay numpy (nothing goes to a
  device) and ``jax.ShapeDtypeStruct`` leaves give shape structs.

  Example:
    >>> import numpy as np, zero_jax as zj
    >>> old = {"embed": np.zeros((5, 4)), "layers_0": {"w": np.ones((4, 4))},
    ...        "layers_1": {"w": np.full((4, 4), 2.0)}}
    >>> new = zj.stack_layers(old, "layers_")
    >>> sorted(new), new["layers"]["w"].shape
    (['embed', 'layers'], (2, 4, 4))
    >>> zj.unstack_layers(new, "layers")["layers_1"]["w"][0, 0]
    np.float64(2.0)

  Args:
    layers: a sequence of per-layer trees, or (with ``prefix``) a params tree.
    prefix: the keys' prefix, followed by the layer number (``"layers_"``;
      lm1b's decoder: ``"encoderdecoderblock_"``).
    name: the key of the stacked layers (with ``prefix``).
    partition_name: the name boxes give the new layer axis.

  Returns:
    The stacked tree (first form) or ``params`` with the layers stacked.

  Raises:
    ValueError: layers that differ (naming the leaf), a gap in the numbering,
      a key ``name`` already present, or no ``prefix`` key anywhere.
  """
  if prefix is None:
    if name is not None or isinstance(layers, Mapping) or not isinstance(layers, Sequence):
      raise TypeError(
          f"stack_layers(layers) takes a list of per-layer trees; for a params tree with keys "
          f"like 'layers_0', 'layers_1', pass the prefix: stack_layers(params, 'layers_'). "
          f"Got {type(layers).__name__}{' and name=' + repr(name) if name else ''}.")
    return _stack_trees(list(layers), partition_name, lambda i: f"layers[{i}]")
  if not isinstance(layers, Mapping):
    raise TypeError(f"stack_layers(params, prefix={prefix!r}) takes a params dict; got "
                    f"{type(layers).__name__}. For a list of per-layer trees drop the prefix.")
  name = name if name is not None else prefix.rstrip("_")
  if not name:
    raise ValueError(f"stack_layers: prefix={prefix!r} leaves no name for the stack; pass name=.")
  out, count = _replace_layer_keys(layers, prefix, name, partition_name)
  if not count:
    raise ValueError(f"stack_layers: no dict in params has a key {prefix}0 (prefix={prefix!r}); "
                     f"its top-level keys are {sorted(map(str, layers))}.")
  return out


def unstack_layers(tree: Any, name: str | None = None, *, prefix: str | None = None) -> Any:
  """The inverse of `stack_layers`: stacked leaves -> one tree per layer.

  * ``unstack_layers(stacked)``: a tree whose leaves have the layer dimension
    first -> a list of per-layer trees.
  * ``unstack_layers(params, "layers", prefix="layers_")``: every key
    ``name`` in the dicts of ``params`` is replaced by the keys
    ``layers_0`` ... ``layers_{L-1}`` (prefix default: ``name + "_"``).

  Boxes lose the name of their first (layer) axis. Use it to export a model
  trained with ``stacked=`` (``step.get_params(state)``) to the per-layer
  model or checkpoint it came from.

  Args:
    tree: the stacked tree, or (with ``name``) a params tree.
    name: the key of the stacked layers.
    prefix: the per-layer keys' prefix (with ``name``).

  Returns:
    A list of per-layer trees (first form) or ``params`` with the layers
    unstacked.
  """
  if name is None:
    if prefix is not None:
      raise TypeError("unstack_layers: prefix= goes with name=, the key of the stacked layers: "
                      "unstack_layers(params, 'layers', prefix='layers_').")
    return _unstack_tree(tree, "stacked")
  if not isinstance(tree, Mapping):
    raise TypeError(f"unstack_layers(params, {name!r}) takes a params dict; got "
                    f"{type(tree).__name__}. For a stacked subtree drop the name.")
  out, count = _restore_layer_keys(tree, name, prefix if prefix is not None else name + "_")
  if not count:
    raise ValueError(f"unstack_layers: no dict in params has a key {name!r}; its top-level "
                     f"keys are {sorted(map(str, tree))}.")
  return out


def _axis_names(names) -> list[str]:
  out = []
  for n in names:
    out += [n] if isinstance(n, str) else [a for a in (n or ()) if isinstance(a, str)]
  return out


def check_boxes(spec, params) -> None:
  """Raises ValueError for an ``nn.Partitioned`` box Flax cannot apply inside the step.

  When a Linen model reads a boxed parameter, Flax applies the box's names as
  a sharding constraint whenever a mesh is in context, and inside the step
  one always is: there the step's batch axes are manual (the step splits
  parameters over them itself) and names that are not mesh axes are unknown.
  Both would fail deep inside JAX; this names the leaf and the fix instead.
  ``nn.LogicallyPartitioned`` boxes constrain nothing unless logical axis
  rules are active, and are not checked.

  Args:
    spec: the step's `zero_jax.step.spec.StepSpec`.
    params: the parameter tree given to ``init``.
  """
  batch = set(spec.data_axes) | set(spec.replica_axes)
  for path, box in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]:
    if type(box) is not flax_meta.Partitioned:  # pylint: disable=unidiomatic-typecheck
      continue
    names = _axis_names(box.names)
    bad = [n for n in names if n in batch or n not in spec.mesh.axis_names]
    if not bad:
      continue
    why = (f"{bad[0]!r} is a batch axis of the step, which splits parameters over it itself"
           if bad[0] in batch else f"{bad[0]!r} is not an axis of the mesh "
           f"{tuple(spec.mesh.axis_names)}")
    others = (f"the mesh's other axes {spec.model_axes} (or None)" if spec.model_axes else
              "None (the mesh has no other axes)")
    raise ValueError(
        f"params{jax.tree_util.keystr(path)} is an nn.Partitioned box with names {box.names}. "
        f"Flax applies them as a sharding constraint when the model reads the parameter, "
        f"which inside the step fails: {why}. Name only {others} in nn.with_partitioning "
        f"(the step reads them as param_specs= for the model axes), or use "
        f"nn.with_logical_partitioning as Flax's lm1b example does (it constrains nothing "
        f"without logical axis rules). Unboxing the parameters (nn.unbox) is not enough: Flax "
        f"also evaluates some initializers, boxes included, when it applies the model.")
