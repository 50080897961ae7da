"""The plans that parallelize a Llama 3 model (or one pipeline stage of it) and split it into
pipeline stages: the shared plan (``titan_models.parallel.plan``) with Llama 3's facts, its
head counts and its tensor-parallel split. Every impossible combination is rejected by
:func:`check_llama` before anything is touched."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from titan_dims import ParallelDims
from titan_models.llama3.args import Llama3Args
from titan_models.llama3.model import Llama3
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.pipeline import Pipeline
from titan_models.parallel.plan import block_tp_plan, parallelize_decoder, pipeline_decoder
from titan_models.parallel.rules import check_layout, check_pipeline
from titan_models.parallel.tensor_parallel import apply_tp_ends

__all__ = ["apply_tp", "check_llama", "parallelize_llama", "pipeline_llama"]


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


def apply_tp(model: Llama3, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Megatron-style tensor parallel with sequence parallel (``block_tp_plan``); with
    ``loss_parallel`` the logits stay sharded over the vocabulary as a DTensor."""
    apply_tp_ends(model, tp_mesh, loss_parallel=loss_parallel)
    colwise = {name: ColwiseParallel() for name in ("wq", "wk", "wv")}
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(dense=True, **colwise))


def parallelize_llama(
    model: Llama3,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None = None,
    *,
    seq_len: int | None = None,
) -> Llama3:
    """Apply tensor/sequence parallel, context parallel, activation checkpointing, per-block
    compile and FSDP2 / HSDP / DDP to ``model`` (built on the meta device) in place, as
    ``parallel_dims`` and ``config`` say; return it. ``seq_len`` (default
    ``model.args.max_seq_len``) is checked against the layout. Materialize afterwards
    (``to_empty`` + ``init_weights``, or a checkpoint) and run each step inside the plan's
    ``StepContext`` (``titan_models.step_context``)."""
    return parallelize_decoder(
        model, parallel_dims, config, seq_len=seq_len, check_layout=_check_layout, apply_tp=apply_tp
    )


def pipeline_llama(
    model: Llama3,
    parallel_dims: ParallelDims,
    pipeline_config: PipelineConfig,
    parallelize_config: ParallelizeConfig | None = None,
    *,
    local_batch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str | None = None,
    seq_len: int | None = None,
) -> Pipeline:
    """This rank's pipeline stages of ``model`` (built on the meta device), each parallelized
    with :func:`parallelize_llama`, and their schedule; ``local_batch_size`` (one data-parallel
    rank's) is split into microbatches of ``pipeline_config.microbatch_size``. Needs ``pp > 1``
    and a process group; materialize every ``model_parts`` entry before the first step."""
    return pipeline_decoder(
        model,
        parallel_dims,
        pipeline_config,
        parallelize_config,
        check=check_llama,
        parallelize=parallelize_llama,
        local_batch_size=local_batch_size,
        loss_fn=loss_fn,
        device=device,
        seq_len=seq_len,
    )
