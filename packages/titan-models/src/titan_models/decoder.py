"""What the decoder families (Llama 3, Qwen3, DeepSeek-V3) share: the attention tail, the
pre-norm residual block, and the model around the blocks (forward, cached forward, init).
A family supplies its attention, its feed-forward and its RoPE table.

``layers`` is a ``ModuleDict`` keyed by ``str(index)``: a pipeline stage deletes the blocks it
does not own (and sets ``tok_embeddings``/``norm``/``output`` to ``None``), and the remaining
parameters keep their names, so checkpoints stay stage-independent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from titan_models import init
from titan_models.documents import DocumentMask, check_no_documents, document_inputs
from titan_models.fused import FusedRMSNorm
from titan_models.kv_cache import KVCache, LayerKVCache

__all__ = ["Decoder", "DecoderBlock", "attend", "depth_init_std"]


def attend(
    inner: nn.Module,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerKVCache | None,
    mask: DocumentMask | None,
) -> torch.Tensor:
    """Attention of ``q``, ``k``, ``v`` (batch, seq, heads, dim) through the layer's ``cache``
    (incremental decoding), else its ``inner`` attention module (which a context-parallel
    plan swaps, so it gets ``mask`` only when there is one); (batch, seq, heads * v_dim)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        out = cache.attend(q, k, v)
    elif mask is None:
        out = inner(q, k, v)
    else:
        out = inner(q, k, v, mask=mask)
    return out.transpose(1, 2).flatten(2)


def depth_init_std(layer_id: int, n_layers: int, depth_init: bool = True) -> float:
    """Output projections' init std: deeper blocks start smaller (by depth, or all by
    ``n_layers``) so the residual stream's variance does not grow with depth."""
    depth = layer_id + 1 if depth_init else n_layers
    return 0.02 / (2 * depth) ** 0.5


class DecoderBlock(nn.Module):
    """Pre-norm residual block: ``attention``, then a dense ``feed_forward`` or, where
    ``moe_enabled``, a mixture of experts ``moe``. A family's subclass builds the modules
    (``attention_norm``, ``attention``, ``ffn_norm``, the feed-forward) and ``init_std``."""

    moe_enabled: bool = False
    init_std: float

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


class Decoder(nn.Module):
    """Token embedding, ``n_layers`` blocks (``block(layer_id, args)``), final norm and
    output projection, and a RoPE table (``rope``) derived from the args: out of
    checkpoints, rebuilt by :meth:`init_weights` after a meta-device construction.

    With ``args.enable_weight_tying`` the output projection's weight *is* the embedding's
    (one ``Parameter`` under both names: ``parameters()`` yields it once, ``state_dict()``
    has both keys, as torchtitan's). Anything that replaces parameters (``to_empty``, a
    tensor parallel plan) unties them; :meth:`tie_weights` ties them again, and
    :meth:`init_weights` calls it first. A pipeline stage holding one end keeps that end's
    weight alone.
    """

    def __init__(self, args: Any, block: Callable[[int, Any], nn.Module]) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): block(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = FusedRMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def _rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        raise NotImplementedError

    @property
    def _tied(self) -> bool:
        return bool(getattr(self.args, "enable_weight_tying", False))

    def tie_weights(self) -> None:
        """With ``enable_weight_tying``, make ``output.weight`` the embedding's ``Parameter``
        (when this model, or stage, holds both ends; else nothing to tie)."""
        if self._tied and self.tok_embeddings is not None and self.output is not None:
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
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if cache is not None:
            check_no_documents(document_ids, positions)
            rope = cache.rope_rows(self.rope, tokens.shape[1])
            for name, layer in self.layers.items():
                h = layer(h, rope, cache=cache.layer(int(name)))
            cache.advance(tokens.shape[1])
        elif document_ids is None and positions is None:
            # The whole table goes down: attention slices it to the sequence length it sees,
            # which under sequence parallel is longer than this (sharded) hidden state's.
            for layer in self.layers.values():
                h = layer(h, self.rope)
        else:
            rope, mask = document_inputs(self.rope, document_ids, positions)
            for layer in self.layers.values():
                h = layer(h, rope, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_buffers(self, buffer_device: torch.device | str | None = None) -> None:
        """Compute the RoPE table again (on ``buffer_device``, by default where it already
        lives): what ``init_weights`` does for the model's buffers, and all the memory that
        takes beside the parameters (``titan-train estimate`` records it on fake tensors)."""
        device = buffer_device if buffer_device is not None else self.rope.device
        self.rope = self._rope_table(device)

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """Tie a tied output to the embedding again, initialize every parameter, the MoE
        blocks' expert-balance buffers and the RoPE table (on ``buffer_device``, by default
        where the table already lives). Works on sharded (DTensor) parameters.

        The output projection starts with unit-ish logits (std dim^-1/2, cut at 3 sigma); a
        tied matrix gets that init, whichever end of the model a pipeline stage holds."""
        self.tie_weights()
        device = buffer_device if buffer_device is not None else self.rope.device
        self.init_buffers(device)
        std = self.args.dim**-0.5
        if self.tok_embeddings is not None:
            w = self.tok_embeddings.weight
            if self._tied:
                init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
            else:
                init.normal_(w)
        for layer in self.layers.values():
            layer.init_weights(device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not (self._tied and self.tok_embeddings is not None):
            init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
