"""Checkpoints and weights on disk: every file is written from the shards where they lie.

One module a job: `manager` (`CheckpointManager`: save, restore, keep the last few),
`format` (what a checkpoint holds and whether it fits a step), `store` (the storage seam:
Orbax or plain files), `writer` (the directory's lock, temporary names, failed writes),
`integrity` (the record that tells a complete checkpoint from a damaged one), `preemption`
(a signal to any process stops every process at the same step, saved), `hyperparams`
(restored ``inject_hyperparams`` values), `whole_leaf` (``whole_leaf_update=`` states,
stored as the step without the option keeps them), `master_form` (stage-3 bf16/fp16 states,
whose parameters are their float32 masters, stored with the rounded copy beside the master as
every mixed-precision state is), `export` (full parameters as a plain Orbax
checkpoint) and the safetensors files of Hugging Face: `safetensors_format` (names,
headers, the index written), `layer_names` (``{i}``: one tensor per layer of a stacked
leaf), `blocks` (which part of a leaf each device writes), `safetensors_write`,
`safetensors_files` (the files of a load found, the index checked, each file opened once)
and `safetensors_read`. It sits above the step and imports it; nothing of the step imports
it.
"""

from zero_jax.checkpoint.export import export_params
from zero_jax.checkpoint.integrity import DamagedCheckpointError, DamagedCheckpointWarning
from zero_jax.checkpoint.manager import CheckpointManager
from zero_jax.checkpoint.preemption import Preemption, watch_preemption
from zero_jax.checkpoint.safetensors_read import load_safetensors
from zero_jax.checkpoint.safetensors_write import export_safetensors
from zero_jax.checkpoint.writer import DirectoryInUseError

__all__ = [
    "CheckpointManager",
    "DamagedCheckpointError",
    "DamagedCheckpointWarning",
    "DirectoryInUseError",
    "Preemption",
    "export_params",
    "export_safetensors",
    "load_safetensors",
    "watch_preemption",
]
