"""One layer's linearization, its residuals sorted by where the backward pass gets them.

`zero_jax.scan` differentiates each layer with ``jax.vjp`` in the forward loop (under
``jax.checkpoint(policy=...)`` when a policy is given) and keeps the residuals, so that the
backward loop applies the pullback instead of recomputing the layer. Each residual leaf of
the pullback (a pytree) is one of:

* **an input** (the gathered weights, a per-layer array, a closed-over value): taken again in
  the backward pass, never stored (stage 3 re-gathers the weights there);
* **carry-free** (computed from the weights and constants alone, such as a weight cast to
  the compute dtype): recomputed in the backward pass from the re-gathered weights, so that
  no layer's weights are kept for the backward pass;
* **saved**: anything that depends on the carry (the activations): stored per layer.

With ``nothing_saveable`` the only saved residuals are the carries (each layer recomputed
from its input, as ``jax.checkpoint``); with no policy, what ``jax.lax.scan`` keeps.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from zero_jax.comm.axes import make_varying, varying_axes

KEEP = None  # policy: no jax.checkpoint, keep what the linearization keeps (lax.scan's)


# jax.checkpoint_policies that make a policy from their arguments (not policies themselves).
_FACTORIES = ("save_only_these_names", "save_any_names_but_these",
              "save_anything_except_these_names", "save_and_offload_only_these_names",
              "save_from_both_policies", "offload_dot_with_no_batch_dims")


def check_policy(policy, where: str) -> None:
  """``policy=`` is None or a ``jax.checkpoint`` policy: a callable that answers when called
  as one, on a matmul."""
  factory = next((n for n in _FACTORIES
                  if policy is getattr(jax.checkpoint_policies, n, object())), None)
  if factory is not None:
    raise TypeError(
        f"{where}: policy=jax.checkpoint_policies.{factory} makes a policy from its "
        f"arguments; call it, e.g. policy=jax.checkpoint_policies.{factory}(...) with the "
        f"names (jax.ad_checkpoint.checkpoint_name) or policies it takes.")
  choose = ("pass one of jax.checkpoint_policies (e.g. jax.checkpoint_policies.dots_saveable, "
            "nothing_saveable to recompute each layer) or None to keep what jax.lax.scan keeps")
  if policy is None:
    return
  if not callable(policy):
    raise TypeError(f"{where}: policy={policy!r} is not a jax.checkpoint policy; {choose}.")
  prim, avals, params = _a_matmul()
  try:  # as jax.checkpoint calls it on each operation of the layer (a transform fails here)
    policy(prim, *avals, **params)
  except Exception as e:  # pylint: disable=broad-except
    name = f"{getattr(policy, '__module__', '')}.{getattr(policy, '__qualname__', policy)}"
    raise TypeError(
        f"{where}: policy={name} fails when called as a jax.checkpoint policy "
        f"(policy(primitive, *avals, **params), on each operation of the layer; here a "
        f"matmul): {type(e).__name__}: {str(e).rstrip('.')}. A policy says which values each "
        f"layer keeps (a transform such as jax.checkpoint is not one); {choose}.") from e


@functools.lru_cache(maxsize=None)
def _a_matmul():
  """A matmul's primitive, input avals and params, to call a policy on as jax.checkpoint does."""
  a = jax.ShapeDtypeStruct((2, 2), jnp.float32)
  eqn = jax.make_jaxpr(lambda x, y: jax.lax.dot_general(x, y, (((1,), (0,)), ((), ()))))(
      a, a).eqns[0]
  return eqn.primitive, [v.aval for v in eqn.invars], dict(eqn.params)


def _hashable(x):
  """``x`` if it can key a dict, else its ``repr`` (a jaxpr in a call's params)."""
  try:
    hash(x)
    return x
  except TypeError:
    return ("repr", repr(x))


class Decided:
  """A ``jax.checkpoint`` policy asked once per kind of operation, its answer then reused.

  `zero_jax.scan` traces each layer more than once (`plan`, the forward loop, the backward
  loop), and each trace asks the policy about every operation again. A policy whose answers
  depend on the order of the calls (one that counts them) would save other residuals in each
  trace, and the buffers planned for them would not fit. Asked through this wrapper, a
  policy answers the same for the same primitive, operand types and parameters in every
  trace; a policy that depends only on those (every one of ``jax.checkpoint_policies``)
  answers as it would alone.
  """

  def __init__(self, policy):
    self.policy = policy
    self.answers: dict = {}

  def __call__(self, prim, *avals, **params):
    key = (prim, tuple(map(_hashable, avals)),
           tuple(sorted((k, _hashable(v)) for k, v in params.items())))
    if key not in self.answers:
      self.answers[key] = self.policy(prim, *avals, **params)
    return self.answers[key]


def split(flat: list, sizes: list[int]) -> list[list]:
  """``flat`` cut into consecutive lists of ``sizes``."""
  out, at = [], 0
  for k in sizes:
    out.append(list(flat[at:at + k]))
    at += k
  return out


def is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def vma(x) -> tuple:
  """The axes an array, or a struct from ``jax.eval_shape`` inside ``shard_map``, varies over."""
  if isinstance(x, jax.ShapeDtypeStruct):  # (its aval cannot always be rebuilt: model axes)
    return tuple(sorted(getattr(x.manual_axis_type, "varying", ())))
  return tuple(sorted(varying_axes(x)))


def zeros(s, lead: tuple = ()):
  """Zeros shaped ``lead + s.shape`` with the device variance of ``s``."""
  return make_varying(jnp.zeros(lead + tuple(s.shape), s.dtype), vma(s))


def match_vma(ct, like):
  """``ct`` with the device variance of ``like`` (an array or a struct): summed over the axes
  only it varies over (the transpose of an implicit broadcast), marked varying over the
  ones it lacks."""
  if ct is None:
    return None
  want = set(vma(like))
  extra = tuple(sorted(varying_axes(ct) - want))
  ct = jax.lax.psum(ct, extra) if extra else ct
  return make_varying(ct, tuple(sorted(want)))


class Linear(NamedTuple):
  """How one layer is linearized; fixed once traced (`plan`).

  Attributes:
    fn: the layer, ``fn(*args) -> tuple of lists`` over lists of leaves.
    sizes: the length of each list of ``args`` (the first is the carry).
    diff: which flat input leaves are differentiated.
    policy: the ``jax.checkpoint`` policy, or `KEEP`.
    source: per residual leaf: ``("input", k)`` (flat input k), ``("free", None)``
      (recomputed from the inputs other than the carry) or ``("saved", k)`` (buffer k).
    saved: the saved residuals' shapes (one layer's).
    host: which saved residuals a policy offloads to host memory
      (``save_and_offload_only_these_names``): their buffers are in host memory too.
    outs: the flat outputs' shapes.
    treedef: the pullback's tree structure.
  """
  fn: Callable
  sizes: tuple
  diff: tuple
  policy: Any
  source: tuple = ()
  saved: tuple = ()
  host: tuple = ()
  outs: tuple = ()
  treedef: Any = None

  def vjp(self, flat: list):
    """``(flat outputs, pullback)`` of ``fn`` at the flat inputs ``flat``."""
    def part(*d):
      it = iter(d)
      full = [next(it) if m else a for a, m in zip(flat, self.diff)]
      return sum(map(list, self.fn(*split(full, list(self.sizes)))), [])
    if self.policy is not KEEP:
      part = jax.checkpoint(part, policy=self.policy, prevent_cse=False)
    return jax.vjp(part, *[a for a, m in zip(flat, self.diff) if m])

  def forward(self, args: list[list]) -> tuple[list, list]:
    """The flat outputs and the residuals to save for the backward pass."""
    flat = sum(args, [])
    outs, pull = self.vjp(flat)
    res = jax.tree.leaves(pull)
    return list(outs), [res[j] for j, (kind, _) in enumerate(self.source) if kind == "saved"]

  def backward(self, args: list[list], saved: list, cts: list) -> list[list]:
    """The gradients of the differentiated inputs (None elsewhere) given the outputs'
    cotangents ``cts`` (None: zero). ``args`` holds the inputs again, with zeros for the
    carry (the carry-free residuals do not read it)."""
    flat = sum(args, [])
    res = []
    if any(kind == "free" for kind, _ in self.source):
      res = jax.tree.leaves(self.vjp(flat)[1])  # only its carry-free ones are used
    take = {"input": lambda k, j: flat[k], "free": lambda k, j: res[j],
            "saved": lambda k, j: saved[k]}
    pull = jax.tree.unflatten(self.treedef, [take[kind](k, j)
                                        for j, (kind, k) in enumerate(self.source)])
    cts = [np.zeros(o.shape, jax.dtypes.float0) if not is_float(o) else
           match_vma(jnp.zeros(o.shape, o.dtype) if ct is None else ct, o)
           for o, ct in zip(self.outs, cts)]
    got = iter(pull(cts))
    return split([next(got) if m else None for m in self.diff], list(self.sizes))


def plan(fn: Callable, args: list[list], diff: list[list], policy) -> Linear:
  """`Linear` for ``fn`` at ``args`` (traced once, nothing computed): which residuals are
  inputs, carry-free or saved."""
  lin = Linear(fn, tuple(map(len, args)), tuple(sum(diff, [])),
               policy if policy is KEEP else Decided(policy))
  flat, n_carry = sum(args, []), len(args[0])
  found: dict = {}

  def residuals(*flat):
    outs, pull = lin.vjp(list(flat))
    res, found["treedef"] = jax.tree.flatten(pull)
    ids = {id(a): k for k, a in enumerate(flat) if k >= n_carry}
    found["input"] = [ids.get(id(r)) for r in res]
    return outs, res

  closed = jax.make_jaxpr(residuals)(*flat)
  n_outs = len(closed.out_avals) - len(found["input"])
  uses_carry = _depends(closed.jaxpr, [k < n_carry for k in range(len(flat))])[n_outs:]
  shapes = jax.eval_shape(residuals, *flat)
  spaces = [a.memory_space for a in closed.out_avals[n_outs:]]
  source, saved, host = [], [], []
  for j, (k, carry) in enumerate(zip(found["input"], uses_carry)):
    if k is not None:
      source.append(("input", k))
    elif not carry:
      source.append(("free", None))
    else:
      source.append(("saved", len(saved)))
      saved.append(shapes[1][j])
      host.append(spaces[j] == jax.memory.Space.Host)
  return lin._replace(source=tuple(source), saved=tuple(saved), host=tuple(host),
                      outs=tuple(shapes[0]),
                      treedef=found["treedef"])


def buffers(lin: Linear, length: int) -> list:
  """Zeroed buffers for ``length`` layers' saved residuals (in host memory where offloaded)."""
  bufs = [zeros(s, (length,)) for s in lin.saved]
  return [jax.device_put(b, jax.memory.Space.Host) if h else b for b, h in zip(bufs, lin.host)]


def _depends(jaxpr, marked: list[bool]) -> list[bool]:
  """Which outputs of ``jaxpr`` may depend on its inputs marked in ``marked``: through the
  jaxprs of calls (``jit``, ``checkpoint``, custom derivatives) output by output, through
  any other equation (a loop, a branch) from all its inputs (never too few)."""
  dep = dict(zip(jaxpr.invars, marked))
  of = lambda v: not isinstance(v, jex_core.Literal) and dep.get(v, False)
  for eqn in jaxpr.eqns:
    ins = list(map(of, eqn.invars))
    inner = _called(eqn)
    if inner is not None and len(inner.invars) == len(ins) and len(inner.outvars) == len(
        eqn.outvars):
      outs = _depends(inner, ins)
    else:
      outs = [any(ins)] * len(eqn.outvars)
    for o, d in zip(eqn.outvars, outs):
      dep[o] = d
  return [of(v) for v in jaxpr.outvars]


def _called(eqn):
  """The jaxpr a call-like equation runs on its own inputs, or None."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    inner = eqn.params.get(key)
    if inner is not None and eqn.primitive.name not in ("scan", "while", "cond"):
      return getattr(inner, "jaxpr", inner)
  return None
