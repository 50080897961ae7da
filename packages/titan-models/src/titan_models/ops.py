"""Small tensor operations shared by the model, its parallel attentions and its plans."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["plain_loss", "repeat_kv"]


def plain_loss(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` as a plain tensor: a replicated DTensor (a loss under loss parallel) is
    gathered; anything else is returned as is."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def repeat_kv(k: torch.Tensor, v: torch.Tensor, n_rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention's key/value heads, each repeated for the ``n_rep`` consecutive
    query heads it serves: (batch, kv_heads, seq, dim) -> (batch, kv_heads x n_rep, seq, dim).
    ``n_rep == 1`` returns them as they are."""
    if n_rep == 1:
        return k, v
    return k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
