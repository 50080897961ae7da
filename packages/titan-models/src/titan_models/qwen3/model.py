"""The Qwen3 decoder: grouped-query attention with RMSNorm on every query and key head
(QK-norm) before RoPE, SwiGLU feed-forward (Llama 3's ``FeedForward``) or mixture-of-experts
blocks (``titan_models.moe.MoE``: softmax top-k routing, renormalized weights, no shared
expert), and an output projection tied to the token embedding where the flavor ties them.

Parameter names and shapes equal torchtitan's Qwen3 (``layers.<i>.attention.q_norm.weight``,
``layers.<i>.moe.experts.w1``, ``output.weight``...), and so does its RoPE layout: the pairs
``(i, i + head_dim/2)`` of each head rotate together (HF's ``rotate_half``), not Llama 3's
adjacent pairs, so Hugging Face weights load without permuting any row. Build and
materialize it as Llama 3 (``titan_models.llama3.model``); ``init_weights`` re-ties a tied
output to the embedding first.
"""

from __future__ import annotations

import torch

from titan_models.decoder import Decoder, DecoderBlock, depth_init_std
from titan_models.fused import FusedRMSNorm
from titan_models.llama3.model import Attention, FeedForward, rope_table
from titan_models.moe import MoE
from titan_models.qwen3.args import Qwen3Args

__all__ = ["Qwen3", "Qwen3Attention", "Qwen3Block"]


class Qwen3Attention(Attention):
    """Llama 3's grouped-query attention with per-head RMSNorm on queries and keys
    (``q_norm``, ``k_norm``: one ``head_dim`` weight each, shared by all heads) applied
    before RoPE, which rotates HF's half-split pairs. ``inner_attention`` is the submodule a
    context-parallel plan swaps.
    """

    half_split = True

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args)
        self.q_norm = FusedRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = FusedRMSNorm(args.head_dim, eps=args.norm_eps)

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class Qwen3Block(DecoderBlock):
    """Pre-norm residual block: attention, then a dense SwiGLU ``feed_forward`` or, in an MoE
    model's sparse blocks, a mixture of experts ``moe``."""

    def __init__(self, layer_id: int, args: Qwen3Args) -> None:
        super().__init__()
        self.attention_norm = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Qwen3Attention(args)
        self.ffn_norm = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = args.is_moe_layer(layer_id)
        if self.moe_enabled:
            self.moe = MoE(args.moe_args(), dim=args.dim, hidden_dim=args.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.init_std = depth_init_std(layer_id, args.n_layers, args.depth_init)


class Qwen3(Decoder):
    """Qwen3: token embedding, ``n_layers`` blocks, final norm and output projection, tied
    to the embedding where the flavor ties them (``titan_models.decoder.Decoder``)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__(args, Qwen3Block)

    def _rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        a = self.args
        return rope_table(a.head_dim, a.max_seq_len, a.rope_theta, None, device)
