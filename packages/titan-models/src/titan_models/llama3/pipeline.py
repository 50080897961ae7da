"""Split a Llama 3 model into pipeline stages, parallelize each, and schedule them.

Each stage is a copy of the (meta-device) model with the blocks of other stages deleted;
the first stage alone keeps ``tok_embeddings``, the last alone ``norm`` and ``output``.
Because ``layers`` is keyed by the original index, every parameter keeps its full-model
name, so checkpoints do not depend on the pipeline layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from titan_dims import ParallelDims
from titan_models.errors import ModelConfigError
from titan_models.llama3.model import Llama3
from titan_models.llama3.parallelize import check_llama, parallelize_llama
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.pipeline import Pipeline, build_pipeline

__all__ = ["pipeline_llama"]


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
    """This rank's pipeline stages of ``model`` (built on the meta device), each
    parallelized with :func:`parallelize_llama`, and their schedule.

    ``local_batch_size`` is the batch one data-parallel rank steps with; it is split into
    microbatches of ``pipeline_config.microbatch_size``. Materialize every
    ``model_parts`` entry (``to_empty`` + ``init_weights`` or a checkpoint) before the
    first step. Needs ``parallel_dims.pp > 1`` and an initialized process group.
    """
    parallelize_config = parallelize_config or ParallelizeConfig()
    if parallel_dims.pp < 2:
        raise ModelConfigError(
            f"pipeline_llama needs pp > 1 (got pp={parallel_dims.pp}); use parallelize_llama."
        )
    check_llama(
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
        lambda stage: parallelize_llama(stage, parallel_dims, parallelize_config, seq_len=seq_len),
        n_layers=model.args.n_layers,
        local_batch_size=local_batch_size,
        loss_fn=loss_fn,
        device=device,
    )
