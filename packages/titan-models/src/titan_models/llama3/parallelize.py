"""The plan that parallelizes a Llama 3 model (or one pipeline stage of it).

Order matters and follows torchtitan: tensor parallel first (it replaces parameters by
DTensors on the ``tp`` mesh), then context parallel (its attention input hook must run
after TP's, on the gathered sequence), then activation checkpointing and ``torch.compile``
around each block, then FSDP2/HSDP over ``dp_shard_cp`` (which shards the TP DTensors once
more) or DDP.
Every impossible combination is rejected by :func:`check_parallelism` before anything is
touched.
"""

from __future__ import annotations

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
from titan_models.llama3.args import Llama3Args
from titan_models.llama3.model import Llama3
from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.context_parallel import apply_context_parallel, resolve_cp_attention
from titan_models.parallel.data_parallel import apply_ddp, apply_fsdp
from titan_models.parallel.pipeline import split_blocks
from titan_models.parallel.step import check_seq_len
from titan_models.parallel.tensor_parallel import apply_tp_ends

__all__ = ["apply_tp", "check_llama", "check_parallelism", "parallelize_llama"]


def check_parallelism(
    args: Llama3Args,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig,
    *,
    seq_len: int | None = None,
) -> str | None:
    """Raise ``ModelConfigError`` if ``args`` cannot be parallelized as asked; return the
    context-parallel implementation ``config.cp_attention`` resolves to on this device
    (``None`` without context parallel)."""
    tp = parallel_dims.tp
    for name, heads in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads)):
        if heads % tp:
            raise ModelConfigError(
                f"Tensor parallel degree tp={tp} must divide {name}={heads}: each TP rank "
                f"holds whole attention heads. Choose tp among "
                f"{[d for d in range(1, heads + 1) if heads % d == 0]}."
            )
    check_seq_len(args.max_seq_len if seq_len is None else seq_len, parallel_dims)
    implementation = None
    if parallel_dims.cp_enabled:
        # Raises for torch's context parallel on a device it has no kernels for.
        device_type = parallel_dims.device_type or detect_device_type()
        implementation = resolve_cp_attention(config.cp_attention, device_type)
        if implementation == "titan_ring" and config.compile:
            raise ModelConfigError(
                "parallelize.compile with cp_attention='titan_ring' cannot work: the ring's "
                "point-to-point sends do not compile (torch: P2P compilation disabled). Use "
                "cp_attention='titan' (it compiles) or turn compile off."
            )
    if parallel_dims.ep_enabled:
        raise ModelConfigError(
            f"ep={parallel_dims.ep}: Llama 3 is a dense model without experts; set ep=1."
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


def check_llama(
    args: Llama3Args,
    parallel_dims: ParallelDims,
    parallelize_config: ParallelizeConfig,
    *,
    seq_len: int | None = None,
    pipeline_config: PipelineConfig | None = None,
    local_batch_size: int | None = None,
) -> None:
    """Raise ``ModelConfigError`` if a Llama 3 of ``args`` cannot be trained with this layout:
    :func:`check_parallelism`, and under pipeline parallelism the microbatches and the stage
    split. No process group or model needed (``LLAMA3.check_fn``)."""
    check_parallelism(args, parallel_dims, parallelize_config, seq_len=seq_len)
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
    split_blocks(args.n_layers, parallel_dims.pp, pipeline_config)


def apply_tp(model: Llama3, tp_mesh, *, loss_parallel: bool) -> None:
    """Megatron-style tensor parallel with sequence parallel.

    Between blocks the residual stream is sharded along the sequence (``Shard(1)``), so norms
    run on 1/tp of the tokens; each attention and feed-forward gathers the sequence, runs
    column-parallel input and row-parallel output projections, and reduce-scatters back.
    The output projection is column-parallel: with ``loss_parallel`` its logits stay
    sharded over the vocabulary as a DTensor.
    """
    apply_tp_ends(model, tp_mesh, loss_parallel=loss_parallel)
    block_plan = {
        "attention_norm": SequenceParallel(),
        # forward(x, rope): gather x along the sequence; rope is a plain, full tensor.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)


def parallelize_llama(
    model: Llama3,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None = None,
    *,
    seq_len: int | None = None,
) -> Llama3:
    """Apply tensor/sequence parallel, context parallel, activation checkpointing, per-block
    compile and FSDP2 / HSDP / DDP to ``model`` in place (build it on the meta device
    first), as ``parallel_dims`` and ``config`` say; return it.

    ``seq_len`` (default ``model.args.max_seq_len``) is checked against
    ``parallel_dims.seq_len_divisor``. Call ``to_empty`` and ``init_weights`` (or load a
    checkpoint) afterwards. With context parallel, run each step's forward and backward
    inside ``context_parallel_batch``, which hands each rank its share of the inputs and
    labels. The loss of a tensor-parallel model with ``loss_parallel`` must be computed
    inside ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    config = config or ParallelizeConfig()
    cp_implementation = check_parallelism(model.args, parallel_dims, config, seq_len=seq_len)
    device_type = parallel_dims.device_type or detect_device_type()

    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), loss_parallel=config.loss_parallel)
    if parallel_dims.cp_enabled:
        attentions = [block.attention for block in model.layers.values()]
        apply_context_parallel(attentions, parallel_dims.get_mesh("cp"), cp_implementation)
    apply_activation_checkpointing(model.layers, config.activation_checkpoint)
    if config.compile:
        for block in model.layers.values():
            # In place: the block keeps its name, so parameter names do not change.
            block.compile(backend=config.compile_backend, fullgraph=True)

    if parallel_dims.fsdp_enabled:
        mesh_names = (
            ("dp_replicate", "dp_shard_cp")
            if parallel_dims.dp_replicate_enabled
            else ("dp_shard_cp",)
        )
        apply_fsdp(
            model,
            model.layers,
            parallel_dims.get_mesh(mesh_names),
            config,
            device_type=device_type,
            pipeline=parallel_dims.pp_enabled,
        )
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"))
    return model
