"""``KVCache``: the keys and values of tokens already seen, for incremental decoding.

A model that supports it takes ``forward(tokens, cache=...)`` (the whole prompt first, then
one token a step) and asks the cache for: ``rope_rows(table, seq)``, each new token's RoPE
angles at its own position (rows may be left-padded); ``layer(i).attend(q, k, v)``, which
stores layer ``i``'s new keys and values and attends over all stored so far with the causal
and padding mask; and ``advance(seq)`` once all layers ran. ``set_padding(mask)`` marks a
forward's padding slots: they count no position and no real token attends to them, so
left-padded rows of different lengths get what each would get alone. Buffers are allocated
on the first ``attend`` with the keys' heads, dtype and device (under tensor parallel, each
rank its own heads). Sampling lives with the caller (titan-train's ``generate``).

``titan_models.decoder.Decoder`` drives it for every family: its forward picks ``rope_rows``,
passes ``cache.layer(i)`` to block ``i`` as a keyword (TP plans prepare positional inputs
only) and calls ``advance``; attention calls ``attend``, which takes keys and values of
different widths and a ``scale`` (DeepSeek-V3's latent attention)."""

from __future__ import annotations

import torch
from torch.nn import functional

from titan_models.errors import ModelConfigError

__all__ = ["KVCache", "LayerKVCache"]


class KVCache:
    """Keys and values of ``n_layers`` attention layers for ``batch_size`` rows of at most
    ``max_len`` slots, padding slots included. Every forward fills the next ``seq`` slots of
    every row (``start`` counts them); padding slots (``set_padding``) let rows of different
    lengths share a batch, and keep a forward at a length a layout needs (sequence parallel splits
    sequences evenly) while it carries fewer real tokens."""

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if n_layers < 1 or batch_size < 1 or max_len < 1:
            raise ModelConfigError(
                f"KVCache needs n_layers, batch_size and max_len >= 1, got {n_layers}, "
                f"{batch_size}, {max_len}."
            )
        self.max_len = max_len
        self.batch_size = batch_size
        self.start = 0
        self.real = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        """Which filled slots hold real tokens (the others are padding)."""
        self._layers = [LayerKVCache(self) for _ in range(n_layers)]
        self._padding: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None

    def layer(self, index: int) -> LayerKVCache:
        """The cache of attention layer ``index``."""
        return self._layers[index]

    def set_padding(self, padding: torch.Tensor) -> None:
        """Mark the next forward's slots where ``padding`` (batch, seq) is True as padding."""
        if padding.dim() != 2 or padding.shape[0] != self.batch_size:
            raise ModelConfigError(
                f"KVCache.set_padding takes a (batch={self.batch_size}, seq) mask, got shape "
                f"{tuple(padding.shape)}."
            )
        self._padding = padding.to(device=self.real.device, dtype=torch.bool)
        self._mask = None

    def _new_real(self, seq: int) -> torch.Tensor:
        """(batch, seq): which of the next ``seq`` slots hold real tokens."""
        self._check_room(seq)
        if self._padding is None:
            return torch.ones(self.batch_size, seq, dtype=torch.bool, device=self.real.device)
        if self._padding.shape[1] != seq:
            raise ModelConfigError(
                f"The padding mask covers {self._padding.shape[1]} slots, the forward {seq}."
            )
        return ~self._padding

    def positions(self, seq: int) -> torch.Tensor:
        """(batch, seq) positions of the next ``seq`` slots: the real tokens before them in
        their row (a padding slot repeats its neighbour's, unread)."""
        before = self.real[:, : self.start].sum(dim=1, keepdim=True)
        return (before + self._new_real(seq).cumsum(dim=1) - 1).clamp(min=0)

    def rope_rows(self, table: torch.Tensor, seq: int) -> torch.Tensor:
        """RoPE angles of the next ``seq`` tokens of each row from ``table`` (positions,
        pairs, 2): shape (batch, seq, pairs, 2), as ``apply_rope`` takes per-row angles."""
        positions = self.positions(seq).to(table.device)
        if int(positions.max()) >= table.shape[0]:
            raise ModelConfigError(
                f"Position {int(positions.max())} exceeds the RoPE table's {table.shape[0]} "
                "positions; build the model with a larger max_seq_len."
            )
        return table[positions]

    def mask(self, seq: int, device: torch.device) -> torch.Tensor:
        """(batch, 1, seq, start + seq) boolean mask, True where a new query may attend: real
        keys at or before the query's slot. A padding query attends to itself too, so its row
        stays finite (no real token reads it). Built once per forward."""
        if self._mask is not None and self._mask.shape[-2] == seq:
            return self._mask.to(device)
        end = self.start + seq
        keys = torch.arange(end, device=self.real.device)
        queries = torch.arange(self.start, end, device=self.real.device)
        real = torch.cat((self.real[:, : self.start], self._new_real(seq)), dim=1)
        causal = keys[None, :] <= queries[:, None]
        itself = keys[None, :] == queries[:, None]
        mask = causal[None] & (real[:, None, :] | itself[None])
        self._mask = mask[:, None]
        return self._mask.to(device)

    def advance(self, seq: int) -> None:
        """Mark the next ``seq`` slots as filled (call once per forward, after every layer);
        the padding mark applies to one forward."""
        self.real[:, self.start : self.start + seq] = self._new_real(seq)
        self.start += seq
        self._padding = None
        self._mask = None

    def _check_room(self, seq: int) -> None:
        if self.start + seq > self.max_len:
            raise ModelConfigError(
                f"The KV cache holds {self.max_len} slots; {self.start} are filled and "
                f"{seq} more do not fit. Build it with a larger max_len."
            )


class LayerKVCache:
    """One attention layer's keys and values, (batch, kv_heads, max_len, head_dim) each."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values (batch, kv_heads, seq, dim) at the cache's next
        slots; return every stored one, (batch, kv_heads, start + seq, dim)."""
        cache = self.cache
        if self.k is None or self.v is None:
            size = (cache.batch_size, k.shape[1], cache.max_len)
            self.k = k.new_zeros(*size, k.shape[-1])
            self.v = v.new_zeros(*size, v.shape[-1])
        seq = k.shape[2]
        cache._check_room(seq)
        end = cache.start + seq
        self.k[:, :, cache.start : end] = k
        self.v[:, :, cache.start : end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
    ) -> torch.Tensor:
        """``softmax(q K^T * scale + mask) V`` of the new queries (batch, heads, seq, dim)
        over every stored key, after storing ``k`` and ``v`` (batch, kv_heads, seq, dim);
        each key/value head serves ``heads / kv_heads`` consecutive query heads. Returns
        (batch, heads, seq, v_dim)."""
        keys, values = self.update(k, v)
        mask = self.cache.mask(q.shape[2], q.device)
        # enable_gqa: attention reads the grouped heads in place; repeating them would copy
        # the whole cache for every query head at every decode step.
        return functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
        )
