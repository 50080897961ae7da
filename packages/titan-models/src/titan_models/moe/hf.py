"""The Hugging Face layouts of an MoE layer's routed experts, shared by the adapters of every
family built on :class:`titan_models.moe.MoE` (DeepSeek-V3, Qwen3-MoE).

Here the experts are stacked: ``w1``/``w3`` (experts, dim, hidden), ``w2`` (experts, hidden,
dim). An HF checkpoint holds one ``nn.Linear`` weight per expert and projection (the
transpose of one slice); transformers 5 holds them fused in memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["experts_from_fused", "stack_experts"]


def stack_experts(stack: dict[int, torch.Tensor], num_experts: int) -> torch.Tensor:
    """One stacked projection (``w1``, ``w2`` or ``w3``) from HF's per-expert weights
    ``stack`` (expert index -> weight), emptied as it goes so each tensor is held once."""
    return torch.stack([stack.pop(j).t() for j in range(num_experts)])


def experts_from_fused(
    prefix: str, name: str, value: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """titan's stacked experts from transformers 5's fused in-memory form: ``gate_up_proj``
    (experts, 2 hidden, dim), gate rows first, and ``down_proj`` (experts, dim, hidden), both
    left-multiplied, so transposed per expert."""
    if name == "down_proj":
        yield f"{prefix}moe.experts.w2", value.transpose(1, 2).contiguous()
        return
    gate, up = value.chunk(2, dim=1)
    yield f"{prefix}moe.experts.w1", gate.transpose(1, 2).contiguous()
    yield f"{prefix}moe.experts.w3", up.transpose(1, 2).contiguous()
