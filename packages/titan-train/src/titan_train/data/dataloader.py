"""``TextDataLoader``: packed, data-parallel-sharded, resumable batches of token windows.

The data is one global stream, the same on every rank: documents in order (epoch after
epoch when infinite), each tokenized as ``[BOS] text [EOS]``, concatenated and cut into
consecutive windows of ``seq_len + 1`` tokens; a window gives ``inputs = w[:-1]`` and
``labels = w[1:]``. A step of ``dp_degree`` ranks consumes the next
``local_batch_size x dp_degree`` windows, and rank ``r`` keeps those whose index in the
step is ``r`` modulo ``dp_degree``.

Invariant that makes resharding possible: after every batch, all ranks stand at the same
place in the global stream, and the state records that place (epoch, document, token
offset inside it), nothing rank-specific. A run resumed with another ``dp_degree`` reads
on from there, so the union of what all ranks see equals what one uninterrupted rank would
see: no window repeated, none skipped. The price: every rank tokenizes every document (but
keeps only its own windows) — cheap next to a training step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from titan_train.data.config import DataConfig, DataError
from titan_train.data.sources import DocumentSource, open_documents
from titan_train.tokenizer.base import Tokenizer

__all__ = ["TextDataLoader", "build_dataloader"]

_STATE_KEYS = ("epoch", "document", "token_offset", "windows")


class TextDataLoader:
    """Batches ``(inputs, labels)``, each ``local_batch_size x seq_len`` int64, for one rank.

    Iterating starts where the last batch handed out ended (or where ``load_state_dict``
    put it); use one iterator at a time. ``state_dict()`` after ``n`` batches is the same on
    every rank and can be loaded at any ``dp_degree`` (``supports_resharding``).

    Args:
        documents: the document source (see ``open_documents``).
        tokenizer: encodes each document with BOS and EOS.
        seq_len: tokens per sequence.
        local_batch_size: sequences per batch on this rank.
        dp_rank: this rank's index among the data-parallel ranks.
        dp_degree: number of data-parallel ranks.
        infinite: loop over the documents forever; else stop after the last complete step
            (the remaining windows, fewer than one step of all ranks, are dropped so every
            rank gets the same number of batches).
    """

    supports_resharding = True
    """The state is rank-independent: titan-ckpt may load it at another world size."""

    def __init__(
        self,
        documents: DocumentSource,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        infinite: bool = True,
    ) -> None:
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise DataError(
                f"dp_rank={dp_rank}, dp_degree={dp_degree} is not allowed; need dp_degree >= 1 "
                "and 0 <= dp_rank < dp_degree."
            )
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.infinite = infinite
        self._state = dict.fromkeys(_STATE_KEYS, 0)

    def state_dict(self) -> dict[str, int]:
        """Where the next batch starts in the global stream, and windows consumed so far."""
        return dict(self._state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state saved at any ``dp_degree``; iterate afresh after this."""
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise DataError(
                f"dataloader state lacks {missing} (has {sorted(state_dict)}); was it saved "
                "by another dataloader? Exclude 'dataloader' from loading to start the data over."
            )
        self._state = {k: int(state_dict[k]) for k in _STATE_KEYS}

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        windows = self._windows()
        per_step = self.local_batch_size * self.dp_degree
        while True:
            mine = []
            for k in range(per_step):
                item = next(windows, None)
                if item is None:  # finite data ran out mid-step: drop the partial step
                    return
                window, position = item
                if k % self.dp_degree == self.dp_rank:
                    mine.append(window)
            batch = torch.tensor(mine, dtype=torch.long)
            # Record the position before handing the batch out: a checkpoint taken after
            # this batch was used must resume with the next one.
            self._state = {**position, "windows": self._state["windows"] + per_step}
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def _documents(self, epoch: int, index: int) -> Iterator[tuple[int, int, list[int]]]:
        """``(epoch, document index, [BOS] ids [EOS])`` from the given document on."""
        while True:
            count = 0
            for i, text in enumerate(self.documents.iter_from(index), start=index):
                yield epoch, i, self.tokenizer.encode(text, bos=True, eos=True)
                count += 1
            if not self.infinite:
                return
            if index == 0 and count == 0:  # a whole epoch without one document
                raise DataError(f"dataset {self.documents.name!r} has no documents.")
            epoch, index = epoch + 1, 0

    def _windows(self) -> Iterator[tuple[list[int], dict[str, int]]]:
        """Windows of ``seq_len + 1`` tokens from the saved position, each with the position
        of the first token after it."""
        size = self.seq_len + 1
        start = self._state
        docs = self._documents(start["epoch"], start["document"])
        # Each segment: [epoch, document, offset of its next unread token, its tokens].
        segments: deque[list[Any]] = deque()
        buffered, skip_first = 0, start["token_offset"]
        last = (start["epoch"], start["document"])
        while True:
            while buffered < size:
                item = next(docs, None)
                if item is None:
                    return
                epoch, index, ids = item
                segments.append([epoch, index, skip_first, ids])
                buffered += len(ids) - skip_first
                skip_first, last = 0, (epoch, index)
            window: list[int] = []
            while len(window) < size:
                segment = segments[0]
                take = min(size - len(window), len(segment[3]) - segment[2])
                window += segment[3][segment[2] : segment[2] + take]
                segment[2] += take
                if segment[2] == len(segment[3]):
                    segments.popleft()
            buffered -= size
            if segments:
                epoch, index, offset = segments[0][:3]
            else:  # the window ended exactly at a document's end
                epoch, index, offset = last[0], last[1] + 1, 0
            yield window, {"epoch": epoch, "document": index, "token_offset": offset}


def build_dataloader(
    config: DataConfig, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_degree: int = 1
) -> TextDataLoader:
    """The dataloader of ``config`` for one data-parallel rank.

    Args:
        config: what to read and how to batch it (the trainer's sections give theirs with
            ``DataSource.data_config``).
        tokenizer: the tokenizer (``titan_train.tokenizer.load_tokenizer``).
        dp_rank: this rank's index among the data-parallel ranks (plain int: no process
            group is needed).
        dp_degree: the number of data-parallel ranks.
    """
    if not isinstance(config, DataConfig):
        raise TypeError(
            f"build_dataloader takes a DataConfig, not {type(config).__name__}; a trainer "
            "section gives its own with .data_config(seq_len=..., local_batch_size=..., "
            "infinite=...)."
        )
    return TextDataLoader(
        open_documents(config),
        tokenizer,
        seq_len=config.seq_len,
        local_batch_size=config.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        infinite=config.infinite,
    )
