"""zero_jax: ZeRO-style sharded data parallelism for JAX."""

from zero_jax.checkpoint import (CheckpointManager, DamagedCheckpointError,
                                 DamagedCheckpointWarning, DirectoryInUseError, export_params,
                                 export_safetensors, load_safetensors)
from zero_jax.checkpoint.preemption import Preemption, watch_preemption
from zero_jax.numerics.clipping import clip_by_global_norm, global_norm
from zero_jax.comm.collectives import Quantize
from zero_jax.comm.layout import Layout, leaf_layout
from zero_jax.gpu.plan import Candidate, Plan, plan
from zero_jax.gpu.targets import compile_only_mesh
from zero_jax.processes.distributed import (LOST_PEER_EXIT_CODE, initialize_distributed,
                                  is_main_process, metrics_to_host, print_main)
from zero_jax.processes.global_batch import make_global_batch, process_batch_slice
from zero_jax.processes.launch import launch_local
from zero_jax.layers.stacking import stack_layers, unstack_layers
from zero_jax.step.loss import WeightedLoss
from zero_jax.numerics.loss_scale import (LossScaleState, adjust_loss_scale, all_finite,
                                 dynamic_loss_scale, no_loss_scale, scale_loss,
                                 static_loss_scale, unscale_grads)
from zero_jax.step.memory import CompiledMemory, MemoryReport, compiled_memory, memory_report
from zero_jax.numerics.precision import POLICIES, Policy
from zero_jax.layers.lookup import take
from zero_jax.layers.prefetch import scan
from zero_jax.layers.stacked import ShardedParam, gather
from zero_jax.step.state import StateMeta, TrainState
from zero_jax.step.train_step import ShardedTrainStep, make_sharded_train_step

__version__ = "0.1.0"

__all__ = [
    "Candidate",
    "CheckpointManager",
    "CompiledMemory",
    "DamagedCheckpointError",
    "DamagedCheckpointWarning",
    "DirectoryInUseError",
    "LOST_PEER_EXIT_CODE",
    "Layout",
    "LossScaleState",
    "MemoryReport",
    "POLICIES",
    "Plan",
    "Policy",
    "Preemption",
    "Quantize",
    "ShardedParam",
    "ShardedTrainStep",
    "StateMeta",
    "TrainState",
    "WeightedLoss",
    "adjust_loss_scale",
    "all_finite",
    "clip_by_global_norm",
    "compile_only_mesh",
    "compiled_memory",
    "dynamic_loss_scale",
    "export_params",
    "export_safetensors",
    "gather",
    "global_norm",
    "initialize_distributed",
    "is_main_process",
    "launch_local",
    "leaf_layout",
    "load_safetensors",
    "make_global_batch",
    "make_sharded_train_step",
    "memory_report",
    "metrics_to_host",
    "no_loss_scale",
    "plan",
    "print_main",
    "process_batch_slice",
    "scale_loss",
    "scan",
    "stack_layers",
    "static_loss_scale",
    "take",
    "unscale_grads",
    "unstack_layers",
    "watch_preemption",
]
