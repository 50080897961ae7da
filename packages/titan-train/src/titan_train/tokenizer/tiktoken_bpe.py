"""Byte-level BPE in tiktoken's file format: the Llama 3 ``tokenizer.model``.

The file has one line per token, ``<base64 of the token's bytes> <rank>``, ranks 0..n-1; a
token's rank is also its id and the order in which BPE merges it. Special tokens are not in
the file: like Llama 3 we append them after the ranks (``<|begin_of_text|>`` = n,
``<|end_of_text|>`` = n + 1, then reserved and chat tokens).
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping, Sequence

import tiktoken

from titan_train.tokenizer.base import TokenizerError

__all__ = [
    "LLAMA3_PATTERN",
    "TiktokenTokenizer",
    "llama3_special_tokens",
    "read_tiktoken_bpe",
    "write_tiktoken_bpe",
]

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""Llama 3's pre-tokenization regex: BPE merges never cross the pieces it splits text into."""

_LLAMA3_NAMED = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
)


def llama3_special_tokens(count: int = 256) -> list[str]:
    """The first ``count`` of Llama 3's special tokens, in id order (Llama 3 uses all 256)."""
    if count < 2:
        raise TokenizerError(f"special token count {count} is too small; BOS and EOS need 2.")
    names = list(_LLAMA3_NAMED)
    names += [f"<|reserved_special_token_{i}|>" for i in range(5, 5 + max(0, count - len(names)))]
    return names[:count]


def read_tiktoken_bpe(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Token bytes -> rank of a tiktoken BPE file, checked: ranks 0..n-1, each once."""
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file {os.fspath(path)!r}: {e}") from e
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token_b64, rank_text = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank_text)
        except (ValueError, binascii.Error) as e:
            raise TokenizerError(
                f"{os.fspath(path)}:{number} is not '<base64 token> <rank>' "
                f"(got {line[:60]!r}); is this a tiktoken BPE file?"
            ) from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(
            f"{os.fspath(path)}: ranks must be 0..{len(ranks) - 1}, each once "
            "(a token listed twice, or a gap)."
        )
    return ranks


def write_tiktoken_bpe(ranks: Mapping[bytes, int], path: str | os.PathLike[str]) -> None:
    """Write ``ranks`` as a tiktoken BPE file, in rank order (byte-for-byte deterministic)."""
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


class TiktokenTokenizer:
    """A tiktoken BPE file, ``special_tokens`` (default Llama 3's 256, with BOS and EOS) given
    ids after its ranks; ``pattern``: the pre-tokenization regex (Llama 3's)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        special_tokens: Sequence[str] | None = None,
        pattern: str = LLAMA3_PATTERN,
    ) -> None:
        self.path = os.fspath(path)
        ranks = read_tiktoken_bpe(path)
        names = list(special_tokens) if special_tokens is not None else llama3_special_tokens()
        for needed in ("<|begin_of_text|>", "<|end_of_text|>"):
            if needed not in names:
                raise TokenizerError(f"special_tokens must include {needed}; got {names[:4]}...")
        self.special_tokens = {name: len(ranks) + i for i, name in enumerate(names)}
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(self.path),
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        """Id of ``<|begin_of_text|>``."""
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        """Id of ``<|end_of_text|>``."""

    @property
    def vocab_size(self) -> int:
        """Ranks in the file plus special tokens."""
        return self._encoding.n_vocab

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of ``text``; special-token names inside it are encoded as ordinary text, so a
        document can never inject a BOS/EOS of its own."""
        ids = self._encoding.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Ids of ``text`` with special-token names read as the special tokens, and where
        each token starts (inside a character: that character's start)."""
        ids = self._encoding.encode(text, allowed_special="all")
        _, starts = self._encoding.decode_with_offsets(ids)
        return ids, starts

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        return self._encoding.decode(list(ids))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"
