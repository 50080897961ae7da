"""Mixture of experts: the ``MoE`` layer (router, grouped experts, shared expert), its
``MoEArgs``, and load balancing (``update_expert_bias``, ``expert_load``).

``titan_models.parallel.expert_parallel`` shards the experts over an ``ep`` mesh."""

from titan_models.moe.args import SCORE_FUNCS, MoEArgs
from titan_models.moe.balance import ExpertBalancer, expert_load, moe_layers, update_expert_bias
from titan_models.moe.experts import (
    GroupedExperts,
    grouped_mm_supported,
    run_experts_fallback,
    run_experts_grouped_mm,
    run_experts_loop,
    run_experts_padded,
)
from titan_models.moe.layer import MoE, sequence_balance_loss, tokens_not_counted
from titan_models.moe.router import Routing, TokenChoiceTopKRouter

__all__ = [
    "SCORE_FUNCS",
    "ExpertBalancer",
    "GroupedExperts",
    "MoE",
    "MoEArgs",
    "Routing",
    "TokenChoiceTopKRouter",
    "expert_load",
    "grouped_mm_supported",
    "moe_layers",
    "run_experts_fallback",
    "run_experts_grouped_mm",
    "run_experts_loop",
    "run_experts_padded",
    "sequence_balance_loss",
    "tokens_not_counted",
    "update_expert_bias",
]
