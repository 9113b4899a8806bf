"""What ``step.init`` is given, made into a state without a whole model on any device.

A zero-argument function (``step.init(lambda: Model(nnx.Rngs(0)))``) is traced once (the
structure, the meta and every check come from the trace) and run under ``jax.jit`` with the
storage shardings as ``out_shardings``: XLA partitions the initializers, so each device computes
only its own block. A big model is made in groups of leaves, one ``jit`` each, whose outputs the
``jit`` that builds the state then reuses. Arrays that are already split on the step's mesh
enter that ``jit`` where they lie (resharding a split array to another split moves blocks, never
a whole leaf); host arrays are first put on the devices split over the data axes where a
dimension divides evenly. See the guide docs/guides/bigger.md.

Example:
  >>> import jax, jax.numpy as jnp, optax, zero_jax as zj
  >>> mesh = jax.make_mesh((8,), ("data",))
  >>> step = zj.make_sharded_train_step(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(0.1),
  ...                                   mesh=mesh, stage=3)
  >>> init_fn = lambda: {"w": jax.random.normal(jax.random.key(0), (1024, 16))}
  >>> state = step.init(init_fn)        # no device ever holds the whole of w
  >>> state.params["w"].addressable_shards[0].data.shape
  (128, 16)
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from zero_jax.step import context
from zero_jax.layers import nnx as nnx_lib
from zero_jax.numerics import precision as prec
from zero_jax.step import placement
from zero_jax.step import state as st
from zero_jax.comm import layout as lay
from zero_jax.step.options import on_step_mesh
from zero_jax.step.spec import StepSpec

CONSTANT_BYTES = 2**20  # a non-computed leaf of an init function this big is warned about


class Source(NamedTuple):
  """What ``init`` was given, resolved.

  Attributes:
    module: the `zero_jax.layers.nnx.ModuleDef` of a module, or None.
    params: the parameter tree: arrays, or ``jax.ShapeDtypeStruct``s for a function.
    model_state: the model state (arrays, or shape structs for a function), or None.
    make: for a function, its trace: a ``ClosedJaxpr`` whose outputs are the
      parameter leaves, then the model state's (run under ``jit``); None when the
      values were given.
  """
  module: Any
  params: Any
  model_state: Any
  make: Any = None


def is_init_fn(x) -> bool:
  """Whether ``x`` is an init function: callable, not a module, not a pytree of arrays."""
  return (callable(x) and not nnx_lib.is_module(x) and not hasattr(x, "shape")
          and jax.tree_util.treedef_is_leaf(jax.tree.structure(x)))


def _check_signature(fn) -> None:
  if isinstance(fn, type):
    _check_class(fn)
    return
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):  # a builtin without a signature: let the call tell
    return
  try:
    sig.bind()
  except TypeError:
    raise TypeError(
        f"step.init got the function {getattr(fn, '__name__', fn)!r}{sig}, which takes "
        f"arguments; an init function takes none and returns the params pytree or an "
        f"nnx.Module. Bind them: step.init(lambda: init(jax.random.key(0))), or "
        f"step.init(lambda: Model(nnx.Rngs(0))).") from None


def _check_class(cls: type) -> None:
  """A class is called with no arguments: its constructor's own signature says whether it
  can be (an ``nnx.Module`` class reports ``(*args, **kwargs)`` for itself)."""
  try:
    sig = inspect.signature(cls.__init__)
  except (TypeError, ValueError):
    return
  try:
    sig.bind(None)  # self
  except TypeError:
    needs = [p for p in list(sig.parameters.values())[1:]
             if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    value = lambda p: "nnx.Rngs(0)" if p.name == "rngs" else p.name
    args = ", ".join(f"{p.name}={value(p)}" if p.kind == p.KEYWORD_ONLY else value(p)
                     for p in needs)
    raise TypeError(
        f"step.init got the class {cls.__name__}, whose constructor needs "
        f"{', '.join(p.name for p in needs)}; "
        f"step.init calls an init function with no arguments. Pass a function that builds "
        f"the model: step.init(lambda: {cls.__name__}({args})).") from None


def _check_leaves(tree, what: str) -> None:
  """Every leaf an init function returned is an array; a big one it did not compute is warned."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    where = f"{what}{jax.tree_util.keystr(path)}"
    if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "dtype") and \
        not isinstance(x, (int, float, complex, bool)):
      raise TypeError(
          f"the init function returned {where} as a {type(x).__name__}, not an array; it must "
          f"return a pytree of arrays (the params) or an nnx.Module, made by the function "
          f"(e.g. jax.random.normal(key, shape) or Model(nnx.Rngs(0))).")
    nbytes = int(np.prod(np.shape(x))) * jnp.result_type(x).itemsize
    if not isinstance(x, jax.core.Tracer) and nbytes >= CONSTANT_BYTES:
      warnings.warn(
          f"zero_jax: the init function returned {where} ({nbytes / 2**20:.0f} MiB) as an "
          f"array it did not compute: it runs under jax.jit, where such an array is a constant "
          f"copied into the program whole. Compute it in the function (from a key), or pass "
          f"the arrays themselves: step.init(params).", RuntimeWarning, stacklevel=2)


def _traced(fn, wrt, found: dict) -> Callable:
  """``fn`` as a pure function ``() -> leaves of (params, model_state)``; records the module's
  def and the structure."""
  def make():
    out = fn()
    if not nnx_lib.is_module(out):
      _refuse_lookahead(out)
      _check_leaves(out, "params")
    module, params, model_state = nnx_lib.as_params(out, None, wrt)
    if module is not None:
      _check_leaves(params, "params")
      _check_leaves(model_state, "model_state")
    found["module"] = module
    found["tree"] = jax.tree.structure((params, model_state))
    return jax.tree.leaves((params, model_state))
  return make


def resolve(params, model_state, wrt) -> Source:
  """The `Source` for what ``init`` (or ``abstract_state``) was given.

  An init function is traced once (nothing runs); a module is split by
  ``wrt``; a pytree is checked and passed through.
  """
  if isinstance(params, st.TrainState):
    raise TypeError(
        "a TrainState was given where the parameters go (step.init, step.abstract_state and "
        "CheckpointManager.restore take the parameters, an nnx.Module or an init function): "
        "it is a state already (parameters, optimizer state, step count). Train on with it "
        "as it is (state, metrics = step(state, batch)); to start again from its parameters "
        "pass step.get_params(state); "
        "to restore or load into a step, pass the parameters' shapes, e.g. "
        "mngr.restore(step, step.get_params(state)).")
  if not is_init_fn(params):
    _refuse_lookahead(params)
    return Source(*nnx_lib.as_params(params, model_state, wrt))
  _check_signature(params)
  found: dict = {}
  closed, shapes = jax.make_jaxpr(_traced(params, wrt, found), return_shape=True)()
  shapes, made_state = jax.tree.unflatten(found["tree"], shapes)
  module = found["module"]
  if module is not None and model_state is not None:
    raise TypeError("step.init(fn) with fn returning an nnx.Module takes no model_state=: "
                    "the module's variables that wrt= does not select are its model state.")
  return Source(module, shapes, made_state if module is not None else model_state, closed)


def _refuse_lookahead(params) -> None:
  """Raises TypeError naming an ``optax.LookaheadParams`` in ``params``."""
  is_lookahead = lambda x: isinstance(x, optax.LookaheadParams)
  for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_lookahead)[0]:
    if is_lookahead(x):
      name = f"params{jax.tree_util.keystr(path)}"
      raise TypeError(
          f"{name} is an optax.LookaheadParams (optax.lookahead's fast and slow parameters), "
          f"which the step does not support: it differentiates the loss by every leaf of "
          f"params and passes those gradients and params to opt.update as they are, where "
          f"optax.lookahead's update takes the gradient of the fast parameters alone. Train "
          f"the fast parameters with lookahead's inner optimizer (step.init({name}.fast), a "
          f"loss of those parameters), without optax.lookahead.")


def check_values(source: Source, rng=None) -> None:
  """Raises TypeError naming a leaf of ``init``'s arguments that is a shape without a value."""
  for what, tree in (("params", source.params), ("model_state", source.model_state),
                     ("rng", rng)):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if isinstance(x, jax.ShapeDtypeStruct):
        raise TypeError(
            f"init got {what}{jax.tree_util.keystr(path)}, a jax.ShapeDtypeStruct "
            f"{tuple(x.shape)} {x.dtype}: a shape without values, and init places values on "
            f"the mesh. For a state without values use step.abstract_state(...) (what "
            f"CheckpointManager.restore reads into). To make the values with no device "
            f"holding them whole, pass a function that makes them: step.init(lambda: "
            f"Model(nnx.Rngs(0))); or arrays, e.g. loaded with zj.load_safetensors (for an "
            f"abstract module, nnx.update(model, loaded) and every other variable too).")


# ------------------------------------------------------------- arrays in place
def warn_about(spec: StepSpec, source: Source, meta: st.StateMeta) -> None:
  """What ``init`` warns about: half-precision leaves with no master copy, nothing to train."""
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(source.params)[0]]
  prec.warn_without_master(spec.policy, paths, meta.param_dtypes, meta.trainable)
  if not any(meta.trainable):
    warnings.warn("zero_jax: no parameter leaf trains (trainable= marks none, or no leaf "
                  "is floating); every step will leave the parameters unchanged.",
                  RuntimeWarning, stacklevel=3)


def input_spec(spec: StepSpec, layout: lay.Layout):
  """Where a host leaf is put before the init ``jit``: its storage split when that needs no
  padding (every device gets its own block only), else split over the model axes only."""
  if layout.dim is not None and layout.pad_amount == 0:
    return layout.spec(spec.data_axes)
  return layout.model_spec()


def _buffers(x) -> set:
  return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def place(spec: StepSpec, x, layout: lay.Layout) -> tuple[jax.Array, bool]:
  """``(leaf on the working mesh, whether it is a copy made here, free to donate)``, moving
  as little as possible.

  A ``jax.Array`` with a ``NamedSharding`` on the step's mesh stays where it
  is (re-labelled onto the working mesh, no copy); anything else (host arrays,
  arrays on other devices) is put split as `input_spec` says. (``device_put``
  of a ``jax.Array`` may keep its buffer for a shard on the same device, even
  with ``may_alias=False``: such a result still holds the user's buffers.)
  """
  mesh = spec.working_mesh()
  sh = x.sharding if isinstance(x, jax.Array) else None
  if isinstance(sh, NamedSharding) and on_step_mesh(sh, spec):
    return jax.device_put(x, NamedSharding(mesh, sh.spec)), False
  placed = context.device_put(x, NamedSharding(mesh, input_spec(spec, layout)))
  return placed, not (isinstance(x, jax.Array) and _buffers(placed) & _buffers(x))


# ------------------------------------------------------------ from a function
INIT_GROUPS = 16  # an init function's parameters are made in about this many jits ...
MIN_GROUP_BYTES = 2 * 2**20  # ... of at least this many bytes per device each


def groups(sizes: list[int]) -> list[list[int]]:
  """Consecutive leaf indices in groups of about ``sum(sizes) / INIT_GROUPS`` (at least
  `MIN_GROUP_BYTES`; a leaf is never split)."""
  budget = max(MIN_GROUP_BYTES, sum(sizes) / INIT_GROUPS)
  out: list[list[int]] = [[]]
  weight = 0
  for i, b in enumerate(sizes):
    if out[-1] and weight + b > budget:
      out.append([])
      weight = 0
    out[-1].append(i)
    weight += b
  return out


class Maker(NamedTuple):
  """How an init function's leaves are made (see `maker`).

  Attributes:
    groups: leaf indices per ``jit``; parameters first, then the model state's leaves.
    outs: per output, a ``jax.ShapeDtypeStruct`` with its sharding: the
      parameters in their storage view split over the data axes, the model
      state replicated.
    values: ``values(idx)`` -> outputs ``idx`` (traced: inside a ``jit``).
    program: ``program(idx)`` -> the jitted function that makes outputs ``idx``.
  """
  groups: list
  outs: list
  values: Callable
  program: Callable


def maker(spec: StepSpec, meta: st.StateMeta, source: Source) -> Maker:
  """The function's trace cut into groups of leaves (`groups`), each made by its own
  ``jit`` of the trace, which computes only what the group needs: XLA keeps the random bits
  of all the leaves of a program alive at once, and a group bounds them."""
  layouts, n = meta.param_layouts, len(meta.param_layouts)
  run = jax.extend.core.jaxpr_as_fun(source.make)
  avals = source.make.out_avals
  shardings = [st.sharding(spec, l.spec(spec.data_axes)) for l in layouts]
  shardings += [st.sharding(spec, jax.sharding.PartitionSpec())] * (len(avals) - n)
  outs = [jax.ShapeDtypeStruct(layouts[i].storage_shape if i < n else a.shape, a.dtype,
                               sharding=sh) for i, (a, sh) in enumerate(zip(avals, shardings))]
  idx_groups = groups([placement.device_bytes(l, spec.n_data, a.dtype)
                       for l, a in zip(layouts, avals)])
  idx_groups[0] += list(range(n, len(avals)))

  def values(idx):
    made = [jnp.asarray(x) for x in run()]  # a Python number returned comes back as one
    return [lay.pad(made[i], layouts[i]) if i < n else made[i] for i in idx]

  def program(idx):
    return jax.jit(context.in_auto(spec, lambda: values(idx),
                                   lambda: [shardings[i].spec for i in idx]),
                   out_shardings=[shardings[i] for i in idx])
  return Maker(idx_groups, outs, values, program)


def model_state(spec: StepSpec, meta: st.StateMeta, source: Source):
  """An init function's model state (a module's variables outside ``wrt``: BatchNorm
  statistics, ``nnx.Rngs`` state), made replicated by one ``jit`` that computes nothing
  else; for a ``source`` with values, its own."""
  if source.make is None:
    return source.model_state
  make = maker(spec, meta, source)
  idx = list(range(len(meta.param_layouts), len(make.outs)))
  with context.mesh_context(spec):
    leaves = make.program(idx)() if idx else []
  return jax.tree.unflatten(jax.tree.structure(source.model_state), leaves)


def make_leaves(spec: StepSpec, make: Maker) -> list:
  """The outputs of `maker`'s programs; each is compiled, run and dropped in turn (its
  executable is not kept while the next one's leaves are made)."""
  out: list = [None] * len(make.outs)
  with context.mesh_context(spec):
    for idx in make.groups:
      for i, x in zip(idx, make.program(idx).lower().compile()()):
        out[i] = x
  return out


# ------------------------------------------------------------------ the state
def make_state(spec: StepSpec, optimizer, meta: st.StateMeta, treedef, source: Source, rng,
               loss_scale, *, donate: bool = False) -> st.TrainState:
  """The `TrainState` for ``source``, built by one ``jit`` with the state's shardings as
  ``out_shardings`` from leaves split on the mesh (see the module docstring).

  Copies made here are donated to that ``jit`` (so that the state reuses their
  buffers where it can); the user's arrays only with ``donate``.
  """
  layouts, n = meta.param_layouts, len(meta.param_layouts)
  rep = st.sharding(spec, jax.sharding.PartitionSpec())
  ms_def = jax.tree.structure(source.model_state)
  make = None
  if source.make is None:
    placed = [place(spec, x, l) for x, l in zip(jax.tree.leaves(source.params), layouts)]
    leaves, ours = [x for x, _ in placed], [o for _, o in placed]
    model_state = context.device_put(source.model_state, rep)
    stored = [False] * n
  else:
    make = maker(spec, meta, source)
    leaves, model_state = make.outs[:n], jax.tree.unflatten(ms_def, make.outs[n:])
    ours = stored = [True] * n
  inline = make is not None and len(make.groups) == 1  # small: made inside the init jit
  give = [] if inline else [i for i, o in enumerate(ours) if o or donate]
  keep = [] if inline else [i for i, o in enumerate(ours) if not (o or donate)]
  order = list(range(n)) if inline else give + keep
  specs = st.partition_specs(spec, meta, treedef, source.model_state, rng, loss_scale)

  def body(given, kept, model_state, rng, ls):
    if inline:
      made = make.values(make.groups[0])
      given, model_state = made[:n], jax.tree.unflatten(ms_def, made[n:])
    xs: list = [None] * n
    for i, x in zip(order, list(given) + list(kept)):
      xs[i] = lay.unpad(x, layouts[i]) if stored[i] else x
    return st.init_state(spec, optimizer, meta, treedef, xs, model_state, rng, ls)

  init = jax.jit(context.in_auto(spec, body, lambda *_: specs), donate_argnums=(0,),
                 out_shardings=st.state_shardings(spec, specs))
  extras = context.device_put((rng, loss_scale), rep)
  args = lambda xs, ms: ([xs[i] for i in give], [xs[i] for i in keep], ms, *extras)
  with context.mesh_context(spec), warnings.catch_warnings():
    # a donated copy that no output can reuse (another dtype, shape or split) is just freed
    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
    compiled = init.lower(*args(leaves, None if inline else model_state)).compile()
    if inline:
      return compiled(*args(leaves, None))
    if make is not None:
      made = make_leaves(spec, make)
      leaves, model_state = made[:n], jax.tree.unflatten(ms_def, made[n:])
    return compiled(*args(leaves, model_state))


def abstract_state(spec: StepSpec, optimizer, meta: st.StateMeta, treedef, source: Source, rng,
                   loss_scale) -> st.TrainState:
  """The `TrainState` `make_state` would return, as ``jax.ShapeDtypeStruct``s with shardings."""
  leaves = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
            for x in jax.tree.leaves(source.params)]
  specs = st.partition_specs(spec, meta, treedef, source.model_state, rng, loss_scale)
  body = lambda *args: st.init_state(spec, optimizer, meta, treedef, *args)
  with context.mesh_context(spec):
    shape = jax.eval_shape(context.in_auto(spec, body, lambda *_: specs), leaves,
                           source.model_state, rng, loss_scale)
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      shape, st.state_shardings(spec, specs))
