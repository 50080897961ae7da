"""The ``Tokenizer`` protocol every tokenizer of titan-train satisfies, and its error type."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from titan_train.errors import TokenizerError

__all__ = ["Tokenizer", "TokenizerError"]


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> token ids. The dataloader needs ``encode`` and the BOS/EOS ids; the model
    needs ``vocab_size`` (every id a tokenizer returns is below it)."""

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        ...

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-text token, put before each document."""
        ...

    @property
    def eos_id(self) -> int:
        """Id of the end-of-text token, put after each document."""
        ...

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text`` (special-token names in it are plain text), with BOS/EOS added."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; special tokens appear by name."""
        ...
