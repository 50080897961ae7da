"""The Qwen3 decoder: grouped-query attention with RMSNorm on every query and key head
(QK-norm) before RoPE, SwiGLU feed-forward (Llama 3's ``FeedForward``) or mixture-of-experts
blocks (``titan_models.moe.MoE``: softmax top-k routing, renormalized weights, no shared
expert), and an output projection tied to the token embedding where the flavor ties them.

Parameter names and shapes equal torchtitan's Qwen3 (``layers.<i>.attention.q_norm.weight``,
``layers.<i>.moe.experts.w1``, ``output.weight``...), and so does its RoPE layout: the pairs
``(i, i + head_dim/2)`` of each head rotate together (HF's ``rotate_half``), not Llama 3's
adjacent pairs, so Hugging Face weights load without permuting any row. The model knows
nothing about parallelism; build it on the meta device, parallelize, then materialize:

    with torch.device("meta"):
        model = Qwen3(qwen3_args("0.6B"))
    ...  # parallelize
    model.to_empty(device=titan_dims.detect_device_type())
    model.init_weights()  # re-ties a tied output to the embedding first
"""

from __future__ import annotations

import torch
from torch import nn

from titan_models import init
from titan_models.documents import DocumentMask, check_no_documents, document_inputs
from titan_models.fused import FusedRMSNorm
from titan_models.kv_cache import KVCache, LayerKVCache, cached_forward
from titan_models.llama3.model import CausalAttention, FeedForward, apply_rope, rope_table
from titan_models.moe import MoE
from titan_models.qwen3.args import Qwen3Args

__all__ = ["Qwen3", "Qwen3Attention", "Qwen3Block"]


class Qwen3Attention(nn.Module):
    """Grouped-query self-attention with per-head RMSNorm on queries and keys (``q_norm``,
    ``k_norm``: one ``head_dim`` weight each, shared by all heads) applied before RoPE.

    Head counts are read off the projections' outputs (``view(..., -1, head_dim)``), so the
    same code runs on a tensor-parallel shard that holds only some of the heads; the
    attention itself is the ``inner_attention`` submodule, which a context-parallel plan
    swaps.
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = FusedRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = FusedRMSNorm(args.head_dim, eps=args.norm_eps)
        self.inner_attention = CausalAttention()

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
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope, half_split=True), apply_rope(k, rope, half_split=True)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            out = cache.attend(q, k, v)
        elif mask is None:
            out = self.inner_attention(q, k, v)
        else:
            out = self.inner_attention(q, k, v, mask=mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class Qwen3Block(nn.Module):
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
        # Deeper blocks start with smaller output projections so the residual stream's
        # variance does not grow with depth.
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.init_std = 0.02 / (2 * depth) ** 0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: torch.Tensor,
        *,
        cache: LayerKVCache | None = None,
        mask: DocumentMask | None = None,
    ) -> torch.Tensor:
        # The cache goes by keyword: tensor-parallel plans prepare the positional inputs.
        if cache is not None:
            h = x + self.attention(self.attention_norm(x), rope, cache=cache)
        elif mask is None:
            h = x + self.attention(self.attention_norm(x), rope)
        else:
            h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return h + ffn(self.ffn_norm(h))

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.init_std)


class Qwen3(nn.Module):
    """Qwen3: token embedding, ``n_layers`` blocks, final norm and output projection.

    ``layers`` is a ``ModuleDict`` keyed by ``str(index)``: a pipeline stage deletes the
    blocks it does not own (and sets ``tok_embeddings``/``norm``/``output`` to ``None``),
    and the remaining parameters keep their names, so checkpoints stay stage-independent.

    With ``enable_weight_tying`` the output projection's weight *is* the embedding's (one
    ``Parameter`` under both names: ``parameters()`` yields it once, ``state_dict()`` has
    both keys, as torchtitan's). Anything that replaces parameters (``to_empty``, a tensor
    parallel plan) unties them; :meth:`tie_weights` ties them again, and :meth:`init_weights`
    calls it first. A pipeline stage holding one end keeps that end's weight alone.
    """

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Qwen3Block(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Derived from args, so it stays out of checkpoints; rebuilt by init_weights after
        # a meta-device construction.
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def _rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        a = self.args
        return rope_table(a.head_dim, a.max_seq_len, a.rope_theta, None, device)

    def tie_weights(self) -> None:
        """With ``enable_weight_tying``, make ``output.weight`` the embedding's ``Parameter``
        (when this model, or stage, holds both ends; else nothing to tie)."""
        tied = self.args.enable_weight_tying
        if tied and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tokens`` (batch, seq) int64 -> logits (batch, seq, vocab). On a pipeline stage
        without the embedding, ``tokens`` is the previous stage's hidden state; on one
        without the output, the hidden state is returned.

        With a ``cache`` (``titan_models.kv_cache``), ``tokens`` are the next tokens after
        those the cache holds: they attend to the cached keys too, and are cached.

        Packed windows (``titan_models.documents``): ``document_ids`` (batch, seq) makes
        attention block-causal (no token attends across a document boundary); ``positions``
        (batch, seq) are each token's RoPE positions (e.g. restarting per document),
        by default 0, 1, ... Without both, the plain causal path runs unchanged."""
        if cache is not None:
            check_no_documents(document_ids, positions)
            return cached_forward(self, tokens, cache)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        # The whole table goes down: attention slices it to the sequence length it sees,
        # which under sequence parallel is longer than this (sharded) hidden state's.
        if document_ids is None and positions is None:
            for layer in self.layers.values():
                h = layer(h, self.rope)
        else:
            rope, mask = document_inputs(self.rope, document_ids, positions)
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Tie the output to the embedding again (see the class docstring), initialize every
        parameter, the MoE blocks' expert-balance buffers and the RoPE table (on
        ``buffer_device``, by default where the table already lives). Works on sharded
        (DTensor) parameters.

        A tied matrix gets the output projection's init (std dim^-1/2: logits start with
        unit-ish scale), whichever end of the model a pipeline stage holds."""
        self.tie_weights()
        device = buffer_device if buffer_device is not None else self.rope.device
        self.rope = self._rope_table(device)
        std = self.args.dim**-0.5
        if self.tok_embeddings is not None:
            if self.args.enable_weight_tying:
                w = self.tok_embeddings.weight
                init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
            else:
                init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(device)
        if self.norm is not None:
            self.norm.reset_parameters()
        tied_here = self.args.enable_weight_tying and self.tok_embeddings is not None
        if self.output is not None and not tied_here:
            # Logits start with unit-ish scale: std dim^-1/2, cut at 3 sigma.
            w = self.output.weight
            init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
