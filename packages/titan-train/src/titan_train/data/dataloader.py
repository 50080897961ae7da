"""``TextDataLoader``: packed, data-parallel-sharded, resumable batches of token windows.

The documents go through virtual shards (``titan_train.data.shards``: which windows a rank
keeps, and why a resume at any data-parallel degree repeats or skips none); a window gives
``inputs = w[:-1]``, ``labels = w[1:]``. The state is the global windows consumed and the
positions of this rank's shards (``regions`` instead of ``shards`` for the contiguous
layout, so one layout's checkpoint is never read as the other's). Chat data
(``titan_train.data.chat``) carries per-token marks through packing: ``labels[t]`` is
``IGNORE_INDEX`` where ``inputs[t + 1]`` is not trained.
"""

from __future__ import annotations

import json
import logging
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from titan_train.data.chat import build_chat_encoder
from titan_train.data.config import IGNORE_INDEX, SHARD_LAYOUTS, DataConfig, DataError
from titan_train.data.prefetch import Prefetcher
from titan_train.data.shards import (
    Encode,
    Position,
    ShardReader,
    check_first_documents,
    empty_region_message,
    owned_shards,
)
from titan_train.data.sources import DocumentSource, open_documents
from titan_train.tokenizer.base import Tokenizer

__all__ = ["TextDataLoader", "build_dataloader", "explain_load_error"]

logger = logging.getLogger("titan_train")

_STATE_KEYS = ("epoch", "document", "token_offset", "windows")
"""The state of one stream (``num_shards = 1``), as titan-train wrote it before shards."""

_Item = tuple[torch.Tensor, torch.Tensor, int, dict[int, Position], dict[int, str]]

_POSITIONS_KEY = {"interleaved": "shards", "contiguous": "regions"}


class TextDataLoader:
    """Batches ``(inputs, labels)``, each ``local_batch_size x seq_len`` int64, for one rank.

    Iterating starts where the last batch handed out ended (or ``load_state_dict`` put it); a
    new iterator ends the previous one. ``state_dict()`` merged over the ranks loads at any
    ``dp_degree``. ``infinite=False`` stops after the last step every rank completes (needs
    ``num_shards = 1``). ``prefetch``: batches made ahead in a thread (``Prefetcher``).
    ``encode``: ``(document, index) -> (ids, trained)`` (chat data); default ``[BOS] text
    [EOS]``, every token trained.
    """

    supports_resharding = True
    """Merged over the ranks, the state loads at any data-parallel degree."""

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
        num_shards: int = 1,
        prefetch: int = 0,
        shard_layout: str = "interleaved",
        encode: Encode | None = None,
    ) -> None:
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise DataError(
                f"dp_rank={dp_rank}, dp_degree={dp_degree} is not allowed; need dp_degree >= 1 "
                "and 0 <= dp_rank < dp_degree."
            )
        if num_shards < 1 or (num_shards > 1 and not infinite):
            raise DataError(
                f"num_shards={num_shards} is not allowed here; it must be >= 1, and 1 for "
                "finite data (every rank must know where the stream ends)."
            )
        if shard_layout not in SHARD_LAYOUTS:
            raise DataError(
                f"shard_layout={shard_layout!r} is not allowed; use one of {SHARD_LAYOUTS}."
            )
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.infinite = infinite
        self.num_shards = num_shards
        self.prefetch = prefetch
        self.shard_layout = shard_layout
        self.encode = encode
        self._windows = 0
        # Every shard's position; this rank advances, saves and loads only its own.
        self._positions = {s: Position() for s in range(num_shards)}
        # Contiguous layout: each shard's source iteration state at its position ("" for
        # none), saved with it so that a datasets stream resumes without reading past.
        self._sources: dict[int, str] = {}
        self._own = owned_shards(num_shards, dp_rank, dp_degree)
        # Before any training: a bad corpus stops the run before anything is written.
        if shard_layout == "contiguous" and num_shards > 1:
            _check_regions(documents, num_shards, self._own)
        elif infinite:  # finite data (validation) is checked by its first batch
            check_first_documents(documents, num_shards, self._own)
        self._prefetcher: Prefetcher[_Item] | None = None

    def state_dict(self) -> dict[str, Any]:
        """Windows consumed, and the position of each shard this rank reads."""
        if self.num_shards == 1:
            return {**self._positions[0].as_dict(), "windows": self._windows}
        positions = {str(s): self._positions[s].as_dict() for s in self._own}
        if self.shard_layout == "contiguous":
            for s in self._own:
                positions[str(s)]["source"] = self._sources.get(s, "")
        return {
            "num_shards": self.num_shards,
            "windows": self._windows,
            self._positions_key: positions,
        }

    @property
    def _positions_key(self) -> str:
        return _POSITIONS_KEY[self.shard_layout]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state saved at any ``dp_degree`` (merged over its ranks); iterate
        afresh after this."""
        self.close()
        keys = set(_POSITIONS_KEY.values())
        if not keys & set(state_dict) and "num_shards" not in state_dict:
            self._load_one_stream(state_dict)
            return
        saved = int(state_dict.get("num_shards", -1))
        if saved != self.num_shards:
            raise DataError(_shards_mismatch(saved, self.num_shards))
        if self._positions_key not in state_dict:
            layout = next((k for k, v in _POSITIONS_KEY.items() if v in state_dict), None)
            if layout is None:
                raise DataError(
                    f"dataloader state lacks the shards' positions ('shards' or 'regions'; has "
                    f"{sorted(state_dict)}); was it saved by another dataloader? Exclude "
                    "'dataloader' from loading to start the data over."
                )
            raise DataError(_layout_mismatch(layout, self.shard_layout))
        windows = int(state_dict["windows"])
        saved_positions = state_dict[self._positions_key]
        shards = {int(s): Position(**{k: int(v) for k, v in p.items() if k != "source"})
                  for s, p in saved_positions.items()}  # fmt: skip
        sources = {int(s): str(p.get("source", "")) for s, p in saved_positions.items()}
        for s, source in sources.items():
            if source and not _is_json_object(source):
                raise DataError(
                    f"dataloader state of data shard {s}: its stream state ('source') is not "
                    f"the JSON object titan-train saves ({source[:60]!r}); the checkpoint is "
                    "damaged or not titan-train's. Add 'dataloader' to "
                    "checkpoint.exclude_from_loading to start the data over."
                )
        missing = [s for s in self._own if s not in shards]
        if missing:
            raise DataError(
                f"dataloader state lacks data shard(s) {missing[:5]} that rank {self.dp_rank} "
                f"of {self.dp_degree} reads; load the states of all ranks merged (a "
                "checkpoint holds them all)."
            )
        self._windows = windows
        self._positions.update(shards)
        self._sources.update(sources)

    def _load_one_stream(self, state_dict: dict[str, Any]) -> None:
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise DataError(
                f"dataloader state lacks {missing} (has {sorted(state_dict)}); was it saved "
                "by another dataloader? Exclude 'dataloader' from loading to start the data over."
            )
        if self.num_shards != 1:
            raise DataError(_shards_mismatch(1, self.num_shards))
        state = {k: int(state_dict[k]) for k in _STATE_KEYS}
        self._windows = state.pop("windows")
        self._positions = {0: Position(**state)}

    def close(self) -> None:
        """Stop the background thread of the current iterator, if any."""
        if self._prefetcher is not None:
            self._prefetcher.close()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches from the current position; a ``prefetch`` thread starts now (while the
        caller builds the model) and ends with the returned iterator."""
        self.close()  # one producer at a time
        batches = self._batches(self._windows, dict(self._positions), dict(self._sources))
        if self.prefetch == 0:
            return self._hand_out(batches)
        prefetcher = self._prefetcher = Prefetcher(
            lambda: batches, depth=self.prefetch, name=f"titan-data-rank{self.dp_rank}"
        )
        handed = self._hand_out(prefetcher)
        # A generator dropped before its first item never runs its ``finally``.
        weakref.finalize(handed, prefetcher.close)
        return handed

    def _hand_out(self, source: Iterator[_Item]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        try:
            for inputs, labels, windows, positions, sources in source:
                # The state moves with the batch handed out, not with the producer: a
                # checkpoint taken after this batch was used resumes with the next one.
                self._windows = windows
                self._positions.update(positions)
                self._sources.update(sources)
                yield inputs, labels
        finally:
            if isinstance(source, Prefetcher):
                source.close()

    def _reader(
        self, documents: DocumentSource, positions: dict[int, Position], sources: dict[int, str]
    ) -> ShardReader:
        """A reader of this rank's shards of ``documents`` from ``positions`` (by shard)."""
        return ShardReader(
            documents,
            self.tokenizer,
            num_shards=self.num_shards,
            shards={s: positions[s] for s in self._own},
            stride=math.gcd(self.dp_degree, self.num_shards),
            infinite=self.infinite,
            size=self.seq_len + 1,
            contiguous=self.shard_layout == "contiguous" and self.num_shards > 1,
            sources={s: sources[s] for s in self._own if s in sources},
            encode=self.encode,
        )

    def _batches(
        self, first: int, positions: dict[int, Position], sources: dict[int, str]
    ) -> Iterator[_Item]:
        """Batches from global window ``first``, with the state after each."""
        contiguous = self.shard_layout == "contiguous" and self.num_shards > 1
        reader = self._reader(self.documents, positions, sources)
        masked = self.encode is not None
        per_step, window = self.local_batch_size * self.dp_degree, first
        while True:
            mine, marks = [], []
            for k in range(per_step):
                s = (window + k) % self.num_shards
                if s not in reader.shards:
                    continue  # another rank's shard: it reads it
                cut = reader.next_masked_window(s) if masked else reader.next_window(s)
                if cut is None:  # finite data ran out mid-step: drop the partial step
                    return
                if (window + k) % self.dp_degree == self.dp_rank:
                    mine.append(cut[0] if masked else cut)
                    marks.append(cut[1] if masked else None)
            window += per_step
            batch = torch.tensor(mine, dtype=torch.long)
            labels = batch[:, 1:].contiguous()  # may share the inputs' storage: not written
            if masked:  # the label of token t + 1 is trained iff that token is
                trained = torch.tensor(marks, dtype=torch.bool)[:, 1:]
                labels = torch.where(trained, labels, IGNORE_INDEX)
            states = reader.source_states() if contiguous else {}
            yield batch[:, :-1].contiguous(), labels, window, reader.positions(), states


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _resume_with(key: str, saved: object, now: object, why: str) -> str:
    """The error for a dataloader state saved with another ``training.<key>``."""
    return (
        f"the dataloader state was saved with training.{key}={saved!r}{why}, this run has "
        f"{now!r}. Resume with --training.{key} {saved} to continue that data stream "
        "exactly, or add 'dataloader' to checkpoint.exclude_from_loading to start the data "
        "over."
    )


def _shards_mismatch(saved: int, now: int) -> str:
    return _resume_with(
        "data_shards", saved, now, " (1: one stream, as titan-train wrote before data shards)"
    )


def _check_regions(documents: DocumentSource, num_shards: int, own: list[int]) -> None:
    """Before any training: the source can be read by regions, into ``num_shards`` of them,
    and each of this rank's shards holds a document (where the source can say so cheaply)."""
    if not callable(getattr(documents, "iter_region", None)):
        raise DataError(
            f"dataset {documents.name!r} cannot be split into contiguous shards: the "
            "contiguous shard layout reads a source by regions (iter_region), which this "
            f"one ({type(documents).__name__}) does not have. Set "
            "training.data_shard_layout = 'interleaved'."
        )
    check = getattr(documents, "check_regions", None)
    if callable(check):
        check(num_shards)
    has_rows = getattr(documents, "region_has_rows", None)
    if callable(has_rows):
        empty = [s for s in own if not has_rows(s, num_shards)]
        if empty:
            raise DataError(empty_region_message(documents.name, empty, num_shards))


def _layout_mismatch(saved: str, now: str) -> str:
    return _resume_with(
        "data_shard_layout", saved, now, " (the layouts deal documents to shards differently)"
    )


def explain_load_error(
    error: BaseException, num_shards: int, shard_layout: str = "interleaved"
) -> DataError | None:
    """A ``DataError`` saying how to resume when a checkpoint load failed on a dataloader
    state of another shard count or layout (DCP names a key it lacks); else ``None``."""
    text = str(error)
    marker = "Missing key in checkpoint state_dict: dataloader."
    if marker not in text:
        return None
    key = text.split(marker, 1)[1].split()[0].rstrip(".;)")
    if key.endswith(".source"):  # only the stream state is missing: not a layout mismatch
        return DataError(
            f"the checkpoint's dataloader state lacks 'dataloader.{key}': it was written by a "
            "titan-train from before the contiguous layout saved each shard's stream state. "
            "Add 'dataloader' to checkpoint.exclude_from_loading to start the data over."
        )
    if key in _STATE_KEYS:  # a sharded state, asked for as one stream
        saved = "training.data_shards = a value > 1 (see that run's config)"
    elif key == "num_shards":
        saved = "training.data_shards = 1"
    elif key.split(".")[0] == _POSITIONS_KEY.get(shard_layout):
        other = next(k for k in SHARD_LAYOUTS if k != shard_layout)
        saved = (
            f"training.data_shards other than {num_shards}, or training.data_shard_layout = "
            f"{other!r} (see that run's config)"
        )
    else:
        saved = f"training.data_shards = a value other than {num_shards} (see that run's config)"
    return DataError(
        f"the checkpoint's dataloader state has another data shard layout (no "
        f"'dataloader.{key}'): it was saved with {saved}; this run has data_shards = "
        f"{num_shards}, data_shard_layout = {shard_layout!r}. Resume with that run's "
        "values to continue its data stream exactly, or add 'dataloader' to "
        "checkpoint.exclude_from_loading to start the data over."
    )


def build_dataloader(
    config: DataConfig, tokenizer: Tokenizer, *, dp_rank: int = 0, dp_degree: int = 1
) -> TextDataLoader:
    """The dataloader of ``config`` (a trainer section's ``DataSource.data_config``) for
    data-parallel rank ``dp_rank`` of ``dp_degree`` (plain ints: no process group needed)."""
    if not isinstance(config, DataConfig):
        raise TypeError(
            f"build_dataloader takes a DataConfig, not {type(config).__name__}; a trainer "
            "section gives its own with .data_config(seq_len=..., local_batch_size=..., "
            "infinite=...)."
        )
    # Finite data (validation) is one stream: every rank must know where it ends.
    shards = config.num_shards if config.infinite else 1
    stride = math.gcd(dp_degree, shards)
    if config.infinite and dp_rank == 0 and stride < dp_degree:
        logger.warning(
            "%s.data_shards=%d is not a multiple of the data-parallel degree %d: each rank "
            "reads and tokenizes 1/%d of the documents, not 1/%d",
            config.section,
            shards,
            dp_degree,
            stride,
            dp_degree,
        )
    documents = open_documents(config)
    encode = None
    if config.dataset_format == "chat":
        encoder = build_chat_encoder(config, tokenizer, name=documents.name)
        # The first row now, before any training: a missing column or a conversation the
        # template cannot render stops the run here, naming the row.
        first = next(iter(documents.iter_from(0)), None)
        if first is not None:
            encoder.encode(first, 0)
        encode = encoder.encode
    return TextDataLoader(
        documents,
        tokenizer,
        seq_len=config.seq_len,
        local_batch_size=config.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        infinite=config.infinite,
        num_shards=shards,
        prefetch=config.prefetch,
        shard_layout=config.shard_layout,
        encode=encode,
    )
