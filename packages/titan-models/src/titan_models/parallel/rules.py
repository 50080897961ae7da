"""The layout rules every model family shares, in one place so that the families cannot drift
apart: a family's check (a spec's ``check_fn``) states its facts (head counts, experts,
blocks) and adds only its own architecture's rules. :func:`check_layout` is what one model
(or pipeline stage) is parallelized against, :func:`check_pipeline` what a pipeline adds;
neither needs a process group or a model, so a trainer calls them before any work."""

from __future__ import annotations

from titan_dims import ParallelDims, detect_device_type
from titan_models.errors import ModelConfigError
from titan_models.moe.args import MoEArgs
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.context_parallel import resolve_cp_attention
from titan_models.parallel.expert_parallel import check_expert_parallel
from titan_models.parallel.pipeline import split_blocks
from titan_models.parallel.step import check_seq_len

__all__ = ["check_document_masking", "check_layout", "check_pipeline"]


def check_layout(
    parallel_dims: ParallelDims,
    config: ParallelizeConfig,
    *,
    heads: dict[str, int],
    seq_len: int,
    experts: MoEArgs | None,
    no_experts: str = "the model has no experts",
    expert_hidden_dim: int = 0,
) -> str | None:
    """Raise ``ModelConfigError`` unless a model can be parallelized as ``parallel_dims`` and
    ``config`` say; return the context-parallel implementation ``config.cp_attention`` resolves
    to here (``None`` without context parallel). The model's facts: ``heads``, each head count a
    tp rank splits, by name (``{"n_heads": 32, "n_kv_heads": 8}``); ``seq_len``; ``experts``,
    its MoE args, or ``None``, and then ``no_experts`` says why when ``ep > 1``;
    ``expert_hidden_dim``, each routed expert's hidden size (``moe_inter_dim``), which
    tensor parallel splits."""
    tp = parallel_dims.tp
    for name, count in heads.items():
        if count % tp:
            raise ModelConfigError(
                f"Tensor parallel degree tp={tp} must divide {name}={count}: each TP rank "
                f"holds whole attention heads. Choose tp among "
                f"{[d for d in range(1, count + 1) if count % d == 0]}."
            )
    check_seq_len(seq_len, parallel_dims)
    if experts is not None and tp > 1:
        _check_expert_split(experts, expert_hidden_dim, parallel_dims)
    if parallel_dims.ep_enabled:
        if experts is None:
            raise ModelConfigError(f"ep={parallel_dims.ep}: {no_experts}; set ep=1.")
        check_expert_parallel(experts, parallel_dims.ep)
    implementation = None
    if parallel_dims.cp_enabled:
        # Raises for torch's context parallel on a device it has no kernels for.
        device_type = parallel_dims.device_type or detect_device_type()
        implementation = resolve_cp_attention(config.cp_attention, device_type)
        # Dense blocks compile whole (fullgraph), where dynamo refuses the ring's P2P ops at
        # the first forward (seen for Llama 3 and Qwen3 on 2 gloo ranks, torch 2.13).
        if implementation == "titan_ring" and config.compile:
            raise ModelConfigError(
                "parallelize.compile with cp_attention='titan_ring' cannot work: the ring's "
                "point-to-point sends do not compile (torch: P2P compilation disabled). Use "
                "cp_attention='titan' (it compiles) or turn compile off."
            )
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


def _check_expert_split(experts: MoEArgs, hidden_dim: int, parallel_dims: ParallelDims) -> None:
    """Tensor parallel splits every expert's hidden dimension (the routed ones only without
    expert parallel, the shared one always): each split must be whole."""
    tp, split = parallel_dims.tp, {}
    if not parallel_dims.ep_enabled:
        split["the routed experts' hidden size (moe_inter_dim)"] = hidden_dim
    if experts.num_shared_experts:
        shared = experts.num_shared_experts
        split[f"the shared expert's hidden size (moe_inter_dim x {shared})"] = hidden_dim * shared
    for what, size in split.items():
        if size % tp:
            raise ModelConfigError(
                f"Tensor parallel degree tp={tp} must divide {what}={size}: each TP rank "
                f"holds 1/tp of every expert. Choose tp among "
                f"{[d for d in range(1, size + 1) if size % d == 0]}, or a moe_inter_dim "
                "that tp divides."
            )


def check_pipeline(
    parallel_dims: ParallelDims,
    n_layers: int,
    pipeline_config: PipelineConfig | None,
    local_batch_size: int | None,
) -> None:
    """Under pipeline parallel (nothing to check without), raise ``ModelConfigError`` unless
    ``local_batch_size`` splits into whole microbatches and the ``n_layers`` blocks into
    stages as ``pipeline_config`` says (:func:`titan_models.parallel.split_blocks`)."""
    if not parallel_dims.pp_enabled:
        return
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
    split_blocks(n_layers, parallel_dims.pp, pipeline_config)


def check_document_masking(parallel_dims: ParallelDims) -> None:
    """Raise ``ModelConfigError`` when document masking (``titan_models.documents``) cannot
    run with this layout: context parallel, whose attentions split each sequence over its
    ranks and know only the causal mask. FSDP, TP, PP, activation checkpointing and MoE
    (masking touches attention only) work."""
    if parallel_dims.cp_enabled:
        raise ModelConfigError(
            f"document masking cannot be combined with context parallel (cp={parallel_dims.cp}):"
            " its attention knows only the causal mask; set context_parallel_degree=1 or turn "
            "document masking off."
        )
