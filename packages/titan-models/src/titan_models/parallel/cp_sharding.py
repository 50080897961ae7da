"""Load-balanced sequence sharding for context parallel: the foundation every context-parallel
attention (all-gather, ring, torch's) and the batch sharding stand on.

The sequence is cut into ``2 x cp`` chunks and rank r holds chunks r and ``2 cp - 1 - r``:
under a causal mask an early chunk is cheap and a late one expensive, so every rank gets the
same amount of work. torch's ``context_parallel`` load balancing places the same chunks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ShardedAttention", "context_parallel_positions", "context_parallel_shard"]


def context_parallel_positions(
    seq_len: int, cp_rank: int, cp: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions of the ``seq_len / cp`` tokens ``cp_rank`` holds, in local order:
    chunk ``cp_rank`` then chunk ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks. Made on
    ``device`` directly (a host tensor copied to an accelerator would wait for its stream)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} must be divisible by 2 x cp = {2 * cp} for load-balanced "
            "context parallel."
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk, device=device)
    return torch.cat((first, second))


def context_parallel_shard(
    tensor: torch.Tensor, cp_rank: int, cp: int, *, dim: int = 1
) -> torch.Tensor:
    """This rank's load-balanced share of ``tensor`` along ``dim`` (the sequence): apply it
    to the inputs and to the labels alike."""
    positions = context_parallel_positions(tensor.shape[dim], cp_rank, cp, device=tensor.device)
    return tensor.index_select(dim, positions)


class ShardedAttention(nn.Module):
    """Base of the context-parallel attentions that exchange K/V themselves: holds the ``cp``
    group, its size and this rank's place in it."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = cp_mesh.get_group()
        self.cp = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()
