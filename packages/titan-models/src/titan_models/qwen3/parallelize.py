"""The plans that parallelize a Qwen3 model, dense or MoE (or one pipeline stage of it), and
split it into pipeline stages: the shared plan (``titan_models.parallel.plan``) with Qwen3's
facts. What differs from Llama 3:

- **QK-norm under tensor parallel.** A tp rank holds whole heads, so the per-head norms run
  on its local heads; their one weight is a replicated DTensor and their input marked
  sharded over the heads (dim 2), so its gradient, partial per rank, is summed over ``tp``.
- **Tied embeddings.** FSDP: tied before sharding, both ends in the root's unit. TP: both ends
  shard the weight over the vocabulary and the output takes the embedding's DTensor again,
  one parameter with both gradients. PP: each end's stage holds a copy, kept one weight by
  ``titan_models.parallel.pipeline_tied``.
- **MoE blocks** get DeepSeek-V3's plans (``titan_models.parallel.moe_parallel``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_dims import ParallelDims
from titan_models.moe import tokens_not_counted
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.moe_parallel import apply_moe_tp
from titan_models.parallel.pipeline import Pipeline
from titan_models.parallel.plan import block_tp_plan, parallelize_decoder, pipeline_decoder
from titan_models.parallel.rules import check_layout, check_pipeline
from titan_models.parallel.tensor_parallel import apply_tp_ends
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.model import Qwen3

__all__ = ["apply_tp_qwen3", "check_qwen3", "parallelize_qwen3", "pipeline_qwen3"]


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
        expert_hidden_dim=args.moe_inter_dim,
        experts=args.moe_args() if args.n_moe_layers else None,
        no_experts=f"this Qwen3 has no MoE block (moe_enabled={args.moe_enabled}: choose an "
        "MoE flavor for experts)",
    )


def apply_tp_qwen3(
    model: Qwen3, tp_mesh: DeviceMesh, *, loss_parallel: bool, shard_experts: bool = True
) -> None:
    """Tensor and sequence parallel over ``tp_mesh`` (see the module docstring): Llama 3's
    plan with per-head QK-norms, MoE blocks as DeepSeek-V3's, tied ends kept tied.
    ``shard_experts``: split every expert over its hidden dimension (``apply_moe_tp``);
    ``False`` under expert parallel, which holds the routed experts."""
    apply_tp_ends(model, tp_mesh, loss_parallel=loss_parallel)
    # Each end's plan made its own DTensor of a tied weight, both Shard(0) (the vocabulary):
    # make them one parameter again.
    model.tie_weights()
    attention = {name: ColwiseParallel() for name in ("wq", "wk", "wv")}
    for name in ("q_norm", "k_norm"):
        # Per-head norms on (batch, seq, local heads, head_dim): heads are dim 2.
        attention[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(dense=not block.moe_enabled, **attention))
        if block.moe_enabled:
            apply_moe_tp(block.moe, tp_mesh, shard_experts=shard_experts)


def parallelize_qwen3(
    model: Qwen3,
    parallel_dims: ParallelDims,
    config: ParallelizeConfig | None = None,
    *,
    seq_len: int | None = None,
) -> Qwen3:
    """``titan_models.llama3.parallelize_llama`` for Qwen3, with expert parallel for MoE
    flavors; raises ``ModelConfigError`` (:func:`check_qwen3`'s checks but the pipeline's)
    before touching anything."""
    return parallelize_decoder(
        model,
        parallel_dims,
        config,
        seq_len=seq_len,
        check_layout=_check_layout,
        apply_tp=apply_tp_qwen3,
    )


def pipeline_qwen3(
    model: Qwen3,
    parallel_dims: ParallelDims,
    pipeline_config: PipelineConfig,
    parallelize_config: ParallelizeConfig | None = None,
    *,
    local_batch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str | None = None,
    seq_len: int | None = None,
) -> Pipeline:
    """This rank's pipeline stages of ``model`` (built on the meta device), each
    parallelized with :func:`parallelize_qwen3`, and their schedule; arguments as
    ``titan_models.llama3.pipeline_llama``. With tied embeddings the first stage's embedding
    and the last stage's output projection are kept one weight (``Pipeline.tied``)."""
    args = model.args
    return pipeline_decoder(
        model,
        parallel_dims,
        pipeline_config,
        parallelize_config,
        check=check_qwen3,
        parallelize=parallelize_qwen3,
        local_batch_size=local_batch_size,
        loss_fn=loss_fn,
        device=device,
        seq_len=seq_len,
        # torch's one-time metadata forward is not a training step: MoE blocks leave their
        # token counts alone (dense flavors have nothing to count).
        inference_context=tokens_not_counted if args.moe_enabled else contextlib.nullcontext,
        tied=(("tok_embeddings.weight", "output.weight"),) if args.enable_weight_tying else (),
    )
