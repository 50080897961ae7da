"""The ``deepseek_v3`` model spec, registered under the ``titan.models`` entry-point group.

Besides the model, plans and adapter it gives a trainer the experts' load balancing: after
each optimizer step the token counts of every MoE layer are summed over the data- and
context-parallel ranks (``dp_cp``) and the selection biases nudged (``ExpertBalancer``); at
reporting steps the shares of tokens per expert of the last step are logged
(``moe/layers.<i>/min_share``, ``max_share``, ``entropy``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from torch import nn

from titan_dims import ParallelDims
from titan_models.deepseek_v3.adapter import make_adapter
from titan_models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, deepseek_v3_args
from titan_models.deepseek_v3.model import DeepSeekV3
from titan_models.deepseek_v3.parallelize import check_deepseek_v3, parallelize_deepseek_v3
from titan_models.deepseek_v3.pipeline import pipeline_deepseek_v3
from titan_models.moe import ExpertBalancer
from titan_models.spec import ModelSpec

__all__ = ["DEEPSEEK_V3", "balance_experts", "expert_load_metrics"]

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


DEEPSEEK_V3 = ModelSpec(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    model_cls=DeepSeekV3,
    parallelize_fn=parallelize_deepseek_v3,
    state_dict_adapter=make_adapter,
    args_fn=deepseek_v3_args,
    check_fn=check_deepseek_v3,
    post_step_fn=balance_experts,
    metrics_fn=expert_load_metrics,
    pipeline_fn=pipeline_deepseek_v3,
)
"""DeepSeek-V3 for the trainer: flavors debugmodel, 16B, 236B, 671B."""
