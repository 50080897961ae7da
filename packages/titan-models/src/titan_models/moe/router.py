"""Token-choice top-k routing: each token picks its experts by score.

Scores are computed in fp32 whatever the dtype, the gate's matmul included: bf16 logits tie
and flip in top-k once the balancer's bias is about their spacing. A per-expert bias (the
auxiliary-loss-free balancer's) is added only to *select* experts; the weights come from the
unbiased scores. Grouped routing follows DeepSeek-V3 as transformers implements it, step for
step, so both select the same experts bit for bit in fp32:

1. group score = sum of the two highest bias-corrected scores in each group;
2. keep the ``n_limited_groups`` best groups (``topk(sorted=False)``), mask the rest;
3. ``topk(sorted=False)`` of the masked bias-corrected scores picks the experts;
4. weights = their unbiased scores, divided by their sum (+1e-20) with ``route_norm``, times
   ``route_scale``.

Each token's experts are then ordered by index, so outputs add in transformers' order."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional

from titan_models import init
from titan_models.moe.args import MoEArgs

__all__ = ["Routing", "TokenChoiceTopKRouter"]


class Routing(NamedTuple):
    """Where a router sends each of ``T`` tokens."""

    experts: torch.Tensor
    """(T, top_k) int64: the chosen experts, ascending along each row."""
    weights: torch.Tensor
    """(T, top_k) fp32: the weight of each chosen expert's output."""
    scores: torch.Tensor
    """(T, num_experts) fp32: every expert's unbiased score (the balance loss reads them)."""


class TokenChoiceTopKRouter(nn.Module):
    """Scores every expert for every token with ``gate`` (``nn.Linear(dim, num_experts)``,
    no bias) and picks each token's ``top_k``."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.score_func = args.score_func
        self.route_norm = args.route_norm
        self.route_scale = args.route_scale
        self.n_expert_groups = args.n_expert_groups
        self.n_limited_groups = args.n_limited_groups
        self.gate = nn.Linear(dim, args.num_experts, bias=False)
        # Set by tensor parallel (titan_models.parallel.apply_moe_tp): maps the gate's weight
        # before use (there: its gradient summed over tp, each rank's being partial).
        self.gate_weight_hook: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, expert_bias: torch.Tensor | None = None) -> Routing:
        """Route ``x`` (T, dim); ``expert_bias`` (num_experts,) shifts selection only."""
        with torch.autocast(x.device.type, enabled=False):
            weight = self.gate.weight
            if self.gate_weight_hook is not None:
                weight = self.gate_weight_hook(weight)
            logits = functional.linear(x.float(), weight.float())
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
        else:
            scores = functional.softmax(logits, dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.n_expert_groups > 1:
            choice = self._mask_groups(choice)
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.route_scale
        # Ascending experts per token, so the layer's sum over them runs in expert order.
        experts, order = experts.sort(dim=-1)
        return Routing(experts, weights.gather(1, order), scores)

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with every expert outside each token's best groups set to -inf."""
        tokens = choice.shape[0]
        grouped = choice.view(tokens, self.n_expert_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, self.n_limited_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(grouped).reshape(tokens, -1)
        return choice.masked_fill(~keep, float("-inf"))

    def init_weights(self, init_std: float) -> None:
        """Truncated normal gate weights with standard deviation ``init_std``."""
        init.trunc_normal_(self.gate.weight, mean=0.0, std=init_std)
