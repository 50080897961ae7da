"""What every checkpoint format shares: ``Entry``, ``Source``, ``batches`` and byte reading.

Every format is seen as a flat mapping of dotted keys to entries: a tensor (key, shape, dtype,
bytes, and for DCP its shards) or a non-tensor object. ``Source.entries`` comes from metadata
only; ``Source.read(keys)`` loads just those keys, so the commands stream a checkpoint in
bounded memory. Model tensors sit at the top level by FQN; other states under their names, as
DCP lays them out.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_ckpt.errors import CheckpointReadError

__all__ = [
    "STATE_GROUPS",
    "Entry",
    "Source",
    "TensorSpec",
    "batches",
    "check_streamed",
    "dtype_name",
    "group_of",
    "read_exactly",
    "select_keys",
    "size_groups",
]

STATE_GROUPS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""A tensor's shape and dtype, as known before its data is read."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (as config.json and the reports spell it)."""
    return str(dtype).removeprefix("torch.")


def group_of(key: str) -> str:
    """The top-level state a key belongs to: its first component, or ``model`` for FQNs."""
    head = key.split(".", 1)[0]
    return head if head in STATE_GROUPS else "model"


def select_keys(
    keys: Iterable[str], include: Sequence[str] = (), exclude: Sequence[str] = ()
) -> list[str]:
    """``keys`` (in order) that match one of the ``include`` globs (all when empty) and none
    of the ``exclude`` globs."""
    return [
        key
        for key in keys
        if (not include or any(fnmatch.fnmatchcase(key, p) for p in include))
        and not any(fnmatch.fnmatchcase(key, p) for p in exclude)
    ]


def read_exactly(f: Any, offset: int, out: torch.Tensor, what: str) -> None:
    """Fill the contiguous CPU tensor ``out`` with the bytes of file ``f`` from ``offset``;
    ``CheckpointReadError`` naming ``what`` if the file ends first (a truncated file)."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.nbytes else memoryview(b"")
    f.seek(offset)
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise CheckpointReadError(
                f"{what} ends after {done} of {len(view)} bytes (a truncated file?)"
            )
        done += got


def check_streamed(key: str, value: Any, spec: TensorSpec) -> torch.Tensor:
    """The streamed ``value`` of ``key`` on the CPU, checked against its planned ``spec``."""
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"internal: {key} was streamed as {type(value).__name__}")
    shape, dtype = spec
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise RuntimeError(
            f"{key}: got {list(value.shape)} {value.dtype}, the layout says {list(shape)} {dtype}"
        )
    return value.detach().cpu()


@dataclass
class Entry:
    """One key of a checkpoint: a tensor (shape and dtype set) or a non-tensor object."""

    key: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    nbytes: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    """DCP only: {"offsets", "sizes", "file", "rank"} per stored chunk."""

    @property
    def is_tensor(self) -> bool:
        return self.shape is not None

    @property
    def numel(self) -> int:
        return math.prod(self.shape or ())


class Source:
    """A checkpoint opened for reading; subclasses fill ``entries`` and implement ``read``."""

    format = "?"

    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, Entry] = {}
        self.info: dict[str, Any] = {}

    def read(self, keys: list[str]) -> dict[str, Any]:
        """Load ``keys``: tensors as CPU tensors of the stored dtype, objects as themselves."""
        raise NotImplementedError

    def files(self) -> list[str]:
        """The data files, relative to ``path`` (or ``path`` itself for a single file)."""
        raise NotImplementedError

    def largest_tensor_bytes(self) -> int:
        return max((e.nbytes for e in self.entries.values() if e.is_tensor), default=0)


def batches(source: Source, keys: Iterable[str], budget: int) -> Iterator[list[str]]:
    """Groups of keys whose tensors together take at most ``budget`` bytes (or one tensor).

    Reading a group at a time amortizes DCP's per-load planning over many small tensors while
    holding at most ``budget`` bytes (callers pass about the largest tensor's size).
    """
    return size_groups(((key, source.entries[key].nbytes) for key in keys), budget)


def size_groups(sizes: Iterable[tuple[str, int]], budget: float) -> Iterator[list[str]]:
    """The keys of ``sizes`` ((key, bytes) pairs) in order, in groups that together take at
    most ``budget`` bytes, or one key that alone takes more."""
    group: list[str] = []
    size = 0
    for key, n in sizes:
        if group and size + n > budget:
            yield group
            group, size = [], 0
        group.append(key)
        size += n
    if group:
        yield group
