"""The step's options, validated once into a small frozen, hashable description.

Each mesh axis gets a role: data (``axis_name=``: batch and state split over it), replica
(``replica_axis=``: batch split, state replicated) or model (the user's, e.g. tensor
parallelism via ``param_specs=``). Errors name the option, what was given and how to fix it,
and are raised when the step is built. See the docs' "How it works" and meshes guide."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zero_jax.comm import layout as lay
from zero_jax.step.aux import parse_aux_reduce
from zero_jax.step import placement
from zero_jax.comm.blocks import MAX_BLOCK_SIZE
from zero_jax.comm.collectives import DEFAULT_BUCKET_BYTES, Comm, Quantize

from zero_jax.numerics import loss_scale as ls
from zero_jax.numerics.precision import Policy, get_policy

OFFLOAD_CHOICES = (None, "optimizer")


def _axis_tuple(value, option: str, mesh: Mesh) -> tuple[str, ...]:
  """A name, a tuple of names or None -> a tuple of mesh axes in mesh order."""
  if value is None:
    return ()
  names = (value,) if isinstance(value, str) else value
  if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
    raise TypeError(f"{option}={value!r}: pass a mesh axis name or a tuple of them.")
  for a in names:
    if a not in mesh.axis_names:
      what = f"{option}={value!r}" if isinstance(value, str) else f"{option}={value!r}: {a!r}"
      raise ValueError(
          f"{what} is not an axis of the mesh, whose axes are "
          f"{tuple(mesh.axis_names)}; pass {option}= one of them (or a tuple), or build the "
          f"mesh with that axis, e.g. jax.make_mesh((n,), ({a!r},)).")
  if len(set(names)) != len(names):
    raise ValueError(f"{option}={value!r} names an axis twice.")
  return tuple(a for a in mesh.axis_names if a in names)


def _positive_int(value, option: str) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"{option} must be a positive int, got {value!r}.")
  return int(value)


def parse_loss_scale(loss_scale, policy: Policy) -> ls.LossScaleState:
  """``loss_scale=`` (None, a name, a number or a state) -> a `LossScaleState`."""
  if loss_scale is None:
    loss_scale = "dynamic" if policy.dynamic_loss_scale else "none"
  if isinstance(loss_scale, str):
    makers = {"dynamic": ls.dynamic_loss_scale, "none": ls.no_loss_scale}
    if loss_scale not in makers:
      raise ValueError(f"loss_scale={loss_scale!r}: pass 'dynamic', 'none', a number "
                       f"(static scale) or a zero_jax.LossScaleState.")
    return makers[loss_scale]()
  if isinstance(loss_scale, ls.LossScaleState):
    return loss_scale
  if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, bool):
    return ls.static_loss_scale(float(loss_scale))
  if isinstance(loss_scale, (np.ndarray, jax.Array)) and np.shape(loss_scale) == ():
    return ls.static_loss_scale(float(loss_scale))
  raise TypeError(f"loss_scale must be None, 'dynamic', 'none', a number or a "
                  f"LossScaleState; got {type(loss_scale).__name__}.")


def _comm_dtype(comm_dtype, stage: int):
  if comm_dtype is None:
    return None
  if stage == 3:
    raise ValueError("comm_dtype applies to stages 1-2; at stage 3 the gradient is "
                     "reduce-scattered by the transpose of the parameter all-gather, in the "
                     "parameter dtype (choose precision='bf16' to halve it), so drop "
                     "comm_dtype or use stage=2.")
  try:
    dt = jnp.dtype(comm_dtype)
  except TypeError as e:
    raise TypeError(f"comm_dtype={comm_dtype!r} is not a dtype; pass e.g. jnp.bfloat16.") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"comm_dtype={dt.name}: gradients are summed on the wire, which needs a "
                     f"floating dtype; pass jnp.bfloat16, jnp.float16 or jnp.float32 (or None "
                     f"for the gradient's own dtype).")
  return dt


def _check_offload(offload, mesh: Mesh):
  if offload not in OFFLOAD_CHOICES:
    raise ValueError(f"offload={offload!r}: choose None (everything on the devices) or "
                     f"'optimizer' (optimizer state and master copy in pinned host memory "
                     f"between steps).")
  if offload is not None:
    placement.check_backend(mesh)


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """What a step does, validated (static and hashable). Made by `make_spec`.

  Attributes:
    mesh: the user's mesh (any axis types).
    auto_mesh: the same devices and axes, every axis Auto: what the step's
      sharding constraints and ``shard_map``s are written against.
    data_axes: the axes the batch and the ZeRO state are split over.
    replica_axes: the axes the batch is split over and the state replicated.
    model_axes: the user's axes (left to the compiler inside the step).
    stage, has_aux, max_grad_norm, grad_accum_steps, accumulate, donate,
    offload, gather_once: the options of `make_sharded_train_step`.
    comm: the communication record (`zero_jax.comm.collectives.Comm`): axes of
      each hop, ``comm_dtype``, ``bucket_bytes``, ``hpz_axis``, ``quantize``.
    aux_reduce: ``aux_reduce=`` validated (`zero_jax.step.aux.parse_aux_reduce`).
    policy: the precision `Policy`.
  """
  mesh: Mesh
  auto_mesh: Mesh
  data_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]
  model_axes: tuple[str, ...]
  stage: int
  policy: Policy
  has_aux: bool
  max_grad_norm: float | None
  grad_accum_steps: int
  accumulate: str
  donate: bool
  offload: str | None
  comm: Comm
  gather_once: bool = False
  aux_reduce: Any = None

  @property
  def comm_dtype(self) -> np.dtype | None:
    return self.comm.reduce_dtype

  @property
  def bucket_bytes(self) -> int:
    return self.comm.bucket_bytes

  @property
  def gather_axes(self) -> tuple[str, ...]:
    """The axes a stage-3 parameter is stored split over and gathered over (hpZ: the
    axes within a host; otherwise every data axis)."""
    return self.comm.gather_axes

  @property
  def param_stage(self) -> int:
    """The stage the loss sees parameters at: 2 when ``gather_once`` gathers them whole
    before the loss (stage 3's storage, stage 2's gradient path)."""
    return 2 if self.gather_once else self.stage

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes the batch is split over (replica and data), in mesh order."""
    return tuple(a for a in self.mesh.axis_names if a in self.data_axes + self.replica_axes)

  @property
  def n_data(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.data_axes)

  @property
  def n_gather(self) -> int:
    """Devices a stage-3 parameter is split over (hpZ: within a host)."""
    return math.prod(self.mesh.shape[a] for a in self.gather_axes)

  @property
  def n_batch(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.batch_axes)

  @property
  def explicit(self) -> bool:
    """Whether the user's mesh has Explicit axes (the step then runs in ``auto_axes``)."""
    return any(t == AxisType.Explicit for t in self.mesh.axis_types)

  def in_user_context(self) -> bool:
    """Whether the current mesh context is the user's mesh (``with jax.set_mesh(mesh)``)."""
    return jax.sharding.get_abstract_mesh() == self.mesh.abstract_mesh

  def working_mesh(self) -> Mesh:
    """The mesh the state and outputs live on for a call made now.

    Inside ``jax.set_mesh(mesh)`` it is the user's mesh (Explicit axes stay
    Explicit, as JAX code in that context expects); elsewhere it is the Auto
    view of the same devices, whose arrays mix freely with any other arrays.
    The two differ only in axis types; moving between them copies nothing.
    """
    return self.mesh if self.in_user_context() else self.auto_mesh

  def axis_sizes(self) -> dict[str, int]:
    return {a: int(self.mesh.shape[a]) for a in self.mesh.axis_names}

  # Inside the step (Auto mode): sharding constraints and the two views of a leaf.
  def constrain(self, x, pspec: P):
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.auto_mesh, pspec))

  def to_storage(self, x, layout: lay.Layout):
    """Logical view -> padded storage view, split as it is kept between steps."""
    return self.constrain(lay.pad(x, layout), layout.spec(self.data_axes))

  def to_logical(self, x, layout: lay.Layout):
    """Storage view -> logical view, still split (what the optimizer sees)."""
    return self.constrain(lay.unpad(x, layout), layout.spec(self.data_axes))


def planning_spec(*, n_devices=None, mesh=None, axis_name="data", replica_axis=None,
                  precision="fp32", comm_dtype=None, hpz_axis=None) -> StepSpec:
  """A `StepSpec` for reasoning about layouts without devices (`zero_jax.memory_report`).

  Either ``n_devices`` (one data axis of that size, as many devices as you
  plan for, not as this machine has) or a ``mesh`` (concrete or abstract,
  with the step's ``axis_name`` and ``replica_axis``).
  """
  if (n_devices is None) == (mesh is None):
    raise ValueError("pass either n_devices= (devices on one data axis) or mesh= (with "
                     "axis_name= and replica_axis= as for the step), not both or neither.")
  if mesh is None:
    if isinstance(n_devices, bool) or not isinstance(n_devices, numbers.Integral) or \
        n_devices < 1:
      raise ValueError(f"n_devices must be a positive int, got {n_devices!r}.")
    mesh, axis_name, replica_axis = (
        jax.sharding.AbstractMesh((int(n_devices),), ("data",), axis_types=(AxisType.Auto,)),
        "data", None)
  if not isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got "
                    f"{type(mesh).__name__}.")
  data = _axis_tuple(axis_name, "axis_name", mesh)
  replica = _axis_tuple(replica_axis, "replica_axis", mesh)
  model = tuple(a for a in mesh.axis_names if a not in data + replica)
  inner = data if hpz_axis is None else _hpz_axes(hpz_axis, mesh, 3, data, replica, False)
  comm = Comm(inner, tuple(a for a in data if a not in inner), replica,
              _comm_dtype(comm_dtype, 2), bf16_sums_in_f32=_cpu_with_model_axes(mesh, model))
  return StepSpec(mesh=mesh, auto_mesh=mesh, data_axes=comm.data_axes, replica_axes=replica,
                  model_axes=model, stage=2, policy=get_policy(precision), has_aux=False,
                  max_grad_norm=None, grad_accum_steps=1, accumulate="local", donate=True,
                  offload=None, comm=comm)


def make_spec(*, mesh, axis_name, replica_axis, stage, has_aux, precision, max_grad_norm,
              grad_accum_steps, accumulate, comm_dtype, donate, offload,
              bucket_bytes=DEFAULT_BUCKET_BYTES, gather_once=False, hpz_axis=None,
              quantize=None, aux_reduce=None) -> StepSpec:
  """Validates the options of `make_sharded_train_step` (see there)."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a concrete jax.sharding.Mesh (e.g. jax.make_mesh(("
                    f"jax.device_count(),), ('data',))); got {type(mesh).__name__}.")
  data = _axis_tuple(axis_name, "axis_name", mesh)
  if not data:
    raise ValueError("axis_name must name at least one mesh axis to split the state over.")
  replica = _axis_tuple(replica_axis, "replica_axis", mesh)
  both = sorted(set(data) & set(replica))
  if both:
    raise ValueError(
        f"replica_axis={replica_axis!r} and axis_name={axis_name!r} both name {both}: an axis "
        f"either splits the optimizer state (axis_name) or replicates it (replica_axis), not "
        f"both. For hybrid sharding put the axes within a host in axis_name and the axes "
        f"across hosts in replica_axis, e.g. axis_name='data', replica_axis='replica'.")
  if isinstance(stage, bool) or stage not in (1, 2, 3):
    raise ValueError(f"stage={stage!r}: choose 1 (optimizer state sharded), 2 (and "
                     f"gradients) or 3 (and parameters).")
  policy = get_policy(precision)
  k = _positive_int(grad_accum_steps, "grad_accum_steps")
  if accumulate is None:
    accumulate = "sharded" if stage == 3 else "local"
  if accumulate not in ("local", "sharded"):
    raise ValueError(f"accumulate={accumulate!r}: choose 'local' (accumulate full "
                     f"gradients locally, reduce once) or 'sharded' (reduce-scatter each "
                     f"micro-batch, keep a 1/N accumulator).")
  if stage == 1 and accumulate == "sharded":
    raise ValueError("accumulate='sharded' reduce-scatters gradients, which is stage 2; "
                     "use stage=2, or accumulate='local' with stage=1.")
  if stage == 3 and accumulate == "local" and not gather_once:
    raise ValueError("stage=3 differentiates through the parameter all-gather, whose "
                     "transpose reduce-scatters every micro-batch; use accumulate='sharded' "
                     "(the default for stage 3), gather_once=True (parameters whole for the "
                     "step) or stage=2.")
  if max_grad_norm is not None:
    if not isinstance(max_grad_norm, numbers.Real) or not max_grad_norm > 0:
      raise ValueError(f"max_grad_norm must be a positive number or None, got "
                       f"{max_grad_norm!r}.")
    max_grad_norm = float(max_grad_norm)
  _check_offload(offload, mesh)
  if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Integral) or \
      bucket_bytes < 0:
    raise ValueError(f"bucket_bytes must be a non-negative int (0: one collective per leaf), "
                     f"got {bucket_bytes!r}.")
  if gather_once and stage != 3:
    raise ValueError(f"gather_once=True keeps stage 3's gathered parameters for the whole "
                     f"step; at stage {stage} the parameters are whole already. Drop "
                     f"gather_once, or use stage=3.")
  auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
  model = tuple(a for a in mesh.axis_names if a not in data + replica)
  inner = _hpz_axes(hpz_axis, mesh, stage, data, replica, gather_once)
  quantize = _quantize(quantize, stage, policy, inner != data, replica,
                       [mesh.shape[a] for a in data + replica])
  comm = Comm(inner, tuple(a for a in data if a not in inner), replica,
              _comm_dtype(comm_dtype, stage), int(bucket_bytes), quantize,
              bf16_sums_in_f32=_cpu_with_model_axes(mesh, model))
  return StepSpec(mesh=mesh, auto_mesh=auto, data_axes=comm.data_axes, replica_axes=replica,
                  model_axes=model, stage=stage, policy=policy, has_aux=bool(has_aux),
                  max_grad_norm=max_grad_norm, grad_accum_steps=k, accumulate=accumulate,
                  donate=bool(donate), offload=offload, comm=comm,
                  gather_once=bool(gather_once),
                  aux_reduce=parse_aux_reduce(aux_reduce, bool(has_aux)))


def _cpu_with_model_axes(mesh, model) -> bool:
  """Whether the step's ``shard_map`` leaves axes to XLA:CPU (`Comm.bf16_sums_in_f32`)."""
  return bool(model) and isinstance(mesh, Mesh) and mesh.devices.flat[0].platform == "cpu"


def _hpz_axes(hpz_axis, mesh: Mesh, stage: int, data, replica, gather_once) -> tuple:
  """``hpz_axis=`` -> the gather axes: a proper subset of the data axes (stage 3)."""
  if hpz_axis is None:
    return data
  inner = _axis_tuple(hpz_axis, "hpz_axis", mesh)
  if not inner:
    raise ValueError(f"hpz_axis={hpz_axis!r} names no axis: the secondary copy would be "
                     f"split over no device, a whole replica of the parameters on each, and "
                     f"stage 3's saving would be gone. Name the data axes within a host, e.g. "
                     f"hpz_axis='data', or drop hpz_axis (hpz_axis=None).")
  if stage != 3 or gather_once:
    raise ValueError(f"hpz_axis={hpz_axis!r} keeps stage 3's secondary copy of the parameters "
                     f"split within a host; at stage {stage}"
                     f"{' with gather_once=True' if gather_once else ''} the parameters are "
                     f"gathered whole for the step. Use stage=3 (without gather_once), or drop "
                     f"hpz_axis.")
  wrong = [a for a in inner if a not in data]
  if wrong:
    role = "a replica axis (the state is not split over it)" if wrong[0] in replica else \
        "not a data axis (axis_name=)"
    raise ValueError(f"hpz_axis={hpz_axis!r}: {wrong[0]!r} is {role}. hpZ gathers the "
                     f"parameters over data axes within a host: put every axis in "
                     f"axis_name=, e.g. axis_name=('replica', 'data'), and name the "
                     f"intra-host one in hpz_axis='data'.")
  if set(inner) == set(data):
    raise ValueError(f"hpz_axis={hpz_axis!r} names every data axis {data}: the secondary "
                     f"copy would be the primary one. Name only the axes within a host, and "
                     f"add the axes across hosts to axis_name=.")
  return inner


def _quantize(quantize, stage: int, policy: Policy, hpz: bool, replica, sizes):
  """``quantize=`` -> a validated `Quantize` record, or None."""
  if quantize is None:
    return None
  if not isinstance(quantize, Quantize):
    raise TypeError(f"quantize must be a zero_jax.Quantize(weights=..., grads=..., "
                    f"block_size=...) or None, got {type(quantize).__name__}.")
  bs, bits = quantize.block_size, quantize.grad_bits
  if isinstance(bs, bool) or not isinstance(bs, numbers.Integral) or bs < 2 or bs % 2:
    raise ValueError(f"Quantize(block_size={bs!r}): pass a positive even int (elements per "
                     f"scale; 256 is the default, int4 packs two values a byte).")
  if bs > MAX_BLOCK_SIZE:
    raise ValueError(f"Quantize(block_size={bs}): at most {MAX_BLOCK_SIZE}. A larger block "
                     f"saves under 0.01% of the bytes (one 4-byte scale per block) while the "
                     f"rounding error grows with the block, and a leaf shorter than the block "
                     f"is one block anyway; pass 256 to 4096.")
  if bits not in (8, 4):
    raise ValueError(f"Quantize(grad_bits={bits!r}): choose 8 or 4.")
  if not (quantize.weights or quantize.grads):
    return None
  if not any(mesh_size > 1 for mesh_size in sizes):
    raise ValueError("quantize= changes what the collectives send, and this step's data and "
                     "replica axes have one device: nothing is sent. Drop quantize=, or "
                     "build the mesh over several devices.")
  if quantize.grads and stage == 1:
    raise ValueError("Quantize(grads=True) quantizes the gradient reduce-scatter, and stage 1 "
                     "all-reduces whole gradients: use stage=2 or 3, or grads=False.")
  if quantize.weights and stage != 3 and policy.master_dtype is None:
    raise ValueError(
        f"Quantize(weights=True) at stage {stage} all-gathers int8 parameters into the "
        f"replicated copy the loss sees, so the update needs an exact copy elsewhere: a "
        f"master copy. precision={policy.name!r} keeps none; use precision='bf16' (fp32 "
        f"master copy, sharded), stage=3 (exact blocks, only the gathers are rounded), or "
        f"weights=False.")
  if quantize.weights and hpz and policy.master_dtype is None:
    raise ValueError(
        f"Quantize(weights=True) with hpz_axis= refreshes the secondary copy in int8, so "
        f"the update needs an exact copy elsewhere: a master copy. precision="
        f"{policy.name!r} keeps none; use precision='bf16', or Quantize(weights=False), or "
        f"drop hpz_axis.")
  if quantize.across_only and not (hpz or replica):
    raise ValueError("Quantize(across_only=True) quantizes only hops across hosts (the "
                     "replica axes and the data axes outside hpz_axis=), and this step has "
                     "none: name them (replica_axis= or hpz_axis=), or across_only=False.")
  return quantize
