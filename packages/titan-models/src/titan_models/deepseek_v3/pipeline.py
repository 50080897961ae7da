"""Split a DeepSeek-V3 model into pipeline stages, parallelize each, and schedule them:
the model-independent ``build_pipeline`` with :func:`parallelize_deepseek_v3` per stage.
A stage holds whole blocks, dense or MoE; checkpoints keep full-model names."""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_dims import ParallelDims
from titan_models.deepseek_v3.model import DeepSeekV3
from titan_models.deepseek_v3.parallelize import check_deepseek_v3, parallelize_deepseek_v3
from titan_models.errors import ModelConfigError
from titan_models.moe import tokens_not_counted
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.pipeline import Pipeline, build_pipeline

__all__ = ["pipeline_deepseek_v3"]


def pipeline_deepseek_v3(
    model: DeepSeekV3,
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
    parallelized with :func:`parallelize_deepseek_v3` (expert parallel included), and their
    schedule; arguments as ``titan_models.llama3.pipeline_llama``."""
    parallelize_config = parallelize_config or ParallelizeConfig()
    if parallel_dims.pp < 2:
        raise ModelConfigError(
            f"pipeline_deepseek_v3 needs pp > 1 (got pp={parallel_dims.pp}); use "
            "parallelize_deepseek_v3."
        )
    check_deepseek_v3(
        model.args,
        parallel_dims,
        parallelize_config,
        seq_len=seq_len,
        pipeline_config=pipeline_config,
        local_batch_size=local_batch_size,
    )
    return build_pipeline(
        model,
        parallel_dims,
        pipeline_config,
        lambda stage: parallelize_deepseek_v3(
            stage, parallel_dims, parallelize_config, seq_len=seq_len
        ),
        n_layers=model.args.n_layers,
        local_batch_size=local_batch_size,
        loss_fn=loss_fn,
        device=device,
        # torch's one-time metadata forward is not a training step: leave the counts alone.
        inference_context=tokens_not_counted,
    )
