"""Virtual data shards: each data-parallel rank reads and tokenizes only its share of the
documents while the global batch stays the same at every data-parallel degree.

Document ``i`` belongs to shard ``i mod S`` (``training.data_shards``); each shard is
tokenized (``[BOS] text [EOS]``) and packed into ``seq_len + 1`` windows on its own, epoch
after epoch; global window ``g`` is the next of shard ``g mod S``, kept by rank ``g mod dp``.
So the global stream depends on ``S`` and the data only; rank ``r`` reads only shards
``s = r (mod gcd(dp, S))`` (``1/dp`` of the corpus when ``dp`` divides ``S``); a shard's
position (epoch, document, token offset) is the same on every rank reading it and is what
the checkpoint holds, so a run resumes at any ``dp`` with no window repeated or skipped.
``S = 1`` is one stream every rank reads whole (the pre-shard checkpoint state).

The ``contiguous`` layout (``training.data_shard_layout``, kept in the checkpoint state)
makes shard ``s`` the ``s``-th of ``S`` contiguous runs of the corpus (``iter_region``), so a
rank reads only its part of the files; its ``k``-th document has index ``k S + s``. A source
with ``iter_region_states`` (``datasets`` streams) gives its iteration state per document,
kept at each shard's position (``source_states``) to resume there.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from titan_train.data.config import DataError
from titan_train.data.sources import DocumentSource, iter_strided
from titan_train.tokenizer.base import Tokenizer

__all__ = [
    "Position",
    "ShardReader",
    "check_first_documents",
    "empty_region_message",
    "owned_shards",
]


@dataclass(frozen=True, order=True)
class Position:
    """A shard's next unread token: token ``token_offset`` of its first document with index
    at least ``document`` in epoch ``epoch``."""

    epoch: int = 0
    document: int = 0
    token_offset: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "document": self.document, "token_offset": self.token_offset}


def owned_shards(num_shards: int, dp_rank: int, dp_degree: int) -> list[int]:
    """The shards rank ``dp_rank`` of ``dp_degree`` reads: its windows ``g = dp_rank (mod
    dp_degree)`` come from the shards ``= dp_rank (mod gcd(dp_degree, num_shards))``."""
    stride = math.gcd(dp_degree, num_shards)
    return [s for s in range(num_shards) if (s - dp_rank) % stride == 0]


_States = tuple[str, str] | None
"""A source's iteration state (JSON) before and after a document (``iter_region_states``)."""

Encode = Callable[[Any, int], tuple[list[int], list[bool]]]
"""``encode(document, index) -> (ids, trained)``: a document's tokens and which the loss trains
on (``titan_train.data.chat.ChatEncoder.encode``)."""


class _Shard:
    """One virtual shard's packer: queued documents (text) and the tokens not yet cut."""

    def __init__(self, position: Position) -> None:
        self.position = position
        # (epoch, document, text, the source's iteration state before and after it)
        self.texts: deque[tuple[int, int, str, _States]] = deque()
        # The document being cut: its epoch, index, tokens, and the next unread token.
        self.current: tuple[int, int, list[int]] | None = None
        self.trained: list[bool] | None = None  # per token of current (an ``encode``'s)
        self.offset = 0
        self.states: _States = None  # the current document's, where the source has them
        self.source = ""  # the source state that goes with ``position`` before any read
        self.seen = False  # got a document during a full pass of the source


class ShardReader:
    """The ``size``-token windows of one rank's ``shards`` (their positions; documents
    ``i = c (mod stride)``, ``stride = gcd(dp, S)``), one pass over ``documents`` per
    epoch, each document tokenized only when its shard needs it (never those a saved
    position passed). ``sources``: per shard, the contiguous layout's saved source state;
    ``encode`` as ``TextDataLoader``'s.
    """

    def __init__(
        self,
        documents: DocumentSource,
        tokenizer: Tokenizer,
        *,
        num_shards: int,
        shards: dict[int, Position],
        stride: int,
        infinite: bool,
        size: int,
        contiguous: bool = False,
        sources: dict[int, str] | None = None,
        encode: Encode | None = None,
    ) -> None:
        self.documents = documents
        self.tokenizer = tokenizer
        self.encode = encode
        self.num_shards = num_shards
        self.shards = {s: _Shard(p) for s, p in shards.items()}
        for s, state in (sources or {}).items():
            if s in self.shards:
                self.shards[s].source = state
        self.infinite = infinite
        self.size = size
        self.stride = stride
        self._regions: dict[int, Iterator[tuple[int, int, str, _States]]] | None = None
        if contiguous:
            self._regions = {s: self._read_region(s, p) for s, p in shards.items()}
            return
        start = min(shards.values())
        residue = next(iter(shards)) % stride
        # The first document at or after the earliest position that is this rank's.
        first = start.document + (residue - start.document) % stride
        self._source = self._read(start.epoch, first, stride)

    def positions(self) -> dict[int, Position]:
        """Every owned shard's position now."""
        return {s: shard.position for s, shard in self.shards.items()}

    def source_states(self) -> dict[int, str]:
        """Every owned shard's source state at its position ("" for none): before the current
        document while inside it, after it once past."""
        out = {}
        for s, shard in self.shards.items():
            if shard.current is None or shard.states is None:
                out[s] = shard.source
                continue
            epoch, index, _ = shard.current
            before, after = shard.states
            inside = (shard.position.epoch, shard.position.document) == (epoch, index)
            out[s] = before if inside else after
        return out

    def next_window(self, s: int) -> list[int] | None:
        """The next window of shard ``s``; ``None`` when finite data ran out."""
        cut = self._cut(s, masked=False)
        return None if cut is None else cut[0]

    def next_masked_window(self, s: int) -> tuple[list[int], list[bool]] | None:
        """The next window of shard ``s`` and whether each token is trained; ``None`` when
        finite data ran out."""
        return self._cut(s, masked=True)

    def _cut(self, s: int, *, masked: bool) -> tuple[list[int], list[bool]] | None:
        shard = self.shards[s]
        window: list[int] = []
        trained: list[bool] = []  # filled when masked
        while len(window) < self.size:
            done = shard.current is None or shard.offset == len(shard.current[2])
            if done and not self._next_document(s, shard):
                return None
            assert shard.current is not None
            ids = shard.current[2]
            take = min(self.size - len(window), len(ids) - shard.offset)
            cut = slice(shard.offset, shard.offset + take)
            window += ids[cut]
            if masked:
                trained += shard.trained[cut] if shard.trained is not None else [True] * take
            shard.offset += take
        epoch, index, ids = shard.current
        if shard.offset < len(ids):
            shard.position = Position(epoch, index, shard.offset)
        else:  # the window ended with the document: the shard's next one comes after it
            shard.position = Position(epoch, index + self.num_shards, 0)
        return window, trained

    def _next_document(self, s: int, shard: _Shard) -> bool:
        """Make shard ``s``'s next document current; False when finite data ran out."""
        while not shard.texts:
            if not (self._pull() if self._regions is None else self._pull_region(s, shard)):
                return False
        epoch, index, text, shard.states = shard.texts.popleft()
        if self.encode is None:
            ids, shard.trained = self.tokenizer.encode(text, bos=True, eos=True), None
        else:
            ids, shard.trained = self.encode(text, index)
        start = shard.position
        skip = start.token_offset if (epoch, index) == (start.epoch, start.document) else 0
        shard.current, shard.offset = (epoch, index, ids), min(skip, len(ids))
        return True

    def _pull(self) -> bool:
        """Queue the next document of this rank with its shard; False at the end."""
        while True:
            item = next(self._source, None)
            if item is None:
                return False
            epoch, index, _, _ = item
            shard = self.shards.get(index % self.num_shards)
            if shard is None:
                continue
            p = shard.position
            if (epoch, index) < (p.epoch, p.document):
                continue  # a saved position passed it: drop it untokenized
            shard.texts.append(item)
            return True

    def _pull_region(self, s: int, shard: _Shard) -> bool:
        """Queue shard ``s``'s next document (contiguous layout); False at the end."""
        assert self._regions is not None
        item = next(self._regions[s], None)
        if item is None:
            return False
        shard.texts.append(item)
        return True

    def _read_region(self, s: int, start: Position) -> Iterator[tuple[int, int, str, _States]]:
        """``(epoch, index, text, states)`` of shard ``s``'s documents from ``start`` on,
        its run of the corpus read again each epoch (contiguous layout)."""
        region = getattr(self.documents, "iter_region", None)
        with_states = getattr(self.documents, "iter_region_states", None)
        if region is None:
            raise DataError(f"dataset {self.documents.name!r} cannot be read by regions.")
        epoch, first = start.epoch, start.document // self.num_shards
        state = self.shards[s].source
        while True:
            seen = False
            if with_states is not None:
                items = with_states(s, self.num_shards, first, state)
            else:
                items = ((k, text, None, None) for k, text in region(s, self.num_shards, first))
            for k, text, before, after in items:
                seen = True
                states = None if before is None or after is None else (before, after)
                yield epoch, k * self.num_shards + s, text, states
            if not self.infinite:
                return
            if not seen and first == 0:
                raise DataError(empty_region_message(self.documents.name, [s], self.num_shards))
            epoch, first, state = epoch + 1, 0, ""

    def _read(self, epoch: int, first: int, stride: int) -> Iterator[tuple[int, int, str, _States]]:
        """``(epoch, index, text, None)`` of this rank's documents from ``first`` on."""
        index = first
        while True:
            full_pass, count = index < stride, 0
            for shard in self.shards.values():
                shard.seen = False
            for i, text in iter_strided(self.documents, index, stride):
                shard = self.shards.get(i % self.num_shards)
                if shard is not None:
                    shard.seen = True
                count += 1
                yield epoch, i, text, None
            if not self.infinite:
                return
            empty = [s for s, shard in self.shards.items() if not shard.seen]
            if full_pass and empty:
                raise DataError(
                    _empty_shards_message(
                        self.documents.name, empty, count, self.num_shards, stride
                    )
                )
            epoch, index = epoch + 1, first % stride


def check_first_documents(documents: DocumentSource, num_shards: int, own: list[int]) -> None:
    """Before any training (interleaved layout): read each of ``own``'s first documents so that
    too few documents, or undecodable ones, stop the run before anything is written."""
    stride = own[1] - own[0] if len(own) > 1 else num_shards
    firsts = itertools.islice(iter_strided(documents, own[0], stride), len(own))
    count = sum(1 for _ in firsts)
    if count < len(own):
        message = _empty_shards_message(documents.name, own[count:], count, num_shards, stride)
        raise DataError(message)


def empty_region_message(name: str, empty: list[int], num_shards: int) -> str:
    """The error for contiguous shards ``empty`` that hold no document."""
    return (
        f"dataset {name!r} has no document in data shard(s) {empty[:5]} of {num_shards} (the "
        f"contiguous layout gives each shard 1/{num_shards} of the corpus, and a document to "
        "the shard its first byte, or row, is in): it has fewer documents than shards, or "
        "documents longer than a shard. Lower training.data_shards."
    )


def _empty_shards_message(
    name: str, empty: list[int], count: int, num_shards: int, stride: int
) -> str:
    if count == 0 and stride == 1:
        return f"dataset {name!r} has no documents."
    return (
        f"dataset {name!r} has no document for data shard(s) {empty[:5]} of "
        f"{num_shards} (document i goes to shard i mod {num_shards}): it has "
        "fewer documents than shards. Lower training.data_shards to at most the number of "
        "documents (1 reads one stream on every rank)."
    )
