"""Per-leaf options resolved to one value per parameter leaf.

``trainable=``, ``stacked=`` and ``lookup=`` are None, a pytree of bools matching the
params (or a prefix of them), or a function ``(path, leaf) -> bool``; for a
module (``step.init(model)``) they are NNX filters, as ``nnx.Optimizer``'s
``wrt`` (``nnx.Param``, ``nnx.PathContains("head")``, ``nnx.All(...)``, a
function ``(path, variable) -> bool``, ...).
``param_specs=`` is a pytree of ``PartitionSpec``s over the mesh's model axes
(or a prefix of the params tree; ``None`` for a replicated subtree), or is
read from params that arrive as global arrays with a ``NamedSharding`` on the
step's mesh, or boxed in Linen ``nn.Partitioned`` with mesh-axis names. Errors name the leaf (``jax.tree_util.keystr``) and the fix.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta as flax_meta
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax.layers import nnx as nnx_lib
from zero_jax.numerics import precision as prec
from zero_jax.step.spec import StepSpec


@dataclasses.dataclass(frozen=True, eq=False)
class LeafOptions:
  """The per-leaf options of `make_sharded_train_step`, as the user gave them.

  Resolved to one value per parameter leaf by `trainable_flags`,
  `stacked_flags` and `model_axes_per_leaf` when a state's meta is built.

  Attributes:
    trainable: ``trainable=`` (None: every floating leaf).
    stacked: ``stacked=`` (None: no leaf).
    param_specs: ``param_specs=`` (None: read from the arrays, else replicated).
    wrt: ``wrt=``, the NNX filter of the variables that are parameters.
    whole_leaf_update: ``whole_leaf_update=`` (None: no leaf; see
      `zero_jax.step.whole_leaf`).
    lookup: ``lookup=`` (None: no leaf; see `zero_jax.layers.lookup`).
  """
  trainable: Any = None
  stacked: Any = None
  param_specs: Any = None
  wrt: Any = None
  whole_leaf_update: Any = None
  lookup: Any = None


def _is_bool(m) -> bool:
  return isinstance(m, (bool, np.bool_)) or (
      getattr(m, "shape", None) == () and getattr(m, "dtype", None) == jnp.bool_)


def leaf_flags(value, params, name: str) -> list:
  """(flag, explicit) per params leaf from a per-leaf bool option.

  ``explicit`` is True only for a bool given for the leaf itself (not for a
  subtree, and not by a function, which sees every leaf).
  """
  paths_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  if value is None:
    return [(False, False)] * len(paths_leaves)
  if nnx_lib.holds_variables(params):  # a module's variables: an NNX filter picks them
    nnx_lib.check_filter(value, name)
    return [(f, False) for f in nnx_lib.filter_flags(value, params)]
  if nnx_lib.is_nnx_filter(value):
    raise TypeError(f"{name}={nnx_lib.filter_repr(value)} is an NNX filter, which selects the "
                    f"variables of a module given to step.init(model); these params are a plain "
                    f"pytree: pass a tree of bools or a function (path, leaf) -> bool.")
  if callable(value) and not isinstance(value, (dict, list, tuple)):
    return [(bool(value(path, x)), False) for path, x in paths_leaves]
  for path, m in jax.tree_util.tree_flatten_with_path(value)[0]:
    if not _is_bool(m):
      raise TypeError(f"{name}{jax.tree_util.keystr(path)} is {m!r}; every leaf of a "
                      f"{name}= tree must be True or False (or pass a function "
                      f"(path, leaf) -> bool).")
  expand = lambda m, sub: jax.tree.map(
      lambda _: (bool(m), jax.tree_util.treedef_is_leaf(jax.tree.structure(sub))), sub)
  try:
    full = jax.tree.map(expand, value, params)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{name}= must be a pytree of bools with the structure of the "
                     f"params (or a prefix of it), or a function (path, leaf) -> bool; it "
                     f"does not match the params: {e}") from None
  return jax.tree.leaves(full, is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2 and
                         isinstance(x[0], bool))


def trainable_flags(value, params) -> tuple:
  """One bool per params leaf: does it train (``trainable=``, see `make_sharded_train_step`)."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  ok = [prec.is_trainable_dtype(jnp.result_type(x)) for _, x in leaves]
  if value is None:
    return tuple(ok)
  flags = []
  for (f, explicit), (path, x), can in zip(leaf_flags(value, params, "trainable"), leaves, ok):
    if f and explicit and not can:
      raise ValueError(f"trainable marks the leaf params{jax.tree_util.keystr(path)} of "
                       f"dtype {jnp.result_type(x)} as trainable, but only floating (and "
                       f"complex) leaves can train; mark it False (integer and bool leaves are "
                       f"frozen by default).")
    flags.append(f and can)
  return tuple(flags)


def stacked_flags(value, params) -> tuple:
  """One bool per params leaf: is it a stack of layers (``stacked=``)."""
  flags = []
  for (f, _), (path, x) in zip(leaf_flags(value, params, "stacked"),
                               jax.tree_util.tree_flatten_with_path(params)[0]):
    if f and not np.shape(x):
      raise ValueError(f"stacked marks params{jax.tree_util.keystr(path)} as a stack of "
                       f"per-layer weights, but it is a scalar; a stacked leaf has the "
                       f"layers along its first dimension. Mark it False.")
    flags.append(bool(f))
  return tuple(flags)


_SHOWN_PATHS = 8


def option_repr(value, limit: int = 120) -> str:
  """A per-leaf option as the user wrote it: ``nnx.PathContains('block', exact=True)``, the
  function's name, or the tree's ``repr`` (cut at ``limit`` characters)."""
  if nnx_lib.is_nnx_filter(value):
    text = nnx_lib.filter_repr(value)
    return "nnx." + text if type(value).__module__ == nnx_lib.filterlib.__name__ else text
  if callable(value) and hasattr(value, "__qualname__"):
    return f"<function {value.__qualname__}>"
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def check_stacked_selects(value, stacks, params, *, param_stage: int) -> None:
  """``stacked=`` given (not None) that marks no leaf: an error where the parameters are
  gathered in the loss (``param_stage`` 3: the loop over layers is what it is for), a
  warning otherwise. Both name the option as given and show the parameters' paths.

  Args:
    value: ``stacked=`` as the user gave it.
    stacks: `stacked_flags` of it, one bool per params leaf.
    params: the parameter tree (or a module's variables).
    param_stage: the step's `zero_jax.step.spec.StepSpec.param_stage`.
  """
  if value is None or any(stacks):
    return
  keypaths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  paths = [f"params{jax.tree_util.keystr(p)}".removesuffix(".value") for p in keypaths]
  shown = ", ".join(paths[:_SHOWN_PATHS]) + (
      f", ... ({len(paths)} leaves)" if len(paths) > _SHOWN_PATHS else "")
  head = (f"stacked={option_repr(value)} marks no parameter as a stack of layers: none of the "
          f"{len(paths)} {'leaf' if len(paths) == 1 else 'leaves'} is selected. The "
          f"parameters are: {shown}.")
  fix = ("Fix it to select the stacked leaves among these paths (a function gets (path, leaf) "
         "for each leaf; nnx.PathContains matches a whole key of the path), or leave stacked= "
         "out if no leaf is a stack of per-layer weights.")
  key = getattr(value, "key", None) if type(value).__name__ == "PathContains" else None
  if isinstance(key, str):
    names = {getattr(e, "key", getattr(e, "name", None)) for p in keypaths for e in p}
    near = sorted(n for n in names if isinstance(n, str) and key in n and n != key)
    if near:
      fix = f"Did you mean nnx.PathContains({near[0]!r})? " + fix
  if param_stage == 3:
    raise ValueError(f"{head} At stage 3 the step would gather every parameter whole before "
                     f"the loss, and zero_jax.scan would loop over the whole stack: the "
                     f"memory stage 3 saves would be gone. {fix}")
  warnings.warn(f"{head} At stages 1-2 this changes only how the optimizer state is split; "
                f"at stage 3 it is an error. {fix}", UserWarning, stacklevel=4)
def lookup_flags(value, params, stacked, models) -> tuple:
  """One bool per params leaf: is it a table ``loss_fn`` looks rows up in (``lookup=``,
  `zero_jax.take`), which stage 3 leaves split.

  Raises:
    ValueError: ``lookup=`` selects no leaf (a typo would silently gather the table), or
      selects a scalar, a ``stacked=`` leaf or one split over model axes (``param_specs=``).
  """
  flags = []
  for (f, _), (path, x), s, m in zip(leaf_flags(value, params, "lookup"),
                                     jax.tree_util.tree_flatten_with_path(params)[0],
                                     stacked, models):
    where = f"params{jax.tree_util.keystr(path)}"
    if f and not np.shape(x):
      raise ValueError(f"lookup marks {where}, a scalar; a lookup table has its rows along "
                       f"its first dimension (zj.take(table, ids) reads table[ids]). Mark it "
                       f"False.")
    if f and s:
      raise ValueError(f"lookup and stacked both mark {where}: a stack of layers is gathered "
                       f"one layer at a time (zj.gather), a lookup table is read by rows "
                       f"(zj.take). Mark it in one of them.")
    if f and m:
      raise ValueError(f"lookup marks {where}, which param_specs= splits over model axes "
                       f"{m}; a split lookup table over model axes is not supported. Leave it "
                       f"out of lookup= (it is then gathered whole at stage 3), or unsplit it.")
    flags.append(bool(f))
  if value is not None and not any(flags):
    written = nnx_lib.filter_repr(value) if nnx_lib.is_nnx_filter(value) else repr(value)
    raise ValueError(f"lookup={written} selects no parameter leaf, so every table would be "
                     f"gathered whole at stage 3. Check its keys (the params' paths, e.g. "
                     f"{{'embed': True}}) or filter (e.g. nnx.PathContains('embed')), or drop "
                     f"lookup=.")
  return tuple(flags)


def whole_leaf_flags(value, params, trainable) -> tuple:
  """One bool per params leaf: is its update made whole on one device (``whole_leaf_update=``).

  Only trainable leaves are selected; a leaf named for itself (a bool at its own path)
  that does not train is refused, as selecting it would do nothing.
  """
  flags = []
  for (f, explicit), (path, _), t in zip(leaf_flags(value, params, "whole_leaf_update"),
                                         jax.tree_util.tree_flatten_with_path(params)[0],
                                         trainable):
    if f and explicit and not t:
      raise ValueError(f"whole_leaf_update marks params{jax.tree_util.keystr(path)}, which does "
                       f"not train (trainable= or its dtype): it has no update to make whole. "
                       f"Mark it False, or make it trainable.")
    flags.append(bool(f and t))
  return tuple(flags)



# ------------------------------------------------------------------ model axes
def on_step_mesh(sharding, spec: StepSpec) -> bool:
  """Whether ``sharding`` is on a mesh like the step's: the same axes, sizes and devices
  (in any order: the spec says the split, ``init`` moves the blocks where the step wants)."""
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(spec.mesh, Mesh):  # an abstract mesh (planning): no devices to match
    return False
  return (isinstance(sharding, NamedSharding) and tuple(mesh.axis_names) ==
          tuple(spec.mesh.axis_names) and mesh.devices.shape == spec.mesh.devices.shape and
          {d.id for d in mesh.devices.flat} == {d.id for d in spec.mesh.devices.flat})


def _spec_entries(pspec: P, ndim: int) -> list[tuple[str, ...]]:
  entries = list(pspec) + [None] * (ndim - len(pspec))
  return [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries]


def _found_specs(spec: StepSpec, params) -> list:
  """Per leaf, the split over the model axes it arrives with (None: none).

  Read from the leaf's ``NamedSharding`` on the step's mesh or, failing that,
  from the names of the Linen ``nn.Partitioned`` box it is in (what
  ``nn.get_partition_spec`` gives). Names of other axes are not the user's
  model split and are dropped.
  """
  is_box = lambda x: isinstance(x, flax_meta.Partitioned)
  out = []
  for node in jax.tree.leaves(params, is_leaf=is_box):
    box = node if is_box(node) else None
    for x in jax.tree.leaves(node.value) if box else [node]:
      sh = getattr(x, "sharding", None)
      pspec = (sh.spec if on_step_mesh(sh, spec) else
               box.get_partition_spec() if type(box) is flax_meta.Partitioned else None)  # pylint: disable=unidiomatic-typecheck
      if pspec is None:
        out.append(None)
        continue
      keep = [tuple(a for a in axes if a in spec.model_axes)
              for axes in _spec_entries(pspec, np.ndim(x))]
      out.append(P(*[_entry(e) for e in keep]))
  return out


def _key_names(path) -> tuple:
  """A key path as plain names and indices (a dict key, attribute and index alike), so
  that ``{"lin": {"kernel": P(...)}}`` describes an ``nnx.State`` or a Linen dict."""
  return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def _spec_like(x) -> bool:
  """A tuple or list that reads as a PartitionSpec's entries (names and None)."""
  entry = lambda e: e is None or isinstance(e, str) or (
      isinstance(e, (tuple, list)) and bool(e) and all(isinstance(a, str) for a in e))
  return isinstance(x, (tuple, list)) and any(isinstance(e, str) for e in x) and \
      all(entry(e) for e in x)


def _given_specs(spec: StepSpec, params, param_specs) -> list:
  """One PartitionSpec (or None) per leaf, from param_specs=, or as the leaves arrive.

  Each entry of ``param_specs`` covers the leaves at and below its path in the params.
  """
  if param_specs is None:
    return _found_specs(spec, params)
  is_leaf = lambda x: x is None or isinstance(x, P) or _spec_like(x)
  entries = jax.tree_util.tree_flatten_with_path(param_specs, is_leaf=is_leaf)[0]
  for path, s in entries:
    if s is not None and not isinstance(s, P):
      fix = (f"write P{tuple(s)!r} (jax.sharding.PartitionSpec): a plain "
             f"{type(s).__name__} is read as a subtree of param_specs" if _spec_like(s) else
             "pass a jax.sharding.PartitionSpec, or None for a replicated subtree")
      raise TypeError(f"param_specs{jax.tree_util.keystr(path)} is {s!r}; {fix}.")
  table = {_key_names(path): s for path, s in entries}
  out, used = [], set()
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = _key_names(path)
    match = [k for k in table if names[:len(k)] == k]
    if not match:
      raise ValueError(
          f"param_specs has no entry for params{jax.tree_util.keystr(path)}: give every leaf, "
          f"or a subtree above it, a PartitionSpec (None: replicated); param_specs= is a "
          f"pytree of the params' structure or a prefix of it (its paths: "
          f"{', '.join(jax.tree_util.keystr(p) for p, _ in entries[:6])}).")
    used.add(match[0])
    out.append(table[match[0]])
  for path, _ in entries:
    if _key_names(path) not in used:
      raise ValueError(f"param_specs{jax.tree_util.keystr(path)} is at a path that holds no "
                       f"parameter; param_specs= follows the params' tree (or a prefix of "
                       f"it). Remove the entry or fix its keys.")
  return out


def _entry(names):
  return None if not names else (names[0] if len(names) == 1 else tuple(names))


def _check_divisible(spec: StepSpec, where: str, s, shape, dims) -> None:
  """Raises ValueError when a dimension is split over model axes whose size does not divide it."""
  sizes = spec.axis_sizes()
  for d, axes in enumerate(dims):
    m = int(np.prod([sizes[a] for a in axes]))
    if axes and shape[d] % m:
      named = _entry(list(axes))
      raise ValueError(
          f"{where} is {s}: it splits dimension {d} (size {shape[d]}) of the leaf of shape "
          f"{tuple(shape)} over {named!r} (size {m}), which does not divide {shape[d]}. Pad "
          f"that dimension to a multiple of {m} (e.g. {-(-shape[d] // m) * m}), split another "
          f"dimension over {named!r}, or leave this leaf unsplit (None in param_specs).")


def model_axes_per_leaf(spec: StepSpec, params, param_specs) -> list:
  """Per leaf: per dimension, the model axes it is split over (None: not split).

  Raises:
    ValueError: a spec names a data/replica axis or an unknown one, uses an
      axis twice, has more entries than the leaf has dimensions or splits a
      dimension its axes' size does not divide; or a model axis of size > 1
      is used by no parameter.
  """
  out, used = [], set()
  for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                          _given_specs(spec, params, param_specs)):
    where = f"param_specs for params{jax.tree_util.keystr(path)}"
    if s is None or all(e is None for e in s):
      out.append(None)
      continue
    ndim = np.ndim(x)
    if len(s) > ndim:
      raise ValueError(f"{where} is {s} with {len(s)} entries, but the leaf has shape "
                       f"{np.shape(x)}; give at most one entry per dimension.")
    dims = _spec_entries(s, ndim)
    flat = [a for d in dims for a in d]
    for a in flat:
      if a in spec.data_axes + spec.replica_axes:
        raise ValueError(
            f"{where} is {s}, which names {a!r}, one of the step's "
            f"{'data' if a in spec.data_axes else 'replica'} axes; param_specs describe the "
            f"split over the model axes {spec.model_axes} only: the step adds its own split "
            f"over axis_name. Drop {a!r} from the spec.")
      if a not in spec.model_axes:
        raise ValueError(f"{where} is {s}, which names {a!r}, not an axis of the mesh "
                         f"{tuple(spec.mesh.axis_names)}.")
    if len(set(flat)) != len(flat):
      raise ValueError(f"{where} is {s}, which uses an axis twice.")
    used |= set(flat)
    _check_divisible(spec, where, s, np.shape(x), dims)
    out.append(tuple(dims))
  sizes = spec.axis_sizes()
  unused = [a for a in spec.model_axes if sizes[a] > 1 and a not in used]
  if unused:
    a = unused[0]
    raise ValueError(
        f"mesh axis {a!r} (size {sizes[a]}) has no role in this step: the batch is split over "
        f"{spec.batch_axes}, and no parameter is split over {a!r}, so every group of "
        f"{sizes[a]} devices along it would compute the same thing. Give it a role: add it to "
        f"axis_name= (split the batch and the optimizer state over it too, e.g. "
        f"axis_name={spec.data_axes + (a,)!r}), to replica_axis= (split the batch, replicate "
        f"the state: hybrid sharding across hosts), or split parameters over it with "
        f"param_specs= (tensor parallelism, e.g. {{'w': P(None, {a!r})}}).")
  return out
