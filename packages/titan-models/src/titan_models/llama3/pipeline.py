"""Split a Llama 3 model into pipeline stages, parallelize each, and schedule them.

Each stage is a copy of the (meta-device) model with the blocks of other stages deleted;
the first stage alone keeps ``tok_embeddings``, the last alone ``norm`` and ``output``.
Because ``layers`` is keyed by the original index, every parameter keeps its full-model
name, so checkpoints do not depend on the pipeline layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from titan_dims import ParallelDims, detect_device_type
from titan_models.errors import ModelConfigError
from titan_models.llama3.model import Llama3
from titan_models.llama3.parallelize import check_llama, parallelize_llama
from titan_models.parallel.config import ParallelizeConfig, PipelineConfig
from titan_models.parallel.pipeline import Pipeline, build_schedule, split_blocks, stages_of_rank

__all__ = ["pipeline_llama"]


def _stage_model(model: Llama3, blocks: list[int], *, first: bool, last: bool) -> Llama3:
    part = copy.deepcopy(model)
    keep = {str(i) for i in blocks}
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


def _check_pipeline(
    model: Llama3,
    parallel_dims: ParallelDims,
    pipeline_config: PipelineConfig,
    parallelize_config: ParallelizeConfig,
    local_batch_size: int,
    seq_len: int | None,
) -> None:
    pp = parallel_dims.pp
    if pp < 2:
        raise ModelConfigError(f"pipeline_llama needs pp > 1 (got pp={pp}); use parallelize_llama.")
    check_llama(
        model.args,
        parallel_dims,
        parallelize_config,
        seq_len=seq_len,
        pipeline_config=pipeline_config,
        local_batch_size=local_batch_size,
    )


def _build_stages(
    model: Llama3,
    stage_blocks: list[list[int]],
    ids: list[int],
    parallel_dims: ParallelDims,
    parallelize_config: ParallelizeConfig,
    *,
    device: torch.device,
    pp_mesh: DeviceMesh,
    seq_len: int | None,
) -> tuple[list[Llama3], list[PipelineStage]]:
    """This rank's stage models ``ids``, each parallelized, and their ``PipelineStage``s."""
    num_stages = len(stage_blocks)
    parts, stages = [], []
    for stage_id in ids:
        part = _stage_model(
            model,
            stage_blocks[stage_id],
            first=stage_id == 0,
            last=stage_id == num_stages - 1,
        )
        parallelize_llama(part, parallel_dims, parallelize_config, seq_len=seq_len)
        parts.append(part)
        stages.append(PipelineStage(part, stage_id, num_stages, device, group=pp_mesh.get_group()))
    return parts, stages


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
    pp = parallel_dims.pp
    _check_pipeline(
        model, parallel_dims, pipeline_config, parallelize_config, local_batch_size, seq_len
    )
    stage_blocks = split_blocks(model.args.n_layers, pp, pipeline_config)
    num_stages = len(stage_blocks)

    pp_mesh = parallel_dims.get_mesh("pp")
    device = torch.device(device if device is not None else detect_device_type())
    ids = stages_of_rank(
        pp_mesh.get_local_rank(),
        pp,
        num_stages,
        v_shape=pipeline_config.schedule == "ZBVZeroBubble",
    )
    parts, stages = _build_stages(
        model,
        stage_blocks,
        ids,
        parallel_dims,
        parallelize_config,
        device=device,
        pp_mesh=pp_mesh,
        seq_len=seq_len,
    )
    schedule = build_schedule(
        stages,
        pipeline_config,
        n_microbatches=local_batch_size // pipeline_config.microbatch_size,
        loss_fn=loss_fn,
    )
    return Pipeline(
        schedule=schedule,
        model_parts=parts,
        stage_ids=ids,
        has_first_stage=0 in ids,
        has_last_stage=num_stages - 1 in ids,
    )
