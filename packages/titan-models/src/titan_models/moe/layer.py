"""``MoE``: a mixture-of-experts feed-forward layer (router, routed experts, shared expert).

Names and shapes are torchtitan's (its July 2025 ``deepseek_v3`` MoE), so checkpoints move
between the two unchanged: ``router.gate`` (``nn.Linear(dim, num_experts)``);
``experts.w1``/``w3`` (num_experts, dim, hidden_dim) and ``w2`` (num_experts, hidden_dim,
dim); ``shared_expert`` a one-expert ``GroupedExperts`` of ``hidden_dim * num_shared_experts``
(``None`` without); buffers ``expert_bias`` (fp32) and ``tokens_per_expert``, persistent with
``load_balance_coeff`` (without it no bias, and the counts are non-persistent, kept for the
metrics); ``aux_loss`` holds the last sequence balance loss.

``tokens_per_expert`` is int64 (torchtitan's is fp32): exact past 2^24 tokens per expert per
step. fp32 counts in a checkpoint still load (copied into the int64 buffer).

Every forward counts the tokens each expert received, except under ``torch.no_grad()`` or
inference mode (evaluation) and during autograd's backward, where activation checkpointing
recomputes the forward: those tokens do not train, or were counted already."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from titan_models.moe.args import MoEArgs
from titan_models.moe.experts import GroupedExperts
from titan_models.moe.router import Routing, TokenChoiceTopKRouter

__all__ = ["MoE", "sequence_balance_loss", "tokens_not_counted"]


_counting_paused = False
"""Set by :func:`tokens_not_counted` (a plain global: torch.compile guards on its value)."""


@contextlib.contextmanager
def tokens_not_counted() -> Iterator[None]:
    """Within this context MoE forwards do not add to ``tokens_per_expert``: for forwards
    that are not training steps but run with gradients on, e.g. the metadata inference
    forward torch's pipeline stages run once on their first step."""
    global _counting_paused
    paused = _counting_paused
    _counting_paused = True
    try:
        yield
    finally:
        _counting_paused = paused


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (where activation
    checkpointing recomputes forwards). torch.utils.checkpoint asks the same question."""
    return torch._C._current_graph_task_id() != -1


def sequence_balance_loss(routing: Routing, batch: int, alpha: float) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss ``alpha * sum_i f_i * P_i``, averaged over the
    ``batch`` sequences that ``routing`` covers (tokens in sequence order).

    Per sequence of ``T`` tokens: ``f_i = E / (K T) * (tokens that chose expert i)`` (no
    gradient) and ``P_i = mean over tokens of s_i / sum_j s_j`` (the unbiased scores,
    normalized per token).
    """
    num_experts, top_k = routing.scores.shape[-1], routing.experts.shape[-1]
    scores = routing.scores.view(batch, -1, num_experts)
    seq_len = scores.shape[1]
    chosen = routing.experts.view(batch, -1)
    counts = torch.zeros(batch, num_experts, device=chosen.device, dtype=torch.float32)
    counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=torch.float32))
    fraction = counts * (num_experts / (top_k * seq_len))
    probability = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)
    return alpha * (fraction * probability).sum(dim=-1).mean()


class _AddAuxLossGradient(torch.autograd.Function):
    """Identity on ``output`` in the forward; in the backward, also gives ``aux_loss`` the
    gradient ``scale``, as if ``scale * aux_loss`` had been added to the training loss."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_meta = (aux_loss.dtype, aux_loss.device)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        dtype, device = ctx.aux_meta
        return grad_output, torch.full((), ctx.scale, dtype=dtype, device=device), None


class MoE(nn.Module):
    """Token-choice top-k routed SwiGLU experts plus optional shared experts.

    ``forward`` maps (batch, seq, dim) to the same shape: the router picks ``top_k`` experts per
    token, tokens sorted by expert run through ``experts``, and each token's weighted expert
    outputs are added in ascending expert order, then the shared expert's output.

    With ``aux_loss_alpha > 0`` the layer adds DeepSeek-V3's sequence balance loss to the
    backward itself, as if ``aux_loss_grad_scale * aux_loss`` were part of the loss: set
    ``aux_loss_grad_scale`` to the trainer's loss scale (1 / gradient-accumulation steps)."""

    def __init__(self, args: MoEArgs, *, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.args = args
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.load_balance_coeff = args.load_balance_coeff
        self.aux_loss_alpha = args.aux_loss_alpha
        self.aux_loss_grad_scale = 1.0
        # Ranks that each add the balance loss's gradient to a partial sum (tensor parallel
        # with split experts): the gradient is divided by it.
        self.aux_loss_grad_divisor = 1
        self.router = TokenChoiceTopKRouter(dim, args)
        self.experts = GroupedExperts(
            dim, hidden_dim, args.num_experts, use_grouped_mm=args.use_grouped_mm
        )
        self.shared_expert = (
            GroupedExperts(dim, hidden_dim * args.num_shared_experts, 1)
            if args.num_shared_experts > 0
            else None
        )
        counts = torch.zeros(args.num_experts, dtype=torch.int64)
        self.expert_bias: torch.Tensor | None
        if args.load_balance_coeff is not None:
            bias = torch.zeros(args.num_experts, dtype=torch.float32)
            self.register_buffer("expert_bias", bias, persistent=True)
            self.register_buffer("tokens_per_expert", counts, persistent=True)
        else:
            self.expert_bias = None
            self.register_buffer("tokens_per_expert", counts, persistent=False)
        self.register_buffer("aux_loss", torch.zeros((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, dim) -> (batch, seq, dim)."""
        batch, seq_len, dim = x.shape
        tokens = x.reshape(batch * seq_len, dim)
        routing = self.router(tokens, self.expert_bias)
        slot_experts = routing.experts.flatten()  # slot t * top_k + j: token t's j-th expert
        # Tokens per expert (a static shape, unlike bincount's, for torch.compile).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, slot_experts, torch.ones_like(slot_experts))
        if torch.is_grad_enabled() and not _counting_paused and not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        # Slots sorted by expert (stable: tokens in order within an expert).
        order = torch.argsort(slot_experts, stable=True)
        # index_select, not indexing: its backward is an index_add, which CPUs run several
        # times faster than indexing's accumulating index_put.
        routed = self.experts(tokens.index_select(0, order // self.top_k), counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        per_slot = routed.index_select(0, inverse).view(batch * seq_len, self.top_k, dim)
        weighted = (per_slot.float() * routing.weights.unsqueeze(-1)).to(x.dtype)
        out = weighted[:, 0]
        for j in range(1, self.top_k):  # ascending expert order, one addition at a time
            out = out + weighted[:, j]
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        out = out.view(batch, seq_len, dim)
        if self.aux_loss_alpha > 0:
            out = self._add_aux_loss(out, routing, batch)
        return out

    def _add_aux_loss(self, out: torch.Tensor, routing: Routing, batch: int) -> torch.Tensor:
        aux_loss = sequence_balance_loss(routing, batch, self.aux_loss_alpha)
        with torch.no_grad():
            self.aux_loss.copy_(aux_loss.detach())
        if not (torch.is_grad_enabled() and aux_loss.requires_grad):
            return out
        scale = self.aux_loss_grad_scale / self.aux_loss_grad_divisor
        return _AddAuxLossGradient.apply(out, aux_loss, scale)

    def init_weights(self, init_std: float, buffer_device: torch.device | None = None) -> None:
        """Initialize the router, experts and shared expert (torchtitan's scheme) and zero
        the buffers, created anew on ``buffer_device`` (default: where they are)."""
        self.router.init_weights(init_std)
        self.experts.init_weights(init_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(init_std)
        device = buffer_device or self.tokens_per_expert.device
        for name, dtype in (("expert_bias", torch.float32), ("tokens_per_expert", torch.int64)):
            if getattr(self, name) is not None:
                setattr(self, name, torch.zeros(self.num_experts, dtype=dtype, device=device))
        self.aux_loss = torch.zeros((), dtype=torch.float32, device=device)
