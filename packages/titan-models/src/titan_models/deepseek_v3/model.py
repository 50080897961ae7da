"""The DeepSeek-V3 decoder: multi-head latent attention (MLA) with decoupled, YaRN-scaled
RoPE, dense SwiGLU blocks, then mixture-of-experts blocks (:class:`titan_models.moe.MoE`).

Parameter names and shapes equal torchtitan's DeepSeek-V3 of July 2025, so its checkpoints
load unchanged (its ``freqs_cis`` buffer aside: here the RoPE table is derived from the args
and stays out of checkpoints, as in titan's Llama 3). Build and materialize it as Llama 3
(``titan_models.llama3.model``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from titan_models import init
from titan_models.decoder import Decoder, DecoderBlock, attend, depth_init_std
from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.documents import DocumentMask
from titan_models.fused import FusedRMSNorm
from titan_models.kv_cache import LayerKVCache
from titan_models.llama3.model import CausalAttention, FeedForward, apply_rope, rope_table
from titan_models.moe import MoE

__all__ = [
    "DeepSeekV3",
    "MultiHeadLatentAttention",
    "TransformerBlock",
    "yarn_rope_table",
]


def _yarn_inv_freq(inv_freq: torch.Tensor, args: DeepSeekV3Args) -> torch.Tensor:
    """YaRN as DeepSeek-V3 applies it: frequencies that turn more than ``beta_fast`` times
    within ``original_seq_len`` are kept, those that turn fewer than ``beta_slow`` times are
    divided by ``rope_factor``, and the channel pairs in between blend linearly."""
    dim, base = args.qk_rope_head_dim, args.rope_theta

    def pair_index(turns: float) -> float:
        # The channel pair whose wavelength fits ``turns`` times into original_seq_len.
        return dim * math.log(args.original_seq_len / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_index(args.beta_fast)), 0)
    high = min(math.ceil(pair_index(args.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pairs = torch.arange(dim // 2, dtype=inv_freq.dtype, device=inv_freq.device)
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)
    # ramp 0: kept (high frequency), 1: fully interpolated (low frequency).
    return inv_freq / args.rope_factor * ramp + inv_freq * (1 - ramp)


def yarn_rope_table(args: DeepSeekV3Args, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`titan_models.llama3.model.rope_table` over the ``qk_rope_head_dim`` rotated
    channels, YaRN-scaled when ``args.yarn`` (so the context-parallel hooks pick rows by
    position the same way)."""
    scaling = functools.partial(_yarn_inv_freq, args=args) if args.yarn else None
    return rope_table(args.qk_rope_head_dim, args.max_seq_len, args.rope_theta, scaling, device)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention: keys and values come from one low-rank latent per token
    (``wkv_a`` -> ``kv_norm`` -> ``wkv_b``), queries from ``wq`` or, with ``q_lora_rank``,
    a low-rank ``wq_a`` -> ``q_norm`` -> ``wq_b``. Each head's query/key has
    ``qk_nope_head_dim`` channels without position and ``qk_rope_head_dim`` rotated ones; the
    key's rotated part is computed once (in ``wkv_a``) and shared by all heads.

    Head counts are read off the projections' outputs, so the same code runs on a
    tensor-parallel shard holding some of the heads (``wq``/``wq_b``/``wkv_b`` column-wise,
    ``wo`` row-wise; ``wkv_a``, ``wq_a`` and the norms are per token, not per head). The
    attention itself is the ``inner_attention`` submodule (causal SDPA at the default scale
    1/sqrt(qk_head_dim)), which a context-parallel plan swaps; a YaRN softmax scale is folded
    into the queries first, so a swapped attention needs no scale argument.
    """

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        q_out = args.n_heads * args.qk_head_dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, q_out, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, self.q_lora_rank, bias=False)
            self.q_norm = FusedRMSNorm(self.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.wkv_a = nn.Linear(args.dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False)
        self.kv_norm = FusedRMSNorm(self.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, args.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * self.v_head_dim, args.dim, bias=False)
        self.inner_attention = CausalAttention()
        # SDPA scales by 1/sqrt(qk_head_dim); this makes it args.softmax_scale.
        self.q_scale = args.softmax_scale * self.qk_head_dim**0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        *,
        cache: LayerKVCache | None = None,
        mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        """``cache``: this layer's keys and values so far (incremental decoding; ``rope``
        then holds per-row angles); without it, causal attention over ``x`` alone."""
        bs, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seqlen, -1, self.qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, rope)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale

        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), rope)  # (bs, seq, 1, rope dim): all heads
        kv = self.wkv_b(self.kv_norm(latent)).view(
            bs, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim
        )
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)

        # The cache attends at SDPA's default scale too: q_scale is already in the queries.
        return self.wo(attend(self.inner_attention, q, k, v, cache, mask))

    def init_weights(self, init_std: float) -> None:
        projections = [self.wkv_a, self.wkv_b]
        projections += [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        for linear in projections:
            init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank:
            self.q_norm.reset_parameters()


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block: attention, then a dense SwiGLU ``feed_forward`` (blocks
    before ``n_dense_layers``) or a mixture of experts ``moe`` (the others)."""

    def __init__(self, layer_id: int, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.attention_norm = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MultiHeadLatentAttention(args)
        self.ffn_norm = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args.moe_args(), dim=args.dim, hidden_dim=args.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.inter_dim)
        self.init_std = depth_init_std(layer_id, args.n_layers)


class DeepSeekV3(Decoder):
    """DeepSeek-V3: token embedding, ``n_layers`` blocks, final norm and output projection
    (``titan_models.decoder.Decoder``)."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__(args, TransformerBlock)

    def _rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        return yarn_rope_table(self.args, device)
