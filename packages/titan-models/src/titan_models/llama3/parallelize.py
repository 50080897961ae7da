"""The plan that parallelizes a Llama 3 model (or one pipeline stage of it).

Order matters and follows torchtitan: tensor parallel first (it replaces parameters by
DTensors on the ``tp`` mesh), then context parallel (its attention input hook must run
after TP's, on the gathered sequence), then activation checkpointing and ``torch.compile``
around each block, then FSDP2/HSDP over ``dp_shard_cp`` (which shards the TP DTensors once
more) or DDP.
Every impossible combination is rejected by :func:`check_llama` (but the pipeline's rules)
before anything is touched.
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
from titan_models.llama3.args import Llama3Args
from titan_models.llama3.model import Llama3
from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.context_parallel import apply_context_parallel
from titan_models.parallel.data_parallel import apply_ddp, apply_fsdp
from titan_models.parallel.rules import check_layout, check_pipeline
from titan_models.parallel.tensor_parallel import apply_tp_ends

__all__ = ["apply_tp", "check_llama", "parallelize_llama"]


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
    the rules every family shares (``titan_models.parallel.rules``) for a dense model of
    ``n_heads`` query and ``n_kv_heads`` key/value heads, the pipeline's included. No process
    group or model needed (``LLAMA3.check_fn``)."""
    _check_layout(args, parallel_dims, parallelize_config, seq_len)
    check_pipeline(parallel_dims, args.n_layers, pipeline_config, local_batch_size)


def _check_layout(
    args: Llama3Args, parallel_dims: ParallelDims, config: ParallelizeConfig, seq_len: int | None
) -> str | None:
    return check_layout(
        parallel_dims,
        config,
        heads={"n_heads": args.n_heads, "n_kv_heads": args.kv_heads},
        seq_len=args.max_seq_len if seq_len is None else seq_len,
        experts=None,
        no_experts="Llama 3 is a dense model without experts",
    )


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
    cp_implementation = _check_layout(model.args, parallel_dims, config, seq_len)
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
