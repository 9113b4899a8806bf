"""What a zero_jax checkpoint holds, and whether it fits a step: its JSON description.

`describe` turns a `TrainState` (concrete, or ``train_step.abstract_state``)
into the JSON document that `zero_jax.checkpoint.CheckpointManager` stores
next to the arrays; `check_compatible` compares a saved description with the
one of the state a step would make and names what differs. `to_items` and
`from_items` convert between a state and the ``{group: {"0000": leaf}}`` dict
that Orbax writes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.step.state import TrainState

FORMAT = "zero_jax.checkpoint/1"
GROUPS = ("step", "params", "master", "opt_state", "loss_scale", "model_state", "rng")
# Leaves that a later zero_jax added to the state, as (group, path). A checkpoint written
# before one existed restores it with its value at init (zero). Each was appended last in
# its group, so the saved leaves keep their keys.
ADDED_LEAVES = (("loss_scale", ".skipped_in_a_row"),)
_MAX_LISTED = 12
# 2: integers and the user's own functions are hyperparameters in ``optimizer`` (issue 48);
# a description without the key recorded them as part of the update rule.
OPTIMIZER_RECORD = 2
_OLDER_RECORD = (" This checkpoint was written by an older zero_jax, which counted integer "
                 "hyperparameters (optax.adam(1)) and the user's own schedule functions as part "
                 "of the update rule: if only those changed, restore it into a step with the "
                 "values it was saved with and save it again (mngr.save(state, force=True)); "
                 "it then restores into the new values.")
_MAY_CHANGE = ("its hyperparameters may change (learning rate, betas, eps, weight decay, int or "
               "float, a schedule for another schedule), the transformations and the layout of "
               "their state may not (a schedule in place of a constant learning rate adds a "
               "step count to the state).")


# --------------------------------------------------------------- description
def _key(i: int) -> str:
  return f"{i:04d}"


def _paths(tree) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _entry(path: str, shape, dtype, stored) -> dict:
  return {"path": path, "shape": [int(d) for d in shape], "dtype": str(dtype),
          "stored": [int(d) for d in stored]}


def _tree_signature(treedef) -> str:
  """The node types of a tree, with plain containers of leaves collapsed to ``*``.

  ``optax.adam`` gives ``(ScaleByAdamState(*,*,*),EmptyState())``: it names
  the optimizer's state types without the parameter tree and without static
  data (whose repr may hold memory addresses).
  """
  node = treedef.node_data()
  if node is None:
    return "*"
  typ = node[0]
  kids = [_tree_signature(c) for c in treedef.children()]
  if typ is type(None):
    return "None"
  if typ in (dict, list, tuple):
    if all(k == "*" for k in kids):
      return "*"
    return "(" + ",".join(kids) + ")"
  return f"{typ.__name__}(" + ",".join(kids) + ")"


def _groups(state: TrainState) -> dict[str, Any]:
  return {g: getattr(state, g) for g in GROUPS}


def _storage_kind(state: TrainState) -> str:
  """How the trainable parameters are kept, e.g. ``"bfloat16 + float32 master"``."""
  dtypes = sorted({str(x.dtype) for x, t in zip(jax.tree.leaves(state.params),
                                                state.meta.trainable) if t})
  kind = "/".join(dtypes) or "none trainable"
  return kind + (" + float32 master" if state.master is not None else "")


def _num_devices(state: TrainState) -> int | None:
  for x in jax.tree.leaves(state):
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
      return len(sharding.device_set)
  return None


def _optimizer_signature_of_state(state: TrainState) -> str | None:
  """The signature of the optimizer ``state`` was made by, if its meta records one."""
  return getattr(getattr(state.meta, "signature", None), "optimizer", None)


def describe(state: TrainState) -> dict:
  """The JSON description of ``state`` stored next to its arrays.

  Works on a concrete state and on ``train_step.abstract_state(...)``.

  Returns:
    A dict with ``format``, ``num_devices`` (informative), ``trainable``,
    ``param_storage`` (parameter dtypes and whether there is a master copy),
    ``opt_signature`` (the optimizer state's node types), ``optimizer`` (the
    update rule, `optimizer_signature`, or None where the state does not
    record it) and ``groups``: for each group, one entry per leaf with its
    ``path``, logical ``shape``, ``dtype`` and ``stored`` (storage) shape.
  """
  meta = state.meta
  p_paths = _paths(state.params)
  groups = {}
  groups["step"] = [_entry("", np.shape(state.step), state.step.dtype, np.shape(state.step))]
  groups["params"] = [_entry(p, l.shape, x.dtype, np.shape(x)) for p, l, x in
                      zip(p_paths, meta.param_layouts, jax.tree.leaves(state.params))]
  if state.master is None:
    groups["master"] = []
  else:
    trained = [i for i, t in enumerate(meta.trainable) if t]
    groups["master"] = [_entry(p_paths[i], meta.param_layouts[i].shape, x.dtype, np.shape(x))
                        for i, x in zip(trained, state.master)]
  groups["opt_state"] = [_entry(p, l.shape, x.dtype, np.shape(x)) for p, l, x in
                         zip(_paths(state.opt_state), meta.opt_layouts,
                             jax.tree.leaves(state.opt_state))]
  for g in ("loss_scale", "model_state", "rng"):
    tree = _groups(state)[g]
    groups[g] = [_entry(p, np.shape(x), x.dtype, np.shape(x))
                 for p, x in zip(_paths(tree), jax.tree.leaves(tree))]
  return {
      "format": FORMAT,
      "num_devices": _num_devices(state),
      "trainable": [bool(t) for t in meta.trainable],
      "param_storage": _storage_kind(state),
      "opt_signature": _tree_signature(jax.tree.structure(state.opt_state)),
      "optimizer": _optimizer_signature_of_state(state),
      "optimizer_record": OPTIMIZER_RECORD,
      "groups": groups,
  }


def to_items(state: TrainState) -> dict:
  """``{group: {"0000": leaf}}`` of the state's arrays, empty groups left out.

  Leaves without elements (a dimension of size 0) are left out too: they hold no values,
  and Orbax writes no zero-size array; `from_items` makes them again.
  """
  items = {}
  for g, tree in _groups(state).items():
    leaves = {_key(i): x for i, x in enumerate(jax.tree.leaves(tree)) if np.prod(x.shape)}
    if leaves:
      items[g] = leaves
  return items


def as_arrays(state: TrainState) -> TrainState:
  """``state`` with Python and NumPy scalars (a learning rate set by hand in an
  ``optax.inject_hyperparams`` state) as the replicated arrays a step would make of them.

  Raises:
    TypeError: a leaf that is neither an array nor a number, naming it.
  """
  def one(group, path, x):
    if isinstance(x, (jax.Array, np.ndarray)) and np.ndim(x):
      return x
    if isinstance(x, (jax.Array, int, float, bool, np.generic, np.ndarray)):
      return x if isinstance(x, jax.Array) else jax.device_put(
          np.asarray(x, jnp.asarray(x).dtype), state.step.sharding)
    raise TypeError(f"state.{group}{jax.tree_util.keystr(path)} is a {type(x).__name__}, "
                    f"not an array or a number, so it cannot be saved. Keep the arrays "
                    f"step.init or the step returned, or set a new value as an array.")
  return state.replace(**{g: jax.tree_util.tree_map_with_path(functools.partial(one, g),
                                                              getattr(state, g))
                          for g in GROUPS if g != "step"})


def zeros_like(like) -> jax.Array:
  """Zeros of ``like``'s shape, dtype and sharding (a shape struct of the target state)."""
  return jax.make_array_from_callback(like.shape, like.sharding,
                                      lambda i: np.zeros(like.shape, like.dtype)[i])


def from_items(target: TrainState, items: dict) -> TrainState:
  """Puts restored ``items`` into the tree structure of ``target`` (leaves without elements,
  which `to_items` leaves out, made from the target)."""
  fields = {}
  for g, tree in _groups(target).items():
    leaves, treedef = jax.tree.flatten(tree)
    got = items.get(g, {})
    fields[g] = jax.tree.unflatten(treedef, [got[_key(i)] if _key(i) in got else zeros_like(x)
                                             for i, x in enumerate(leaves)])
  return target.replace(**fields)


def added_since(saved: dict, mine: dict) -> list[tuple[str, str]]:
  """``(group, key)`` of the `ADDED_LEAVES` that ``mine`` has and the ``saved`` one lacks."""
  out = []
  for g, path in ADDED_LEAVES:
    if path in {e["path"] for e in saved["groups"][g]}:
      continue
    out += [(g, _key(i)) for i, e in enumerate(mine["groups"][g]) if e["path"] == path]
  return out


# ---------------------------------------------------------------- comparison
def _name(group: str, path: str) -> str:
  return group + path


def _listing(lines: list[str]) -> str:
  shown = lines[:_MAX_LISTED]
  more = len(lines) - len(shown)
  return "\n".join("  " + l for l in shown) + (f"\n  ... and {more} more" if more > 0 else "")


def _number_cast(s: dict, e: dict) -> bool:
  """A scalar ``optax.inject_hyperparams`` value saved as an integer and now a float, or the
  other way (``learning_rate=1``, then ``0.5``): a hyperparameter, cast on restore."""
  number = lambda d: (jnp.issubdtype(jnp.dtype(d), jnp.integer)
                      or jnp.issubdtype(jnp.dtype(d), jnp.floating))
  return (s["shape"] == e["shape"] == [] and ".hyperparams[" in e["path"]
          and number(s["dtype"]) and number(e["dtype"]))


def hyperparam_casts(saved: dict, mine: dict) -> dict[int, str]:
  """``{i: dtype}``: the optimizer-state leaves ``i`` of ``mine`` that the checkpoint
  ``saved`` holds in another dtype ``dtype``, as `_number_cast` allows."""
  by_path = {e["path"]: e for e in saved["groups"]["opt_state"]}
  out = {}
  for i, e in enumerate(mine["groups"]["opt_state"]):
    s = by_path.get(e["path"])
    if s is not None and s["dtype"] != e["dtype"] and _number_cast(s, e):
      out[i] = s["dtype"]
  return out


def with_opt_dtypes(state: TrainState, dtypes: dict) -> TrainState:
  """``state`` with its optimizer-state leaves ``i`` in ``dtypes[i]`` (shape structs, or
  arrays cast in place on their sharding)."""
  if not dtypes:
    return state
  leaves, treedef = jax.tree.flatten(state.opt_state)

  def one(x, dtype):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return jax.device_put(jnp.asarray(x).astype(dtype), x.sharding)
  leaves = [one(x, dtypes[i]) if i in dtypes else x for i, x in enumerate(leaves)]
  return state.replace(opt_state=jax.tree.unflatten(treedef, leaves))


def _leaf_differences(group: str, saved: list[dict], mine: list[dict], *,
                      dtypes: bool = True) -> list[str]:
  """Lines naming leaves missing, unexpected or of another shape (or dtype; in the
  optimizer state, an injected hyperparameter may change between int and float)."""
  s_by = {e["path"]: e for e in saved}
  m_by = {e["path"]: e for e in mine}
  out = []
  for e in mine:
    s = s_by.get(e["path"])
    if s is None:
      out.append(f"{_name(group, e['path'])}: in this step's state "
                 f"{tuple(e['shape'])} {e['dtype']}, not in the checkpoint")
    elif s["shape"] != e["shape"] or (dtypes and s["dtype"] != e["dtype"] and not (
        group == "opt_state" and _number_cast(s, e))):
      out.append(f"{_name(group, e['path'])}: checkpoint {tuple(s['shape'])} {s['dtype']}, "
                 f"this step's state {tuple(e['shape'])} {e['dtype']}")
  for e in saved:
    if e["path"] not in m_by:
      out.append(f"{_name(group, e['path'])}: in the checkpoint {tuple(e['shape'])} "
                 f"{e['dtype']}, not in this step's state")
  if not out and [e["path"] for e in saved] != [e["path"] for e in mine]:
    out.append(f"{group}: the same leaves in another order")
  return out


def check_compatible(saved: dict, mine: dict, where: str) -> None:
  """Raises ValueError naming what differs between two `describe` results.

  Differences in the number of devices and in the stage are allowed (that is
  what a restore converts); anything else is not.
  """
  if saved.get("format") != FORMAT:
    raise ValueError(f"{where} was written in format {saved.get('format')!r}, this version of "
                     f"zero_jax reads {FORMAT!r}.")
  sg, mg = saved["groups"], mine["groups"]
  diffs = _leaf_differences("params", sg["params"], mg["params"], dtypes=False)
  if diffs:
    raise ValueError(
        f"{where} does not match the parameters given to restore ({len(diffs)} "
        f"difference(s)):\n{_listing(diffs)}\nRestore with params_like of the model that was "
        f"saved (same tree and shapes), or start from step.init(params) for a new model.")
  if saved["trainable"] != mine["trainable"]:
    names = [e["path"] for e, a, b in zip(mg["params"], saved["trainable"], mine["trainable"])
             if a != b]
    raise ValueError(f"{where} was written with other trainable= leaves; these differ: "
                     f"{', '.join('params' + n for n in names[:_MAX_LISTED])}. Build the step "
                     f"with the trainable= used for the checkpoint.")
  if saved["param_storage"] != mine["param_storage"]:
    raise ValueError(f"{where} was written with another precision: its trainable parameters "
                     f"are {saved['param_storage']}, this step's are {mine['param_storage']}. "
                     f"Build the step with the precision= of the saved run (and pass "
                     f"params_like with the dtypes the saved run was initialised with).")
  if saved["opt_signature"] != mine["opt_signature"]:
    leaves = _leaf_differences("opt_state", sg["opt_state"], mg["opt_state"])
    listing = f" The leaves that differ:\n{_listing(leaves)}\n" if leaves else " "
    raise ValueError(
        f"{where} was written with a different optimizer: its optimizer state is "
        f"{saved['opt_signature']}, this step's optimizer makes {mine['opt_signature']}."
        f"{listing}Build the step with the optimizer the checkpoint was trained with: "
        f"{_MAY_CHANGE}")
  added = {(g, int(k)) for g, k in added_since(saved, mine)}
  diffs = []
  for g in GROUPS:
    diffs += _leaf_differences(g, sg[g], [e for i, e in enumerate(mg[g]) if (g, i) not in added])
  if diffs:
    hint = ""
    if any(d.startswith(("model_state", "rng")) for d in diffs):
      hint = ("\nPass model_state= and rng= to restore shaped like the ones given to "
              "step.init in the saved run (None where it had none).")
    if any(d.startswith("opt_state") for d in diffs):
      hint += (f"\nThe optimizer's state has another layout: build the step with the "
               f"optimizer the checkpoint was trained with: {_MAY_CHANGE}")
    raise ValueError(f"{where} does not match this step's state ({len(diffs)} "
                     f"difference(s)):\n{_listing(diffs)}{hint}")
  if saved.get("optimizer") and mine.get("optimizer") and saved["optimizer"] != mine["optimizer"]:
    raise ValueError(
        f"{where} was written with a different optimizer: its update rule is "
        f"{saved['optimizer']}, this step's optimizer is {mine['optimizer']} (their states "
        f"have the same types, as adam, nadam, radam and yogi do, but they update "
        f"differently). Build the step with the optimizer the checkpoint was trained with: "
        f"{_MAY_CHANGE}{_OLDER_RECORD if saved.get('optimizer_record') is None else ''}")
