"""``build_optimizers``: the factory that picks a container for an ``OptimizerConfig``, above
both containers so that neither imports the other (the helpers are in ``param_groups.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from titan_optim.config import OptimizerConfig
from titan_optim.container import OptimizersContainer
from titan_optim.in_backward import OptimizersInBackwardContainer
from titan_optim.param_groups import build_part_optimizers, group_parameters, warn_fallback

__all__ = ["build_optimizers", "group_parameters"]


def build_optimizers(
    model_parts: nn.Module | Sequence[nn.Module],
    config: OptimizerConfig | None = None,
    *,
    pipeline_parallel: bool = False,
) -> OptimizersContainer:
    """Build one optimizer per model part (or per parameter, with optimizer-in-backward).

    ``pipeline_parallel`` says the model is split into stages across ranks even when this
    rank holds one part; optimizer-in-backward refuses it.
    """
    config = config or OptimizerConfig()
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    if config.early_step_in_backward:
        return OptimizersInBackwardContainer(parts, config, pipeline_parallel=pipeline_parallel)
    part_optimizers, reasons = [], []
    for part in parts:
        groups = group_parameters(part, config)
        if not groups:  # a part with nothing to train (e.g. frozen) gets no optimizer
            part_optimizers.append([])
            continue
        opts, part_reasons = build_part_optimizers(groups, config)
        part_optimizers.append(opts)
        reasons.extend(part_reasons)
    warn_fallback(reasons)
    return OptimizersContainer(parts, part_optimizers)
