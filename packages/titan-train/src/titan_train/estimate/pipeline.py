"""Replay one rank's pipeline-schedule step on its real stage modules, for ``estimate``.

torch's schedule runtime cannot run on a fake process group (its stages first agree tensor
metadata with their neighbours by messages), but its plan can:
``schedule.pipeline_order[pp_rank]`` lists this rank's ``F``, ``B``, ``I``, ``W`` actions per
stage and microbatch. Replayed on the parallelized stages, a forward keeps its activations
until that microbatch's backward (1F1B holds at most ``pp - stage``, GPipe all); the last
stage ends in the loss divided by the microbatch count, another stage's backward starts from
a gradient of its output's size; the receive buffers torch keeps per microbatch (inputs of
all but the first stage, output gradients of all but the last) are allocated too. ``I`` runs
the whole backward and ``W`` nothing: zero-bubble's deferred weight gradients are not
modelled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, ScheduleGPipe

from titan_train.trainer.step import cross_entropy_loss

__all__ = ["replay_pipeline_step", "stage_input_shape"]

_FORWARD = "F"
_BACKWARDS = ("B", "I")


def stage_input_shape(plan: Any, dim: int, microbatch: int, seq_len: int) -> tuple[int, ...]:
    """The hidden state a non-first stage receives: ``(microbatch, seq, dim)``, the sequence
    split over CP ranks and (sequence parallel) over TP ranks."""
    dims = plan.parallel_dims
    return (microbatch, seq_len // dims.cp // dims.tp, dim)


def replay_pipeline_step(
    pipeline: Any,
    plan: Any,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    dim: int,
    dtype: torch.dtype,
) -> None:
    """Replay this rank's actions of one step of ``pipeline`` over ``inputs``/``labels``
    (this rank's whole batch), inside the plan's step context."""
    schedule = pipeline.schedule
    n_micro = schedule._n_microbatches
    num_stages = schedule._num_stages
    stages = dict(zip(pipeline.stage_ids, pipeline.model_parts, strict=True))
    actions = _actions(schedule, plan, pipeline.stage_ids, n_micro, num_stages)
    with plan.step_context(inputs, labels) as (inputs, labels):
        micro_inputs = inputs.chunk(n_micro)
        micro_labels = labels.chunk(n_micro)
        shape = stage_input_shape(plan, dim, micro_inputs[0].shape[0], inputs.shape[1])
        # torch's per-microbatch receive buffers, kept by the stages.
        buffers = [
            torch.empty(shape, dtype=dtype)
            for stage in stages
            for ends in (stage > 0, stage < num_stages - 1)
            if ends
            for _ in range(n_micro)
        ]
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        for kind, key in actions:
            if kind == _FORWARD:
                held[key] = _forward(
                    stages[key[0]],
                    key,
                    num_stages,
                    micro_inputs[key[1]] if key[0] == 0 else torch.empty(shape, dtype=dtype),
                    micro_labels[key[1]],
                    n_micro,
                )
            elif kind in _BACKWARDS:
                _backward(*held.pop(key))
    del buffers


def _actions(
    schedule: Any, plan: Any, stage_ids: list[int], n_micro: int, num_stages: int
) -> list[tuple[str, tuple[int, int]]]:
    """This rank's ``(kind, (stage, microbatch))`` actions of one step, in order; for the
    one-stage schedules as their runtime runs them (GPipe; 1F1B: ``num_stages - stage``
    forwards, then alternating): torch's ``pipeline_order`` there is off by one microbatch."""
    if isinstance(schedule, PipelineScheduleSingle):
        stage = stage_ids[0]
        warm = n_micro if isinstance(schedule, ScheduleGPipe) else min(n_micro, num_stages - stage)
        order = [(_FORWARD, (stage, i)) for i in range(warm)]
        for i in range(n_micro):
            order.append(("B", (stage, i)))
            if warm + i < n_micro:
                order.append((_FORWARD, (stage, warm + i)))
        return order
    pp_rank = plan.parallel_dims.get_mesh("pp").get_local_rank()
    return [
        (str(a.computation_type.value), (a.stage_index, a.microbatch_index))
        for a in schedule.pipeline_order[pp_rank]
        if a is not None
    ]


def _forward(
    part: nn.Module,
    key: tuple[int, int],
    num_stages: int,
    stage_input: torch.Tensor,
    labels: torch.Tensor,
    n_micro: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One stage forward; what its backward needs (the output or the scaled loss, and the
    input whose gradient the backward produces)."""
    first = key[0] == 0
    if not first:
        stage_input.requires_grad_(True)
    output = part(stage_input)
    if key[0] == num_stages - 1:
        output = cross_entropy_loss(output, labels) / n_micro
    return output, None if first else stage_input


def _backward(output: torch.Tensor, stage_input: torch.Tensor | None) -> None:
    """The backward of one stage and microbatch; the input's gradient (sent on) is dropped."""
    grad = None if output.dim() == 0 else torch.empty_like(output)
    torch.autograd.backward(output, grad_tensors=grad)
    if stage_input is not None:
        stage_input.grad = None
