"""zero_jax: ZeRO-style sharded data parallelism for JAX."""

from zero_jax.clipping import clip_by_global_norm, global_norm
from zero_jax.layout import Layout, leaf_layout
from zero_jax.loss_scale import (LossScaleState, adjust_loss_scale, all_finite,
                                 dynamic_loss_scale, no_loss_scale, scale_loss,
                                 static_loss_scale, unscale_grads)
from zero_jax.precision import POLICIES, Policy
from zero_jax.train_step import (ShardedTrainStep, StateMeta, TrainState,
                                 make_sharded_train_step)

__version__ = "0.1.0"

__all__ = [
    "Layout",
    "LossScaleState",
    "POLICIES",
    "Policy",
    "ShardedTrainStep",
    "StateMeta",
    "TrainState",
    "adjust_loss_scale",
    "all_finite",
    "clip_by_global_norm",
    "dynamic_loss_scale",
    "global_norm",
    "leaf_layout",
    "make_sharded_train_step",
    "no_loss_scale",
    "scale_loss",
    "static_loss_scale",
    "unscale_grads",
]
