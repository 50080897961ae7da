"""Model-independent parallelize building blocks: configs, activation checkpointing, FSDP/DDP."""

from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import (
    SCHEDULES,
    ActivationCheckpointConfig,
    ParallelizeConfig,
    PipelineConfig,
)
from titan_models.parallel.context_parallel import (
    ContextParallelAttention,
    apply_context_parallel,
    context_parallel_positions,
    context_parallel_shard,
)
from titan_models.parallel.data_parallel import (
    apply_ddp,
    apply_fsdp,
    cpu_has_fast_bf16,
    resolve_param_dtype,
)
from titan_models.parallel.pipeline import Pipeline, build_schedule, split_blocks, stages_of_rank

__all__ = [
    "SCHEDULES",
    "ActivationCheckpointConfig",
    "ContextParallelAttention",
    "ParallelizeConfig",
    "Pipeline",
    "PipelineConfig",
    "apply_activation_checkpointing",
    "apply_context_parallel",
    "apply_ddp",
    "apply_fsdp",
    "build_schedule",
    "context_parallel_positions",
    "context_parallel_shard",
    "cpu_has_fast_bf16",
    "resolve_param_dtype",
    "split_blocks",
    "stages_of_rank",
]
