"""Context parallel that trains on any device: load-balanced sequence sharding and causal
attention over all-gathered keys and values.

torch 2.13's ``context_parallel`` has no CPU sharding rule for SDPA and FlexAttention has no
CPU backward, so this is our own. The sequence is cut into ``2 x cp`` chunks and rank r
holds chunks r and ``2 cp - 1 - r``: under a causal mask an early chunk is cheap and a late
one expensive, so every rank gets the same amount of work. In attention, each rank
all-gathers K and V from the ``cp`` group (backward: reduce-scatter of their gradients) and
attends its own queries to every key at an earlier or equal global position.

Memory: each rank holds the full sequence's K/V per layer for the duration of one
attention; a ring with an online-softmax merge would hold 2/cp of it, and is future work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import functional

__all__ = [
    "ContextParallelAttention",
    "apply_context_parallel",
    "context_parallel_positions",
    "context_parallel_shard",
]


def context_parallel_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """The global positions of the ``seq_len / cp`` tokens ``cp_rank`` holds, in local order:
    chunk ``cp_rank`` then chunk ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"seq_len={seq_len} must be divisible by 2 x cp = {2 * cp} for load-balanced "
            "context parallel."
        )
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat((first, second))


def context_parallel_shard(
    tensor: torch.Tensor, cp_rank: int, cp: int, *, dim: int = 1
) -> torch.Tensor:
    """This rank's load-balanced share of ``tensor`` along ``dim`` (the sequence): apply it
    to the inputs and to the labels alike."""
    positions = context_parallel_positions(tensor.shape[dim], cp_rank, cp)
    return tensor.index_select(dim, positions.to(tensor.device))


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (sequence of (batch, heads, seq, head_dim)); the backward
    reduce-scatters (sums) the gradients, since every rank's attention used every shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        # Gather along the leading dim (contiguous chunks), then move it next to seq.
        x = x.movedim(2, 0).contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        grad = grad.movedim(2, 0).contiguous()
        out = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, 2), None


class ContextParallelAttention(nn.Module):
    """Causal attention of this rank's load-balanced queries over the keys and values of the
    whole ``cp`` group; drop-in for :class:`~titan_models.llama3.model.CausalAttention`."""

    def __init__(self, cp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.group = cp_mesh.get_group()
        self.cp = cp_mesh.size()
        self.cp_rank = cp_mesh.get_local_rank()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        local = q.shape[2]
        seq_len = local * self.cp
        k = _AllGatherSeq.apply(k, self.group)
        v = _AllGatherSeq.apply(v, self.group)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        q_pos = context_parallel_positions(seq_len, self.cp_rank, self.cp).to(q.device)
        k_pos = torch.cat(
            [context_parallel_positions(seq_len, r, self.cp) for r in range(self.cp)]
        ).to(q.device)
        mask = q_pos[:, None] >= k_pos[None, :]
        return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rope_for_positions(cp_rank: int, cp: int):
    """A forward pre-hook for an attention module ``forward(x, rope)``: hand it the RoPE
    rows of this rank's global positions, so local token j is rotated by its true position."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, rope = args
        positions = context_parallel_positions(x.shape[1] * cp, cp_rank, cp)
        return x, rope.index_select(0, positions.to(rope.device))

    return hook


def apply_context_parallel(attentions: list[nn.Module], cp_mesh: DeviceMesh) -> None:
    """Make every attention module (``forward(x, rope)`` with an ``inner_attention``)
    context-parallel over ``cp_mesh``: its inputs are this rank's load-balanced share of
    the sequence (see :func:`context_parallel_shard`). Apply after tensor parallel, whose
    input hook must see the sequence first."""
    cp, cp_rank = cp_mesh.size(), cp_mesh.get_local_rank()
    for attention in attentions:
        attention.inner_attention = ContextParallelAttention(cp_mesh)
        attention.register_forward_pre_hook(_rope_for_positions(cp_rank, cp))
