"""The plan every family follows, in one place: a family's ``parallelize_*`` and
``pipeline_*`` give only their own facts (how tensor parallel splits their blocks, their
layout check, what the pipeline's stages share).

Order matters and follows torchtitan: tensor parallel first (it replaces parameters by
DTensors on the ``tp`` mesh), then expert parallel, then context parallel (its attention
input hook must run after TP's, on the gathered sequence), then activation checkpointing and
``torch.compile`` around each block, then FSDP2/HSDP over ``dp_shard_cp`` (which shards the
TP DTensors once more; the experts over ``dp_shard_mod_ep`` first) or DDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titan_dims import ParallelDims
from titan_models.errors import ModelConfigError
from titan_models.parallel.activation_checkpoint import apply_activation_checkpointing
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.context_parallel import apply_context_parallel
from titan_models.parallel.data_parallel import apply_ddp
from titan_models.parallel.expert_parallel import apply_expert_parallel
from titan_models.parallel.moe_parallel import apply_fsdp_with_experts
from titan_models.parallel.pipeline import Pipeline, build_pipeline

__all__ = ["block_tp_plan", "parallelize_decoder", "pipeline_decoder"]


def block_tp_plan(
    *, dense: bool, local_input: bool = False, **attention: object
) -> dict[str, object]:
    """One block's Megatron-style tensor and sequence parallel plan: between blocks the
    residual stream is sharded along the sequence (``Shard(1)``), so norms run on 1/tp of the
    tokens; attention and the dense feed-forward (``dense``) gather the sequence, run
    column-parallel input and row-parallel output projections, and reduce-scatter back.
    ``attention`` adds the family's attention entries (``wq=ColwiseParallel()``, ...);
    ``local_input`` hands attention its gathered input as a plain tensor."""
    plan: dict[str, object] = {
        "attention_norm": SequenceParallel(),
        # forward(x, rope): gather x along the sequence; rope is a plain, full tensor.
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=local_input,
        ),
        **{f"attention.{name}": style for name, style in attention.items()},
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if dense:
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=Shard(1))
        plan["feed_forward.w3"] = ColwiseParallel()
    return plan


def parallelize_decoder(
    model: Any,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None,
    *,
    seq_len: int | None,
    check_layout: Callable[..., str | None],
    apply_tp: Callable[..., None],
) -> Any:
    """Parallelize a titan decoder (``layers`` of blocks with an ``attention``) in place, in
    the module docstring's order, after the family's ``check_layout(args, parallel_dims,
    config, seq_len)`` (which returns the context-parallel implementation);
    ``apply_tp(model, tp_mesh, loss_parallel=...)`` is the family's tensor parallel (with
    ``shard_experts=False`` under expert parallel)."""
    config = config or ParallelizeConfig()
    cp_implementation = check_layout(model.args, parallel_dims, config, seq_len)
    if parallel_dims.tp_enabled:
        # Under expert parallel the routed experts are spread over ep, not split over tp.
        experts = {"shard_experts": False} if parallel_dims.ep_enabled else {}
        apply_tp(model, parallel_dims.get_mesh("tp"), loss_parallel=config.loss_parallel, **experts)
    if parallel_dims.ep_enabled:
        apply_expert_parallel(model, parallel_dims.get_mesh("ep"))
    if parallel_dims.cp_enabled:
        attentions = [block.attention for block in model.layers.values()]
        apply_context_parallel(attentions, parallel_dims.get_mesh("cp"), cp_implementation)
    apply_activation_checkpointing(model.layers, config.activation_checkpoint)
    if config.compile:
        for block in model.layers.values():
            # In place: the block keeps its name, so parameter names do not change. An MoE
            # block breaks the graph where it counts tokens (eager, so that the count knows
            # whether autograd is recomputing) and, under expert parallel, where it reads the
            # all-to-all split sizes on the host; dense blocks compile whole.
            moe = getattr(block, "moe_enabled", False)
            block.compile(backend=config.compile_backend, fullgraph=not moe)
    if parallel_dims.fsdp_enabled:
        apply_fsdp_with_experts(model, parallel_dims, config)
    elif parallel_dims.dp_replicate_enabled:
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"))
    return model


def pipeline_decoder(
    model: Any,
    parallel_dims: ParallelDims,
    pipeline_config: PipelineConfig,
    parallelize_config: ParallelizeConfig | None,
    *,
    check: Callable[..., None],
    parallelize: Callable[..., nn.Module],
    local_batch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str | None,
    seq_len: int | None,
    inference_context: Callable[[], Any] = contextlib.nullcontext,
    tied: tuple[tuple[str, str], ...] = (),
) -> Pipeline:
    """This rank's pipeline stages of ``model`` (built on the meta device), each
    ``parallelize``-d (the family's plan), and their schedule, after the family's ``check``
    of the whole layout, the pipeline's included; the rest as ``build_pipeline``. Needs
    ``parallel_dims.pp > 1`` and an initialized process group; materialize every
    ``model_parts`` entry (``to_empty`` + ``init_weights`` or a checkpoint) before the first
    step."""
    config = parallelize_config or ParallelizeConfig()
    if parallel_dims.pp < 2:
        raise ModelConfigError(
            f"{check.__name__.replace('check_', 'pipeline_')} needs pp > 1 (got "
            f"pp={parallel_dims.pp}); use {parallelize.__name__}."
        )
    check(
        model.args,
        parallel_dims,
        config,
        seq_len=seq_len,
        pipeline_config=pipeline_config,
        local_batch_size=local_batch_size,
    )
    return build_pipeline(
        model,
        parallel_dims,
        pipeline_config,
        lambda stage: parallelize(stage, parallel_dims, config, seq_len=seq_len),
        n_layers=model.args.n_layers,
        local_batch_size=local_batch_size,
        loss_fn=loss_fn,
        device=device,
        inference_context=inference_context,
        tied=tied,
    )
