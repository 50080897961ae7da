"""Model-independent parallelize building blocks: configs, activation checkpointing, context
parallel (all-gather, ring, torch's), expert parallel, FSDP/DDP, pipelines, and the layout
rules every family shares (``check_layout``, ``check_pipeline``, ``check_document_masking``)."""

from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import (
    SCHEDULES,
    ActivationCheckpointConfig,
    ParallelizeConfig,
    PipelineConfig,
)
from titan_models.parallel.context_parallel import (
    ContextParallelAttention,
    TorchContextParallelAttention,
    apply_context_parallel,
    context_parallel_batch,
    open_context_parallel,
    resolve_cp_attention,
)
from titan_models.parallel.cp_sharding import context_parallel_positions, context_parallel_shard
from titan_models.parallel.data_parallel import (
    apply_ddp,
    apply_fsdp,
    auto_param_dtype,
    cpu_has_fast_bf16,
    resolve_param_dtype,
)
from titan_models.parallel.expert_parallel import (
    ExpertParallel,
    apply_expert_parallel,
    check_expert_parallel,
)
from titan_models.parallel.moe_parallel import apply_fsdp_with_experts, apply_moe_tp
from titan_models.parallel.pipeline import (
    Pipeline,
    build_pipeline,
    build_schedule,
    split_blocks,
    stages_of_rank,
)
from titan_models.parallel.ring_attention import RingContextParallelAttention
from titan_models.parallel.rules import check_document_masking, check_layout, check_pipeline
from titan_models.parallel.step import (
    StepContext,
    check_seq_len,
    reduce_loss,
    step_context,
)

__all__ = [
    "SCHEDULES",
    "ActivationCheckpointConfig",
    "ContextParallelAttention",
    "ExpertParallel",
    "ParallelizeConfig",
    "Pipeline",
    "PipelineConfig",
    "RingContextParallelAttention",
    "StepContext",
    "TorchContextParallelAttention",
    "apply_activation_checkpointing",
    "apply_context_parallel",
    "apply_ddp",
    "apply_expert_parallel",
    "apply_fsdp",
    "apply_fsdp_with_experts",
    "apply_moe_tp",
    "auto_param_dtype",
    "build_pipeline",
    "build_schedule",
    "check_document_masking",
    "check_expert_parallel",
    "check_layout",
    "check_pipeline",
    "check_seq_len",
    "context_parallel_batch",
    "context_parallel_positions",
    "context_parallel_shard",
    "cpu_has_fast_bf16",
    "open_context_parallel",
    "reduce_loss",
    "resolve_cp_attention",
    "resolve_param_dtype",
    "split_blocks",
    "stages_of_rank",
    "step_context",
]
