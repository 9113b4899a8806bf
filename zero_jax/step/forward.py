"""The step's forward pass on the split state, without a gradient or an update.

`evaluate` is ``step.evaluate(state, batch)``: the step's loss (and aux) for a batch, computed
by the same pieces as the training step (`zero_jax.step.grads`, `zero_jax.step.loss_call`): the
batch split over the batch axes and into ``grad_accum_steps`` micro-batches in a ``lax.scan``,
each micro-batch's parameters
gathered as the step's loss gathers them (stage 3: stacked leaves left split for `zero_jax.scan`
/ `zero_jax.gather`; hpZ and quantized gathers as configured; under bf16/fp16 the compute-dtype
values, at stage 3 the float32 master cast as it is gathered: a stacked leaf a layer at a time),
the loss reduced as the step reduces it (`WeightedLoss` over the global batch, aux by its
rules). `apply` is ``step.apply(state, fn, *args)``: any other forward use (logits,
sampling) on the parameters as the loss sees them. Both leave the state as it was: NNX modules
run as ``model.eval()`` sets them and whatever they or a loss change is dropped.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax.comm.axes import make_varying, varying_axes
from zero_jax.layers import nnx as nnx_lib
from zero_jax.step import aux as aux_lib
from zero_jax.step import batch as batching
from zero_jax.step import context
from zero_jax.step import grads as grads_lib
from zero_jax.step import loss_call as lc
from zero_jax.step.loss import check_keywords
from zero_jax.step.spec import StepSpec

METRICS = ("loss", "step")


def _local_metrics(spec: StepSpec, loss_fn, state, batch) -> grads_lib.Local:
  """On each device inside the loss's ``shard_map``: the micro-batches' losses (every one
  from the state's model state; the new model state is dropped), agreed over the devices."""
  meta, k, axes = state.meta, spec.grad_accum_steps, spec.batch_axes

  def micro(mb, _, j):
    params = lc.forward_params(spec, meta, state.params)  # per micro-batch, as the step
    key, ms = grads_lib.micro_inputs(state, state.model_state, j, axes)
    out, w = lc.loss_call(spec, meta, loss_fn, params, mb, ms, key)
    return ((),) + grads_lib.micro_results(spec, out, w, mb) + (None,)

  _, total, ws, aux, _ = grads_lib.micro_batches(micro, batch, None, k)
  out = grads_lib.agreed([], total, ws, aux_lib.finish(aux, k, axes), None, None, k, axes)
  return out._replace(weight=None)


def sharded_metrics(spec: StepSpec, loss_fn, state, batch) -> grads_lib.Local:
  """The loss (replicated) and aux (combined as the step combines it) of ``loss_fn`` on
  the global ``batch`` (split over the batch axes), with the parameters of ``state``."""
  axes = spec.batch_axes
  inputs, in_specs = grads_lib.loss_inputs(spec, state)
  local = jax.shard_map(lambda s, b: _local_metrics(spec, loss_fn, s, b), mesh=spec.auto_mesh,
                        axis_names=set(axes), in_specs=(in_specs, P(axes)),
                        out_specs=grads_lib.Local([], P(), P(axes), P(), P()))
  return grads_lib.with_aux_reduced(spec, local(inputs, batch))


def evaluate(spec: StepSpec, loss_fn, state, batch) -> dict:
  """``{"loss", "step"[, "aux"]}`` of ``loss_fn`` on ``batch`` (see the module docstring),
  traced in Auto mode (`zero_jax.step.context.in_auto`)."""
  aux_specs: dict = {}

  def body(state, batch):
    out = sharded_metrics(spec, loss_fn, state, batch)
    metrics = {"loss": out.loss, "step": state.step}
    if spec.has_aux:
      metrics["aux"] = out.aux
      if "metrics" in aux_specs:
        aux_specs["metrics"]["aux"] = out.aux_specs
    return metrics

  def out_specs(state, batch):  # replicated scalars; aux's specs are set by body
    del state, batch
    aux_specs["metrics"] = dict.fromkeys(METRICS + (("aux",) if spec.has_aux else ()), P())
    return aux_specs["metrics"]
  return context.in_auto(spec, body, out_specs)(state, batch)


# ----------------------------------------------------------------------- apply
def check_fn(fn) -> None:
  """Raises TypeError for a ``step.apply`` function that is not callable."""
  if not callable(fn):
    raise TypeError(f"step.apply(state, fn, *args): fn must be callable, got "
                    f"{type(fn).__name__}; e.g. step.apply(state, lambda model, x: model(x), x).")


def place_args(spec: StepSpec, args: tuple, *, split_args: bool) -> tuple:
  """``step.apply``'s args, checked (`check_args`; with ``split_args`` as a batch whose rows
  split over the batch axes) and placed: split over the batch axes, or replicated (as they
  are when traced, inside the user's jit)."""
  check_args(args)
  if split_args:
    batching.check_batch(spec, args, name="args", micro=False)
    return batching.place_batch(spec, args)
  if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
    return args
  return context.device_put(args, NamedSharding(spec.working_mesh(), P()))


def check_args(args) -> None:
  """Raises TypeError naming the first leaf of ``step.apply``'s ``args`` that is not an array."""
  for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
      raise TypeError(
          f"step.apply: args{jax.tree_util.keystr(path)} is a {type(x).__name__} ({x!r}), not "
          f"an array; every leaf of the arguments after fn is traced as an array. Pass arrays "
          f"(jnp.asarray(...)), and bind Python values that fix shapes or loop lengths into fn "
          f"instead (functools.partial(fn, max_len=16), or a closure).")


def warn_if_remade(fn, seen: dict) -> None:
  """Warns once per code object when ``fn`` is a new function object made from the code of
  one `apply` compiled before (a lambda written in the loop that calls ``step.apply``): each
  new object compiles again and its program is kept. ``seen``: code -> [function, warned]."""
  code = getattr(fn, "__code__", None)
  if code is None:
    return
  entry = seen.setdefault(code, [fn, False])
  if entry[0] is fn or entry[1]:
    return
  entry[1] = True
  warnings.warn(
      f"step.apply got a new function object made from the same code as one it compiled "
      f"before ({code.co_name} at {code.co_filename}:{code.co_firstlineno}): apply compiles "
      f"once per function object, so each new one compiles again and its program is kept. "
      f"Define the function once, outside the loop, and pass the same object each call "
      f"(values that change go in *args).", UserWarning, stacklevel=3)


def _check_outputs(out, split: bool) -> None:
  """Raises TypeError naming a leaf of ``fn``'s output that ``apply`` cannot return."""
  for path, y in jax.tree_util.tree_flatten_with_path(out)[0]:
    where = f"fn's output{jax.tree_util.keystr(path)}"
    if not isinstance(y, (jax.Array, np.ndarray, np.generic)):
      raise TypeError(
          f"step.apply: {where} is a {type(y).__name__} ({y!r}), not an array; fn runs "
          f"inside the step's compiled program, which returns arrays only. Return "
          f"jnp.asarray(...) for numbers, and compute other values outside step.apply.")
    if split and not np.shape(y):
      raise ValueError(
          f"step.apply(..., split_args=True): {where} is a scalar, but with split_args each "
          f"device's outputs are concatenated along their leading dimension (one row per "
          f"row of the args). Return per-row values (e.g. per-example losses, not their "
          f"mean), or call step.apply without split_args (every device computes the whole "
          f"output).")


def _call(fn, params, model_state, module, args):
  """``fn`` on the parameters as the loss sees them: a module (in eval mode, see the module
  docstring) or the params tree (with ``model_state=`` where the state has one)."""
  if module is not None:
    model = nnx_lib.merge(module, params, model_state)
    nnx_lib.eval_mode(model)
    return fn(model, *args)
  if model_state is None:
    return fn(params, *args)
  check_keywords(fn, {"model_state": model_state}, names=("model_state",))
  return fn(params, *args, model_state=model_state)


def apply(spec: StepSpec, fn: Callable, state, args: tuple, *, split_args: bool) -> Any:
  """``fn(params_or_model, *args)`` on the split ``state`` (see `ShardedTrainStep.apply`):
  inside a ``shard_map`` over the batch axes, ``args`` replicated (every device computes the
  whole output, which comes back replicated) or, with ``split_args``, split along their
  leading dimension over the batch axes (outputs concatenated back in order)."""
  axes, meta = spec.batch_axes, state.meta
  inputs, in_specs = grads_lib.loss_inputs(spec, state)

  out_spec = P(axes) if split_args else P()

  def local(inputs, args):
    params = lc.forward_params(spec, meta, inputs.params)
    out = _call(fn, params, inputs.model_state, meta.module, args)
    _check_outputs(out, split_args)
    return jax.tree.map(lambda y: make_varying(y, axes) if split_args else _replicated(y, axes),
                        out)

  def body(inputs, args):
    out = jax.shard_map(local, mesh=spec.auto_mesh, axis_names=set(axes),
                        in_specs=(in_specs, out_spec), out_specs=out_spec)(inputs, args)
    return jax.tree.map(lambda y: spec.constrain(y, out_spec), out)

  return context.in_auto(spec, body, lambda *_: out_spec)(inputs, args)


def _replicated(y, axes):
  """An output of replicated args, as every device holds it: as it is when it does not vary
  over the batch axes (the usual case: the args are replicated and the parameters gathered
  invariant), else the first device's, gathered to every device."""
  vary = tuple(a for a in axes if a in varying_axes(y))
  if not vary:
    return y
  return jax.lax.all_gather(y, vary, axis=0, tiled=False, to="invarying")[0]
