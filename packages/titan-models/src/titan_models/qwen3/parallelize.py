"""The plans that parallelize a Qwen3 model, dense or MoE (or one pipeline stage of it).

Order as for Llama 3: tensor parallel, expert parallel, context parallel, activation
checkpointing, per-block compile, then FSDP2/HSDP or DDP. What differs:

- **QK-norm under tensor parallel.** Queries and keys are normalized per head (an RMSNorm
  over ``head_dim`` whose one weight every head shares). A tp rank holds whole heads, so the
  norm runs on its local heads unchanged; its weight is a replicated DTensor and its input is
  marked sharded over the heads (dim 2), so the weight's gradient, partial on each rank
  (from its heads only), is summed over ``tp``.
- **Tied embeddings** (the flavors that tie ``output.weight`` to ``tok_embeddings.weight``).
  FSDP: the model ties them when built, before sharding, and both ends sit in the root's
  FSDP unit, so the one parameter is sharded, gathered and reduced once. TP: the embedding
  (row-parallel) and the output projection (column-parallel) both shard the weight over the
  vocabulary (dim 0); after the plan the output takes the embedding's DTensor again, so the
  two stay one parameter with the sum of both gradients. Pipeline parallel puts the two ends
  on different stages: each holds a copy, which the pipeline keeps one weight
  (``titan_models.parallel.pipeline_tied``: the same initial values, summed gradients, the
  copy counted once in the gradient norm).
- **MoE blocks** get DeepSeek-V3's plans (``titan_models.parallel.moe_parallel``): the layer
  runs on the gathered sequence on every tp rank, experts spread over ``ep`` by
  ``apply_expert_parallel``, FSDP of the experts over ``dp_shard_mod_ep``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_dims import ParallelDims
from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.context_parallel import apply_context_parallel
from titan_models.parallel.data_parallel import apply_ddp
from titan_models.parallel.expert_parallel import apply_expert_parallel
from titan_models.parallel.moe_parallel import apply_fsdp_with_experts, apply_moe_tp
from titan_models.parallel.rules import check_layout, check_pipeline
from titan_models.parallel.tensor_parallel import apply_tp_ends
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.model import Qwen3

__all__ = ["apply_tp_qwen3", "check_qwen3", "parallelize_qwen3"]


def check_qwen3(
    args: Qwen3Args,
    parallel_dims: ParallelDims,
    parallelize_config: ParallelizeConfig,
    *,
    seq_len: int | None = None,
    pipeline_config: PipelineConfig | None = None,
    local_batch_size: int | None = None,
) -> None:
    """Raise ``ModelConfigError`` if a Qwen3 of ``args`` cannot be trained with this layout:
    the rules every family shares (``titan_models.parallel.rules``) for ``n_heads`` query
    and ``n_kv_heads`` key/value heads, expert parallel for an MoE flavor only, the
    pipeline's included. No process group or model needed (``QWEN3.check_fn``)."""
    _check_layout(args, parallel_dims, parallelize_config, seq_len)
    check_pipeline(parallel_dims, args.n_layers, pipeline_config, local_batch_size)


def _check_layout(
    args: Qwen3Args, parallel_dims: ParallelDims, config: ParallelizeConfig, seq_len: int | None
) -> str | None:
    return check_layout(
        parallel_dims,
        config,
        heads={"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads},
        seq_len=args.max_seq_len if seq_len is None else seq_len,
        experts=args.moe_args() if args.n_moe_layers else None,
        no_experts=f"this Qwen3 has no MoE block (moe_enabled={args.moe_enabled}: choose an "
        "MoE flavor for experts)",
    )


def _block_plan(block: nn.Module) -> dict[str, object]:
    plan: dict[str, object] = {
        "attention_norm": SequenceParallel(),
        # forward(x, rope): gather x along the sequence; rope is a plain, full tensor.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        # Per-head norms on (batch, seq, local heads, head_dim): heads are dim 2.
        "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if not block.moe_enabled:
        plan.update(
            {
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            }
        )
    return plan


def apply_tp_qwen3(model: Qwen3, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Tensor and sequence parallel over ``tp_mesh`` (see the module docstring): Llama 3's
    plan with per-head QK-norms, MoE blocks as DeepSeek-V3's, tied ends kept tied."""
    apply_tp_ends(model, tp_mesh, loss_parallel=loss_parallel)
    # Each end's plan made its own DTensor of a tied weight, both Shard(0) (the vocabulary):
    # make them one parameter again.
    model.tie_weights()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block))
        if block.moe_enabled:
            apply_moe_tp(block.moe, tp_mesh)


def parallelize_qwen3(
    model: Qwen3,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None = None,
    *,
    seq_len: int | None = None,
) -> Qwen3:
    """Apply tensor/sequence parallel, expert parallel (MoE flavors), context parallel,
    activation checkpointing, per-block compile and FSDP2 / HSDP / DDP to ``model`` in place
    (build it on the meta device first), as ``parallel_dims`` and ``config`` say; return it.
    Raises ``ModelConfigError`` (the checks of :func:`check_qwen3` but the pipeline's)
    before touching anything. Use it as ``titan_models.llama3.parallelize_llama``: materialize
    afterwards, run steps inside the plan's ``StepContext``."""
    config = config or ParallelizeConfig()
    cp_implementation = _check_layout(model.args, parallel_dims, config, seq_len)
    if parallel_dims.tp_enabled:
        apply_tp_qwen3(model, parallel_dims.get_mesh("tp"), loss_parallel=config.loss_parallel)
    if parallel_dims.ep_enabled:
        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    if parallel_dims.cp_enabled:
        attentions = [block.attention for block in model.layers.values()]
        apply_context_parallel(attentions, parallel_dims.get_mesh("cp"), cp_implementation)
    apply_activation_checkpointing(model.layers, config.activation_checkpoint)
    if config.compile:
        for block in model.layers.values():
            # MoE blocks break the graph where they count tokens and, under expert
            # parallel, where they read the all-to-all split sizes (as DeepSeek-V3's).
            block.compile(backend=config.compile_backend, fullgraph=not block.moe_enabled)
    if parallel_dims.fsdp_enabled:
        apply_fsdp_with_experts(model, parallel_dims, config)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"))
    return model
