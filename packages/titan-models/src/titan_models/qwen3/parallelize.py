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

from titan_dims import ParallelDims, detect_device_type
from titan_models.errors import ModelConfigError
from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.context_parallel import apply_context_parallel, resolve_cp_attention
from titan_models.parallel.data_parallel import apply_ddp
from titan_models.parallel.expert_parallel import apply_expert_parallel, check_expert_parallel
from titan_models.parallel.moe_parallel import apply_fsdp_with_experts, apply_moe_tp
from titan_models.parallel.pipeline import split_blocks
from titan_models.parallel.step import check_seq_len
from titan_models.parallel.tensor_parallel import apply_tp_ends
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.model import Qwen3

__all__ = ["apply_tp_qwen3", "check_qwen3", "parallelize_qwen3"]


def _check_layout(
    args: Qwen3Args,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig,
    seq_len: int | None,
) -> str | None:
    """What one model (or one pipeline stage) is checked against; returns the context
    parallel implementation (``None`` without cp)."""
    tp = parallel_dims.tp
    for name, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads)):
        if heads % tp:
            raise ModelConfigError(
                f"Tensor parallel degree tp={tp} must divide {name}={heads}: each TP rank "
                f"holds whole attention heads. Choose tp among "
                f"{[d for d in range(1, heads + 1) if heads % d == 0]}."
            )
    check_seq_len(args.max_seq_len if seq_len is None else seq_len, parallel_dims)
    if parallel_dims.ep_enabled:
        if args.n_moe_layers == 0:
            raise ModelConfigError(
                f"ep={parallel_dims.ep}: this Qwen3 has no MoE block (moe_enabled="
                f"{args.moe_enabled}); set ep=1, or choose an MoE flavor."
            )
        check_expert_parallel(args.moe_args(), parallel_dims.ep)
    implementation = None
    if parallel_dims.cp_enabled:
        # Raises for torch's context parallel on a device it has no kernels for.
        device_type = parallel_dims.device_type or detect_device_type()
        implementation = resolve_cp_attention(config.cp_attention, device_type)
    if config.cpu_offload and not parallel_dims.fsdp_enabled:
        raise ModelConfigError(
            "cpu_offload=True offloads FSDP's sharded parameters, but FSDP is off here "
            f"(dp_shard={parallel_dims.dp_shard}, cp={parallel_dims.cp}); set dp_shard > 1 or "
            "cpu_offload=False."
        )
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled and tp > 1:
        raise ModelConfigError(
            f"DDP (dp_replicate={parallel_dims.dp_replicate}, dp_shard=1) cannot be combined "
            f"with tensor parallel (tp={tp}); use HSDP instead: dp_shard > 1."
        )
    return implementation


def _check_pipeline(
    args: Qwen3Args,
    parallel_dims: ParallelDims,
    pipeline_config: PipelineConfig | None,
    local_batch_size: int | None,
) -> None:
    if pipeline_config is None or local_batch_size is None:
        raise ModelConfigError(
            f"pp={parallel_dims.pp}: checking a pipeline needs pipeline_config and "
            "local_batch_size."
        )
    if local_batch_size % pipeline_config.microbatch_size:
        raise ModelConfigError(
            f"local_batch_size={local_batch_size} is not a multiple of "
            f"pipeline.microbatch_size={pipeline_config.microbatch_size}."
        )
    split_blocks(args.n_layers, parallel_dims.pp, pipeline_config)


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
    whole query and key-value heads per tp rank, expert parallel only for an MoE flavor and
    with the experts shared equally, the sequence length against tp and cp, and under
    pipeline parallelism the microbatches and the stage split. No process
    group or model needed (``QWEN3.check_fn``)."""
    _check_layout(args, parallel_dims, parallelize_config, seq_len)
    if parallel_dims.pp_enabled:
        _check_pipeline(args, parallel_dims, pipeline_config, local_batch_size)


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
    before touching anything. Use it as ``titan_models.parallelize_llama``: materialize
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
