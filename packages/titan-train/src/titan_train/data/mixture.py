"""``MixtureDataLoader``: training windows drawn from several weighted document sources.

Global window ``g`` comes from source ``k = choose(g)``, from that source's virtual shard
``g mod S``, packed as a single-source run packs it: sharding, state and resharding are each
source's, unchanged. ``choose`` is counter-based: ``u = (offset(seed) + g * φ 2^64) mod
2^64`` (a Weyl sequence) falls in source ``k``'s share of ``[0, 2^64)``; consecutive ``u``
are evenly spread, so every run of ``n`` windows holds each share to within a few windows
(an independent draw: ``~sqrt(n)``), within any step. The state is ``g``, each source's
windows so far and its shard positions.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from typing import Any

import torch

from titan_train.data.config import DataConfig, DataError, DatasetEntry
from titan_train.data.dataloader import TextDataLoader, _check_regions, _Item
from titan_train.data.shards import Position, check_first_documents
from titan_train.data.sources import DocumentSource, open_documents
from titan_train.tokenizer.base import Tokenizer

__all__ = ["MixtureDataLoader", "build_mixture_dataloader", "source_choices"]

_MASK = (1 << 64) - 1
_PHI = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, odd: g -> g * _PHI is a bijection mod 2^64


def _offset(seed: int) -> int:
    """A 64-bit start point of the draw from ``seed`` (splitmix64's finalizer)."""
    z = (seed * _PHI + _PHI) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _bounds(weights: list[float]) -> list[int]:
    """The upper end of each source's part of ``[0, 2^64)``; a zero weight gets none."""
    total, running, bounds = math.fsum(weights), 0.0, []
    for w in weights:
        running += w
        bounds.append(min(int(running / total * 2**64), 2**64))
    bounds[-1] = 2**64
    return bounds


def source_choices(seed: int, weights: list[float], first: int, count: int) -> list[int]:
    """The source index of global windows ``first .. first + count - 1``."""
    offset, bounds = _offset(seed), _bounds(weights)
    return [
        bisect.bisect_right(bounds, (offset + g * _PHI) & _MASK)
        for g in range(first, first + count)
    ]


class MixtureDataLoader(TextDataLoader):
    """``TextDataLoader``'s infinite batches, each window from one of ``sources`` drawn by
    ``weights`` and ``seed``; ``names`` key ``tokens_by_source``."""

    def __init__(
        self,
        sources: list[DocumentSource],
        weights: list[float],
        names: list[str],
        tokenizer: Tokenizer,
        *,
        seed: int,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        num_shards: int = 1,
        prefetch: int = 0,
        shard_layout: str = "interleaved",
    ) -> None:
        if not sources or not len(sources) == len(weights) == len(names):
            raise DataError("a mixture needs one weight and one name per source, and a source.")
        if not math.fsum(weights) > 0 or not all(math.isfinite(w) and w >= 0 for w in weights):
            raise DataError(f"mixture weights {weights} must be finite, >= 0, summing to > 0.")
        # Checks the arguments and the first source's first documents.
        first = next(k for k, w in enumerate(weights) if w > 0)
        super().__init__(
            sources[first],
            tokenizer,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_degree=dp_degree,
            infinite=True,
            num_shards=num_shards,
            prefetch=prefetch,
            shard_layout=shard_layout,
        )
        for k, source in enumerate(sources):
            if k == first or weights[k] == 0:
                continue  # a source never drawn is never read
            if shard_layout == "contiguous" and num_shards > 1:
                _check_regions(source, num_shards, self._own)
            else:
                check_first_documents(source, num_shards, self._own)
        self.sources, self.weights, self.names, self.seed = sources, list(weights), names, seed
        self._positions: dict[Any, Position] = {
            (k, s): Position() for k in range(len(sources)) for s in range(num_shards)
        }
        self._sources = {}
        # Windows per source before the loaded state's ``windows`` (counted from there on).
        self._counted = (0, [0] * len(sources))

    def tokens_by_source(self) -> dict[str, int]:
        """Training tokens (labels) taken from each source so far, over all ranks."""
        start, counts = self._counted
        counts = list(counts)
        for k in source_choices(self.seed, self.weights, start, self._windows - start):
            counts[k] += 1
        self._counted = (self._windows, counts)
        return {name: n * self.seq_len for name, n in zip(self.names, counts, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        """Windows consumed, each source's windows so far, and per source the position of
        each shard this rank reads."""
        self.tokens_by_source()  # brings the per-source counts up to ``windows``
        sources = {}
        for k in range(len(self.sources)):
            positions = {str(s): self._positions[k, s].as_dict() for s in self._own}
            if self.shard_layout == "contiguous":
                for s in self._own:
                    positions[str(s)]["source"] = self._sources.get((k, s), "")
            counted = self._counted[1][k]
            sources[str(k)] = {"source_windows": counted, self._positions_key: positions}
        return {"num_shards": self.num_shards, "windows": self._windows, "sources": sources}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a state saved at any ``dp_degree``, with the same sources in the
        same order (weights may change)."""
        self.close()
        saved = state_dict.get("sources")
        if not isinstance(saved, dict):
            raise DataError(
                "the dataloader state is not a mixture's (no 'sources'; it was saved by a "
                "single-dataset run). Add 'dataloader' to checkpoint.exclude_from_loading to "
                "start the data over."
            )
        if len(saved) != len(self.sources):
            raise DataError(
                f"the dataloader state holds {len(saved)} mixture source(s), this run has "
                f"{len(self.sources)} [[training.datasets]] entries. Resume with that run's "
                "entries, or add 'dataloader' to checkpoint.exclude_from_loading to start the "
                "data over."
            )
        counts = []
        for k in range(len(self.sources)):
            one = dict(saved[str(k)])
            counts.append(int(one.pop("source_windows")))
            # Each source's shard positions load as one source's do (checks included).
            super().load_state_dict({"num_shards": state_dict["num_shards"], "windows": 0, **one})
            for s in [s for s in self._positions if isinstance(s, int)]:
                self._positions[k, s] = self._positions.pop(s)
            for s in [s for s in self._sources if isinstance(s, int)]:
                self._sources[k, s] = self._sources.pop(s)
        self._windows = int(state_dict["windows"])
        self._counted = (self._windows, counts)

    def _batches(
        self, first: int, positions: dict[Any, Position], sources: dict[Any, str]
    ) -> Iterator[_Item]:
        contiguous = self.shard_layout == "contiguous" and self.num_shards > 1
        readers = [
            self._reader(
                documents,
                {s: positions[k, s] for s in self._own},
                {s: sources[k, s] for s in self._own if (k, s) in sources},
            )
            for k, documents in enumerate(self.sources)
        ]
        own = set(self._own)
        per_step, window = self.local_batch_size * self.dp_degree, first
        while True:
            mine = []
            for j, k in enumerate(source_choices(self.seed, self.weights, window, per_step)):
                g = window + j
                if g % self.num_shards not in own:
                    continue  # another rank's shard: it reads it
                cut = readers[k].next_window(g % self.num_shards)
                assert cut is not None  # infinite data
                if g % self.dp_degree == self.dp_rank:
                    mine.append(cut)
            window += per_step
            batch = torch.tensor(mine, dtype=torch.long)
            yield (
                batch[:, :-1].contiguous(),
                batch[:, 1:].contiguous(),
                window,
                {(k, s): p for k, r in enumerate(readers) for s, p in r.positions().items()},
                {
                    (k, s): state
                    for k, r in enumerate(readers)
                    for s, state in (r.source_states() if contiguous else {}).items()
                },
            )


def build_mixture_dataloader(
    entries: list[DatasetEntry],
    tokenizer: Tokenizer,
    *,
    seed: int,
    data: DataConfig,
    dp_rank: int = 0,
    dp_degree: int = 1,
) -> MixtureDataLoader:
    """The mixture of ``entries`` for one data-parallel rank; ``data`` gives the batching
    (``seq_len``, ``local_batch_size``, ``num_shards``, ``prefetch``, ``shard_layout``)."""
    sources = [
        open_documents(
            entry.data_config(
                seq_len=data.seq_len,
                local_batch_size=data.local_batch_size,
                infinite=True,
                num_shards=data.num_shards,
                shard_layout=data.shard_layout,
            )
        )
        for entry in entries
    ]
    return MixtureDataLoader(
        sources,
        [float(e.weight) for e in entries],
        [e.label for e in entries],
        tokenizer,
        seed=seed,
        seq_len=data.seq_len,
        local_batch_size=data.local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        num_shards=data.num_shards,
        prefetch=data.prefetch,
        shard_layout=data.shard_layout,
    )
