"""The Llama 3 decoder: RMSNorm, RoPE with Llama 3.1 scaling, grouped-query attention through
``scaled_dot_product_attention``, and SwiGLU feed-forward layers.

Parameter names and shapes equal torchtitan's Llama 3, so its checkpoints load unchanged.
The model knows nothing about parallelism; ``titan_models.llama3.parallelize`` applies the
plans. Build it on the meta device, parallelize, then materialize:

    with torch.device("meta"):
        model = Llama3(llama3_args("8B"))
    ...  # parallelize
    model.to_empty(device=titan_dims.detect_device_type())
    model.init_weights()
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional

from titan_models import init
from titan_models.decoder import Decoder, DecoderBlock, attend, depth_init_std
from titan_models.documents import DocumentMask, masked_attention
from titan_models.fused import FusedRMSNorm
from titan_models.kv_cache import LayerKVCache
from titan_models.llama3.args import Llama3Args, RopeScaling
from titan_models.ops import repeat_kv

__all__ = [
    "Attention",
    "CausalAttention",
    "FeedForward",
    "Llama3",
    "TransformerBlock",
    "apply_rope",
    "rope_table",
]


def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are divided by ``factor``, short ones kept, and
    the band in between blends the two linearly in (context length / wavelength)."""
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    # Where each wavelength sits between the two band edges: <= 0 fully scaled, >= 1 kept.
    blend = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blend = blend.clamp(0.0, 1.0)
    return blend * inv_freq + (1 - blend) * inv_freq / scaling.factor


def rope_table(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | Callable[[torch.Tensor], torch.Tensor] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Cosines and sines of every (position, channel pair): shape
    ``(max_seq_len, head_dim // 2, 2)``, fp32, ``[..., 0]`` the cosine. ``scaling``: Llama
    3.1's, or a function of the (float64) inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if isinstance(scaling, RopeScaling):
        inv_freq = _scaled_inv_freq(inv_freq, scaling)
    elif scaling is not None:
        inv_freq = scaling(inv_freq)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def apply_rope(x: torch.Tensor, table: torch.Tensor, *, half_split: bool = False) -> torch.Tensor:
    """Rotate each adjacent channel pair ``(x[2i], x[2i+1])`` of ``x`` (batch, seq, heads,
    head_dim) by its position's angle: Meta's interleaved layout, which the HF adapter
    permutes to and from HF's half-split one. ``half_split=True`` rotates the pairs
    ``(x[i], x[i + head_dim/2])`` instead (HF's ``rotate_half`` layout, which Qwen3 uses in
    torchtitan too), by the same angles.

    ``table`` is the model's (positions, head_dim // 2, 2), read from position 0, or per-row
    angles (batch, seq, head_dim // 2, 2), as ``KVCache.rope_rows`` picks them."""
    if table.dim() == 4:
        # Per-row angles: each row's tokens at their own positions; broadcast over heads.
        table = table.float()[:, :, None]
    else:
        if x.shape[1] > table.shape[0]:
            raise ValueError(
                f"Sequence length {x.shape[1]} exceeds the RoPE table's {table.shape[0]} "
                "positions; build the model with a larger max_seq_len."
            )
        # table: (positions, head_dim // 2, 2) -> the first seq positions, broadcast over
        # batch and heads. (.float(): a caller may hand the table over in a lower precision.)
        table = table[: x.shape[1]].float()[None, :, None]
    if half_split:
        first, second = x.float().chunk(2, dim=-1)
        cos, sin = table[..., 0], table[..., 1]
        rotated = (first * cos - second * sin, second * cos + first * sin)
        return torch.cat(rotated, dim=-1).type_as(x)
    if torch.compiler.is_compiling():
        # Inductor fuses these real ops into one kernel; complex ones it leaves unfused.
        pairs = x.float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        cos, sin = table[..., 0], table[..., 1]
        rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return rotated.flatten(-2).type_as(x)
    # In eager mode a complex multiplication is one kernel each way instead of a dozen real
    # ones: 3-6x faster on CPU, the same bits.
    rotation = torch.view_as_complex(table.contiguous())
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


class CausalAttention(nn.Module):
    """``softmax(q k^T / sqrt(d) + causal mask) v`` over (batch, heads, seq, head_dim), with
    key/value heads shared by groups of query heads. A module (without parameters) so that a
    parallelize plan can swap it, e.g. for context-parallel attention."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        """``mask``: a document mask (``titan_models.documents``) instead of the causal one."""
        if mask is not None:
            return masked_attention(q, k, v, mask)
        k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE on queries and keys.

    Head counts are read off the projections' outputs (``view(..., -1, head_dim)``), so the
    same code runs on a tensor-parallel shard that holds only some of the heads.
    """

    half_split = False
    """RoPE's pair layout (see :func:`apply_rope`)."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        kv_heads = args.kv_heads if hasattr(args, "kv_heads") else args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.inner_attention = CausalAttention()

    def _qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

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
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = self._qk_norm(q, k)
        q = apply_rope(q, rope, half_split=self.half_split)
        k = apply_rope(k, rope, half_split=self.half_split)
        return self.wo(attend(self.inner_attention, q, k, v, cache, mask))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(functional.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(DecoderBlock):
    """Pre-norm residual block: attention, then SwiGLU feed-forward."""

    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.init_std = depth_init_std(layer_id, args.n_layers, args.depth_init)


class Llama3(Decoder):
    """Llama 3: token embedding, ``n_layers`` blocks, final norm and output projection
    (``titan_models.decoder.Decoder``)."""

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args, TransformerBlock)

    def _rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        a = self.args
        return rope_table(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device)
