"""Ring context-parallel attention (``cp_attention="titan_ring"``): K/V blocks travel around
the ``cp`` ranks and each rank merges its queries' attention over every block with an online
softmax, holding two blocks (its own and the one in flight), not the whole sequence.

Sharding as :mod:`titan_models.parallel.cp_sharding`. Step s attends this rank's queries to
rank ``r - s``'s block, causally masked by global positions, while the next block is on its
way; blocks merge by log-sum-exp. The backward sends the blocks around once more with their
gradient accumulators, recomputing probabilities from the saved log-sum-exp, as flash
attention does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_models.parallel.cp_sharding import ShardedAttention, context_parallel_positions

__all__ = ["RingContextParallelAttention"]


def _rotate(tensor: torch.Tensor, group: dist.ProcessGroup, rank: int, size: int):
    """Start sending ``tensor`` to the next rank of ``group`` and receiving the previous
    rank's into a new buffer; return the buffer and the pending works."""
    buffer = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, buffer, group=group, group_peer=(rank - 1) % size),
    ]
    return buffer, dist.batch_isend_irecv(ops)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked ``q k^T * scale`` of grouped queries (batch, kv_heads, n_rep, q_len, dim)
    against keys (batch, kv_heads, k_len, dim)."""
    scores = (q @ k.unsqueeze(2).transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf"))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_rank, cp, group):
        # q: (batch, kv_heads, n_rep, q_len, dim); k, v: (batch, kv_heads, k_len, dim).
        dtype = torch.promote_types(q.dtype, torch.float32)
        scale = q.shape[-1] ** -0.5
        seq_len = q.shape[-2] * cp
        q_pos = context_parallel_positions(seq_len, cp_rank, cp, device=q.device)
        qf = q.to(dtype)
        kv = torch.stack((k, v))
        out = lse = None
        for step in range(cp):
            pending = None
            if step < cp - 1:
                received, pending = _rotate(kv, group, cp_rank, cp)
            source = (cp_rank - step) % cp
            k_pos = context_parallel_positions(seq_len, source, cp, device=q.device)
            mask = q_pos[:, None] >= k_pos[None, :]
            # Every block has a visible key: with load balancing, this rank's second chunk
            # comes after every rank's first one (no host-side mask.any(): a sync on GPUs).
            scores = _scores(qf, kv[0].to(dtype), mask, scale)
            block_lse = scores.logsumexp(-1)
            # Rows with no visible key here: -inf; subtracting 0 keeps their weights 0.
            safe = block_lse.masked_fill(block_lse.isinf(), 0.0)
            block_out = torch.exp(scores - safe[..., None]) @ kv[1].to(dtype).unsqueeze(2)
            if out is None:
                # Step 0 is this rank's own block: every query sees at least itself.
                out, lse = block_out, block_lse
            else:
                merged = torch.logaddexp(lse, block_lse)
                out = (
                    out * torch.exp(lse - merged)[..., None]
                    + block_out * torch.exp(block_lse - merged)[..., None]
                )
                lse = merged
            if pending is not None:
                for work in pending:
                    work.wait()
                kv = received
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (cp_rank, cp, group)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp_rank, cp, group = ctx.ring
        dtype = out.dtype
        scale = q.shape[-1] ** -0.5
        seq_len = q.shape[-2] * cp
        q_pos = context_parallel_positions(seq_len, cp_rank, cp, device=q.device)
        qf, grad_out = q.to(dtype), grad_out.to(dtype)
        # Softmax backward: dS = P (dP - rowsum(dO * O)).
        delta = (grad_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        # Each K/V block travels with its gradient accumulators: (k, v, dk, dv).
        zeros = torch.zeros_like(k, dtype=dtype)
        state = torch.stack((k.to(dtype), v.to(dtype), zeros, zeros))
        for step in range(cp):
            source = (cp_rank - step) % cp
            k_pos = context_parallel_positions(seq_len, source, cp, device=q.device)
            mask = q_pos[:, None] >= k_pos[None, :]
            # Every block has a visible key: with load balancing, this rank's second chunk
            # comes after every rank's first one (no host-side mask.any(): a sync on GPUs).
            block_k, block_v = state[0], state[1]
            probs = torch.exp(_scores(qf, block_k, mask, scale) - lse[..., None])
            d_probs = grad_out @ block_v.unsqueeze(2).transpose(-1, -2)
            d_scores = probs * (d_probs - delta) * scale
            dq += d_scores @ block_k.unsqueeze(2)
            # Sum over the query heads that share each key/value head.
            dk = (d_scores.transpose(-1, -2) @ qf).sum(2)
            dv = (probs.transpose(-1, -2) @ grad_out).sum(2)
            state = torch.stack((block_k, block_v, state[2] + dk, state[3] + dv))
            # After the last block only the accumulators need to go home (one more hop).
            send = state if step < cp - 1 else state[2:].contiguous()
            received, pending = _rotate(send, group, cp_rank, cp)
            for work in pending:
                work.wait()
            state = received
        dk, dv = state[-2], state[-1]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class RingContextParallelAttention(ShardedAttention):
    """Causal attention of this rank's load-balanced queries over the keys and values of the
    whole ``cp`` group, passed around a ring; drop-in for
    :class:`~titan_models.llama3.model.CausalAttention`. Same results as
    :class:`~titan_models.parallel.ContextParallelAttention`, with K/V memory of two
    blocks instead of the whole sequence."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, length, dim = q.shape
        kv_heads = k.shape[1]
        # Query head h uses key/value head h // n_rep (as repeat_interleave would).
        grouped = q.reshape(batch, kv_heads, heads // kv_heads, length, dim)
        out = _RingAttention.apply(
            grouped, k.contiguous(), v.contiguous(), self.cp_rank, self.cp, self.group
        )
        return out.reshape(batch, heads, length, dim)
