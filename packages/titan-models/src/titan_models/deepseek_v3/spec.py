"""The ``deepseek_v3`` model spec, registered under the ``titan.models`` entry-point group;
with the experts' load balancing and load metrics (``titan_models.moe.spec_hooks``)."""

from __future__ import annotations

from titan_models.deepseek_v3.adapter import make_adapter
from titan_models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, deepseek_v3_args
from titan_models.deepseek_v3.model import DeepSeekV3
from titan_models.deepseek_v3.parallelize import (
    check_deepseek_v3,
    parallelize_deepseek_v3,
    pipeline_deepseek_v3,
)
from titan_models.moe.spec_hooks import balance_experts, expert_load_metrics
from titan_models.spec import ModelSpec

__all__ = ["DEEPSEEK_V3", "balance_experts", "expert_load_metrics"]

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
