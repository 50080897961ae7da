"""The trainer hooks of a family with MoE blocks (``ModelSpec.post_step_fn`` and
``metrics_fn``): after each optimizer step the token counts are summed over ``dp_cp`` and the
selection biases nudged (``ExpertBalancer``); at reporting steps the last step's shares are
logged (``moe/layers.<i>/min_share``, ``max_share``, ``entropy``). A dense model gets none."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import nn

from titan_dims import ParallelDims
from titan_models.moe.balance import ExpertBalancer

__all__ = ["balance_experts", "expert_load_metrics"]

# The balancer of each model part, for the metrics read later from the parts alone.
_BALANCERS: weakref.WeakKeyDictionary[nn.Module, ExpertBalancer] = weakref.WeakKeyDictionary()


def balance_experts(
    model_parts: Sequence[nn.Module], parallel_dims: ParallelDims
) -> Callable[[], None] | None:
    """The after-step expert-bias update of ``model_parts`` (``None`` without MoE layers).
    Counts are summed over ``dp_cp``: tensor-parallel ranks route the same tokens, and
    pipeline stages hold different layers."""
    group = parallel_dims.get_mesh("dp_cp") if "dp_cp" in parallel_dims.layout.names else None
    balancer = ExpertBalancer(model_parts, group)
    if not balancer.layers:
        return None
    for part in model_parts:
        _BALANCERS[part] = balancer
    return balancer


def expert_load_metrics(model_parts: Sequence[nn.Module]) -> dict[str, float]:
    """The last step's load per MoE layer (see ``ExpertBalancer.metrics``). Under pipeline
    parallelism: the MoE layers of this rank's stages."""
    balancer = _BALANCERS.get(model_parts[0]) if model_parts else None
    return {} if balancer is None else balancer.metrics()
