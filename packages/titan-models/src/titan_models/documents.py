"""Document masking for packed windows: attention that never crosses a document boundary.

A document ends after each EOS token. With masking a token attends only to earlier tokens of
its own document (block-causal), and RoPE may restart at 0 in each document, so a packed
window computes what each document alone computes. :func:`document_ids` and
:func:`document_positions` number the documents and the positions within them;
:func:`document_mask` builds the mask once per forward (the models' ``forward(tokens, *,
document_ids=..., positions=...)`` calls it) and :func:`masked_attention` applies it. The
mask is FlexAttention's ``BlockMask`` where :func:`flex_attention_supported` (probed once per
device type by running it) says it works; else, and always on the CPU (the exact path), a
boolean ``(batch, 1, seq, seq)`` SDPA mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from titan_models.ops import repeat_kv

__all__ = [
    "DocumentMask",
    "DocumentMasking",
    "check_no_documents",
    "document_ids",
    "document_inputs",
    "document_mask",
    "document_positions",
    "flex_attention_supported",
    "masked_attention",
]

DocumentMask = torch.Tensor | BlockMask
"""What the attentions receive: a boolean ``(batch, 1, seq, seq)`` SDPA mask (True: may
attend) or a FlexAttention ``BlockMask``."""


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """The document index (0, 1, ...) of every token of ``tokens`` (batch, seq): a document
    ends after each ``eos_id`` token, which belongs to the document it ends. int32, same
    shape and device as ``tokens``."""
    ends = tokens == eos_id
    # Documents started before each token: the EOS tokens strictly before it.
    return (torch.cumsum(ends, dim=-1, dtype=torch.int32) - ends.int()).int()


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (restarting at 0 where ``doc_ids``
    changes along the last dimension), int64, same shape as ``doc_ids``."""
    seq = doc_ids.shape[-1]
    index = torch.arange(seq, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    # The index where each token's document starts: the latest start at or before it.
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - start_index


@dataclass(frozen=True)
class DocumentMasking:
    """A trainer's recipe for the model's document-masking keywords.

    ``eos_id``: the token that ends a document. ``restart_positions``: RoPE positions restart
    at 0 in each document (``False``: they continue across the window, only attention is
    masked)."""

    eos_id: int
    restart_positions: bool = True

    def forward_kwargs(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The keywords for ``model(tokens, **kwargs)``: ``document_ids`` and, when positions
        restart, ``positions``."""
        ids = document_ids(tokens, self.eos_id)
        if not self.restart_positions:
            return {"document_ids": ids}
        return {"document_ids": ids, "positions": document_positions(ids)}


# device type -> whether compiled FlexAttention with a block mask works there: a plain dict,
# which torch.compile reads as a constant once filled.
_FLEX_SUPPORT: dict[str, bool] = {}
_compiled_flex = None


def _flex():
    # FlexAttention runs fast only compiled; compiled once per process, on first use.
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_attention_supported(device_type: str) -> bool:
    """Whether compiled FlexAttention with a document block mask runs forward and backward on
    ``device_type`` and agrees with SDPA under the same boolean mask: probed once per device
    type on tiny inputs, cached for the process. The CPU always takes the exact SDPA path
    (its FlexAttention compiles slowly and is no faster at training sizes)."""
    if device_type not in _FLEX_SUPPORT:
        _FLEX_SUPPORT[device_type] = device_type not in ("cpu", "meta") and _probe_flex(device_type)
    return _FLEX_SUPPORT[device_type]


@torch.compiler.disable
def _probe_flex(device_type: str) -> bool:
    device = torch.device(device_type)
    generator = torch.Generator().manual_seed(0)
    seq = 256  # two of FlexAttention's 128-token blocks
    tokens = torch.randint(1, 8, (1, seq), generator=generator)
    tokens[0, [40, 170]] = 0
    ids = document_ids(tokens, 0).to(device)
    q, k, v = (
        torch.randn(1, 2, seq, 16, generator=generator).to(device).requires_grad_()
        for _ in range(3)
    )
    try:
        with torch.enable_grad():
            out = masked_attention(q, k, v, _block_mask(ids))
            out.backward(torch.ones_like(out))
        expected = masked_attention(q.detach(), k.detach(), v.detach(), _bool_mask(ids))
    except Exception:  # any failure (missing kernels, the compiler) means "no"
        return False
    return bool(torch.allclose(out.detach(), expected, rtol=1e-3, atol=1e-3))


def _bool_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    seq = doc_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    return (same & causal)[:, None]


def _block_mask(doc_ids: torch.Tensor) -> BlockMask:
    def block_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    batch, seq = doc_ids.shape
    return create_block_mask(block_causal, batch, None, seq, seq, device=doc_ids.device)


def document_mask(doc_ids: torch.Tensor) -> DocumentMask:
    """The block-causal mask of ``doc_ids`` (batch, seq) for :func:`masked_attention`: a
    FlexAttention ``BlockMask`` where :func:`flex_attention_supported`, else a boolean
    ``(batch, 1, seq, seq)`` mask. Built once per forward, shared by every layer."""
    if doc_ids.dim() != 2:
        raise ValueError(f"document_ids must be (batch, seq); got shape {tuple(doc_ids.shape)}.")
    if flex_attention_supported(doc_ids.device.type):
        return _block_mask(doc_ids)
    return _bool_mask(doc_ids)


def document_inputs(
    rope: torch.Tensor, doc_ids: torch.Tensor | None, positions: torch.Tensor | None
) -> tuple[torch.Tensor, DocumentMask | None]:
    """What a model's blocks take in a forward with document masking: the RoPE angles (the
    model's table, or with ``positions`` its rows per token: (batch, seq, pairs, 2)) and the
    mask of ``doc_ids`` (``None`` without: causal attention)."""
    mask = None if doc_ids is None else document_mask(doc_ids)
    if positions is not None:
        if positions.dim() != 2:
            raise ValueError(f"positions must be (batch, seq); got shape {tuple(positions.shape)}.")
        rope = rope[positions]
    return rope, mask


def check_no_documents(doc_ids: torch.Tensor | None, positions: torch.Tensor | None) -> None:
    """Raise ``ValueError`` when incremental decoding (a KV cache) is asked for document
    masking, which it does not do."""
    if doc_ids is not None or positions is not None:
        raise ValueError(
            "document_ids/positions cannot be combined with a KV cache: decoding continues "
            "one sequence; drop them (or run the packed window without a cache)."
        )


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask
) -> torch.Tensor:
    """``softmax(q k^T / sqrt(d) + mask) v`` over (batch, heads, seq, head_dim), key/value
    heads shared by groups of query heads, at SDPA's default scale: the masked counterpart
    of ``CausalAttention``."""
    if isinstance(mask, BlockMask):
        return _flex()(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    k, v = repeat_kv(k, v, q.shape[1] // k.shape[1])
    return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
