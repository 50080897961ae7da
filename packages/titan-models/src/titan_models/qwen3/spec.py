"""The ``qwen3`` model spec, registered under the ``titan.models`` entry-point group; the MoE
flavors get DeepSeek-V3's expert balancing and metrics (a dense one finds no MoE layer)."""

from __future__ import annotations

from titan_models.moe.spec_hooks import balance_experts, expert_load_metrics
from titan_models.qwen3.adapter import make_adapter
from titan_models.qwen3.args import QWEN3_FLAVORS, qwen3_args
from titan_models.qwen3.model import Qwen3
from titan_models.qwen3.parallelize import check_qwen3, parallelize_qwen3, pipeline_qwen3
from titan_models.spec import ModelSpec

__all__ = ["QWEN3"]

QWEN3 = ModelSpec(
    name="qwen3",
    flavors=QWEN3_FLAVORS,
    model_cls=Qwen3,
    parallelize_fn=parallelize_qwen3,
    state_dict_adapter=make_adapter,
    args_fn=qwen3_args,
    check_fn=check_qwen3,
    post_step_fn=balance_experts,
    metrics_fn=expert_load_metrics,
    pipeline_fn=pipeline_qwen3,
)
"""Qwen3 for the trainer: flavors debugmodel, debugmodel_moe, 0.6B to 32B, 30B-A3B,
235B-A22B."""
