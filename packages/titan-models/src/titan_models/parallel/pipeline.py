"""Pipeline parallel, model-independent parts: which blocks each stage holds, which stages
each rank runs, the schedule, and one training step through it.

Stages are placed *looped* (rank r runs stages r, r + pp, ...) except for ZBVZeroBubble,
whose stages run in a *V* (rank r runs r and 2 pp - 1 - r, so rank 0 holds both the first
and the last stage).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule, _PipelineScheduleRuntime

from titan_dims import ParallelDims, detect_device_type
from titan_models.errors import ModelConfigError
from titan_models.ops import plain_loss
from titan_models.parallel.config import PipelineConfig
from titan_models.parallel.pipeline_tied import TiedWeights

__all__ = ["Pipeline", "build_pipeline", "build_schedule", "split_blocks", "stages_of_rank"]

_SCHEDULE_CLASSES = {
    "GPipe": ScheduleGPipe,
    "1F1B": Schedule1F1B,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": ScheduleZBVZeroBubble,
    "CSV": _PipelineScheduleRuntime,
}


def split_blocks(n_layers: int, pp: int, config: PipelineConfig) -> list[list[int]]:
    """The block indices of every stage, in stage order. Raises ``ModelConfigError`` when the
    split cannot work with ``pp`` ranks and the schedule."""
    if config.split_points:
        starts = [int(p.split(".")[1]) for p in config.split_points]
        if starts != sorted(set(starts)) or starts[0] <= 0 or starts[-1] >= n_layers:
            raise ModelConfigError(
                f"pipeline.split_points={config.split_points} must name increasing blocks "
                f"between layers.1 and layers.{n_layers - 1}."
            )
        bounds = [0, *starts, n_layers]
        stages = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    else:
        if config.layers_per_stage is not None:
            if n_layers % config.layers_per_stage:
                raise ModelConfigError(
                    f"pipeline.layers_per_stage={config.layers_per_stage} does not divide "
                    f"n_layers={n_layers}."
                )
            num_stages = n_layers // config.layers_per_stage
        else:
            num_stages = pp * (2 if config.multi_stage else 1)
        if num_stages > n_layers:
            raise ModelConfigError(
                f"{num_stages} pipeline stages need at least as many blocks, but the model "
                f"has n_layers={n_layers}; lower pp or use a single-stage schedule."
            )
        base, extra = divmod(n_layers, num_stages)
        sizes = [base + (i < extra) for i in range(num_stages)]
        starts = [sum(sizes[:i]) for i in range(num_stages)]
        stages = [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=True)]

    num_stages = len(stages)
    per_rank = num_stages // pp
    if num_stages % pp:
        raise ModelConfigError(
            f"{num_stages} pipeline stages cannot be spread evenly over pp={pp}."
        )
    if not config.multi_stage and per_rank != 1:
        raise ModelConfigError(
            f"pipeline.schedule={config.schedule!r} runs one stage per rank, but the split "
            f"makes {num_stages} stages for pp={pp}; use an interleaved schedule or "
            f"{pp} stages."
        )
    if config.schedule == "ZBVZeroBubble" and per_rank != 2:
        raise ModelConfigError(
            f"ZBVZeroBubble runs exactly two stages per rank; the split makes {num_stages} "
            f"stages for pp={pp}."
        )
    return stages


def stages_of_rank(pp_rank: int, pp: int, num_stages: int, *, v_shape: bool) -> list[int]:
    """The stage indices ``pp_rank`` runs, in increasing order."""
    per_rank = num_stages // pp
    if v_shape:
        return sorted({pp_rank, num_stages - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(per_rank)]


def build_schedule(
    stages: Sequence[PipelineStage],
    config: PipelineConfig,
    *,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """The schedule ``config`` names over this rank's ``stages``. Gradients are divided by
    the number of microbatches, so a mean loss per microbatch gives the batch mean's
    gradient."""
    cls = _SCHEDULE_CLASSES[config.schedule]
    target = list(stages) if config.multi_stage else stages[0]
    schedule = cls(target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
    if config.schedule == "CSV":
        schedule._load_csv(config.schedule_csv)
    return schedule


@dataclass
class Pipeline:
    """This rank's share of a pipelined model and the schedule that runs it."""

    schedule: _PipelineSchedule
    """Runs forward and backward of all microbatches through the stages."""
    model_parts: list[nn.Module]
    """The modules of this rank's stages, in stage order (give all to the optimizer)."""
    stage_ids: list[int]
    """Which stages this rank runs."""
    has_first_stage: bool
    """Whether this rank feeds the inputs."""
    has_last_stage: bool
    """Whether this rank computes the loss."""
    tied: TiedWeights | None = None
    """Weights shared by the first and the last stage (tied embeddings), kept one weight by
    :meth:`sync_tied_weights` and :meth:`sync_tied_grads`; ``None`` when the model ties none."""

    def sync_tied_weights(self) -> None:
        """After initialization: the last stage takes the first stage's tied weights."""
        if self.tied is not None:
            self.tied.sync_weights()

    def sync_tied_grads(self) -> None:
        """After the backward of a whole step (one :meth:`step`, or several accumulated),
        before clipping: both ends of a tied weight get the sum of their gradients."""
        if self.tied is not None:
            self.tied.sync_grads()

    @property
    def mirrored_parameters(self) -> list[nn.Parameter]:
        """Parameters that repeat one held by another stage (the last stage's end of a tied
        weight): a global gradient norm leaves them out (``clip_grad_norm_(mirrored=...)``)."""
        return self.tied.mirrored if self.tied is not None else []

    def step(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        **model_kwargs: torch.Tensor,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch. Ranks with the first stage pass ``inputs``, ranks with
        the last ``targets`` (others' are ignored); ``model_kwargs`` (e.g. ``document_ids``,
        ``positions``) reach every stage, split into microbatches like the inputs. Returns the mean
        microbatch loss on the last stage's rank, ``None`` elsewhere. Under TP with
        ``loss_parallel``, call it inside the plan's ``StepContext``."""
        return self._run(self.schedule.step, inputs, targets, model_kwargs)

    def eval(
        self,
        inputs: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        **model_kwargs: torch.Tensor,
    ) -> torch.Tensor | None:
        """Forward only (no gradients) of one batch through the schedule; arguments and
        result as :meth:`step`."""
        return self._run(self.schedule.eval, inputs, targets, model_kwargs)

    def _run(
        self,
        run: Callable[..., object],
        inputs: torch.Tensor | None,
        targets: torch.Tensor | None,
        model_kwargs: dict[str, torch.Tensor],
    ) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if self.has_last_stage else {}
        args = (inputs,) if self.has_first_stage else ()
        run(*args, **kwargs, **model_kwargs)
        if not self.has_last_stage:
            return None
        # Under loss parallel each microbatch loss is a replicated DTensor.
        return torch.stack([plain_loss(loss).detach() for loss in losses]).mean()


class _Stage(PipelineStage):
    """A ``PipelineStage`` whose one-time metadata inference forward (torch runs the stage
    on the first microbatch, or on empty tensors for later stages, with gradients on, the
    first time the schedule steps) runs inside ``inference_context``: a model family with
    state updated by its forwards (an MoE's token counts) keeps that forward out of it."""

    def __init__(
        self, *args: Any, inference_context: Callable[[], ContextManager[Any]], **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._inference_context = inference_context

    def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
        with self._inference_context():
            return super()._forward_metadata_inference(*args, **kwargs)


def _stage_model(model: nn.Module, blocks: list[int], *, first: bool, last: bool) -> nn.Module:
    """A copy of ``model`` (on the meta device) with only ``blocks`` of its ``layers``; the
    first stage alone keeps ``tok_embeddings``, the last alone ``norm`` and ``output``."""
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


def build_pipeline(
    model: nn.Module,
    parallel_dims: ParallelDims,
    pipeline_config: PipelineConfig,
    parallelize: Callable[[nn.Module], object],
    *,
    n_layers: int,
    local_batch_size: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str | None = None,
    inference_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    tied: Sequence[tuple[str, str]] = (),
) -> Pipeline:
    """This rank's pipeline stages of ``model`` and their schedule, for any family laid out as
    titan's: ``tok_embeddings``, ``layers`` (a ``ModuleDict`` keyed by block index, so
    parameters keep their full-model names and checkpoints do not depend on the split), ``norm``
    and ``output``, and a forward that skips those set to ``None``. Each stage is a copy of the
    meta-device ``model`` without the other stages' blocks, then ``parallelize(stage)``-ed.
    ``inference_context`` wraps torch's one-time metadata forward (see ``_Stage``); ``tied``
    names the weights the first and last stage share, ``(on the first, on the last)`` (see
    :class:`~titan_models.parallel.pipeline_tied.TiedWeights`)."""
    pp = parallel_dims.pp
    stage_blocks = split_blocks(n_layers, pp, pipeline_config)
    num_stages = len(stage_blocks)
    pp_mesh = parallel_dims.get_mesh("pp")
    device = torch.device(device if device is not None else detect_device_type())
    v_shape = pipeline_config.schedule == "ZBVZeroBubble"
    ids = stages_of_rank(pp_mesh.get_local_rank(), pp, num_stages, v_shape=v_shape)
    parts, stages = [], []
    for stage_id in ids:
        part = _stage_model(
            model, stage_blocks[stage_id], first=stage_id == 0, last=stage_id == num_stages - 1
        )
        parallelize(part)
        parts.append(part)
        stages.append(
            _Stage(
                part,
                stage_id,
                num_stages,
                device,
                group=pp_mesh.get_group(),
                inference_context=inference_context,
            )
        )
    schedule = build_schedule(
        stages,
        pipeline_config,
        n_microbatches=local_batch_size // pipeline_config.microbatch_size,
        loss_fn=loss_fn,
    )
    tied_weights = None
    if tied:
        tied_weights = TiedWeights(
            tied,
            parts,
            ids,
            num_stages=num_stages,
            # Looped placement: stage s runs on pp rank s mod pp; a V ends where it starts.
            last_stage_pp_rank=0 if v_shape else (num_stages - 1) % pp,
            pp_group=pp_mesh.get_group(),
        )
    return Pipeline(
        schedule=schedule,
        model_parts=parts,
        stage_ids=ids,
        has_first_stage=0 in ids,
        has_last_stage=num_stages - 1 in ids,
        tied=tied_weights,
    )
