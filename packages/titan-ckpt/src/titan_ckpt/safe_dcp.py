"""DCP storage readers that never run a checkpoint's code: metadata and records, checked.

``SafeFileSystemReader`` (and the fsspec form from ``safe_fsspec_reader``) is torch's reader
with two changes, both skipped with ``trust_pickles=True``:

- ``read_metadata`` unpickles ``.metadata`` through ``safe_pickle.load_metadata`` (an
  allowlist of DCP's types) and checks the result's structure: every field the readers use
  has the type DCP gives it, so a damaged file ends in ``CheckpointReadError`` rather than an
  ``AttributeError`` somewhere later.
- ``read_data`` hands DCP's planner a wrapper whose ``load_bytes`` first proves each
  non-tensor record (a ``torch.save`` the default planner loads with ``weights_only=False``)
  unpickles under the same allowlist. This works for any load planner.

``unwrap_read_errors`` turns DCP's ``CheckpointException`` (a ``BaseException`` that wraps
whatever a reader raised) back into the titan error inside it, or into one that names the
checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from titan_ckpt.read_errors import CheckpointReadError
from titan_ckpt.safe_pickle import check_record, load_metadata

__all__ = [
    "SafeFileSystemReader",
    "check_metadata",
    "check_stored",
    "safe_fsspec_reader",
    "unwrap_read_errors",
]


class _SafeReading:
    """The metadata and record checks; mixed in before a ``FileSystemReader`` class."""

    trust_pickles: bool = False
    path: Any
    fs: Any
    load_id: Any
    storage_data: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as stream:
            metadata = load_metadata(stream, str(path), trust=self.trust_pickles)
        check_metadata(metadata, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not self.trust_pickles:
            planner = _CheckedRecords(planner, self)
        try:
            return super().read_data(plan, planner)  # type: ignore[misc]
        except CheckpointReadError:
            raise
        except Exception as error:  # a damaged data file: torch's own message, with the path
            raise CheckpointReadError(
                f"{self.path}: DCP cannot read its data ({type(error).__name__}: "
                f"{str(error).strip()[:300]})"
            ) from None


class SafeFileSystemReader(_SafeReading, FileSystemReader):
    """torch's ``FileSystemReader``, with pickles restricted unless ``trust_pickles``."""

    def __init__(self, path: str | os.PathLike, *, trust_pickles: bool = False) -> None:
        super().__init__(path)
        self.trust_pickles = trust_pickles


@functools.cache
def _fsspec_reader_class() -> type:
    # DCP's fsspec reader is in a private module that imports fsspec: built on first use.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class SafeFsspecReader(_SafeReading, FsspecReader):
        """torch's ``FsspecReader``, with pickles restricted unless ``trust_pickles``."""

    return SafeFsspecReader


def safe_fsspec_reader(url: str, *, trust_pickles: bool = False) -> Any:
    """DCP's fsspec reader for ``url`` with the checks of ``SafeFileSystemReader``."""
    reader = _fsspec_reader_class()(url)
    reader.trust_pickles = trust_pickles
    return reader


class _CheckedRecords:
    """A load planner whose ``load_bytes`` checks each record before the real one loads it."""

    def __init__(self, planner: Any, reader: _SafeReading) -> None:
        self._planner = planner
        self._reader = reader

    def load_bytes(self, read_item: Any, value: Any) -> None:
        info = self._reader.storage_data[read_item.storage_index]
        where = f"{os.path.join(str(self._reader.path), info.relative_path)} (the record of "
        check_record(value, f"{where}{read_item.dest_index.fqn!r})")
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


@contextlib.contextmanager
def unwrap_read_errors(where: str | None = None) -> Iterator[None]:
    """Re-raise a ``CheckpointReadError`` (unsafe or damaged data) that DCP wrapped in its
    ``CheckpointException``; with ``where`` (the checkpoint's path), any other failure of
    DCP's load steps becomes a ``CheckpointReadError`` naming it and DCP's causes."""
    try:
        yield
    except CheckpointException as error:
        failures = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        for exc in failures:
            if isinstance(exc, CheckpointReadError):
                raise exc from None
        if where is None:
            raise
        causes = "; ".join(f"{type(e).__name__}: {str(e).strip()[:200]}" for e in failures)
        raise CheckpointReadError(
            f"{where}: DCP could not load this checkpoint ({causes}); is it damaged? Run "
            "titan-ckpt verify on it."
        ) from None


def check_stored(directory: str, entries: list[Any]) -> None:
    """``CheckpointReadError``, before anything is allocated, for an entry (a
    ``sources.Entry``) whose stored bytes lie outside its file, or a tensor larger than the
    bytes stored for it (possible only when ``.metadata`` is damaged)."""
    sizes: dict[str, int] = {}
    for e in entries:
        stored = 0
        for s in e.shards:
            name = s.get("file")
            if name is None:
                raise CheckpointReadError(f"{directory}: {e.key} has a chunk with no file.")
            if name not in sizes:
                full = os.path.join(directory, name)
                sizes[name] = os.path.getsize(full) if os.path.isfile(full) else -1
            if s["offset"] + s["length"] > sizes[name]:
                raise CheckpointReadError(
                    f"{directory}: {e.key} is stored at bytes [{s['offset']}, "
                    f"{s['offset'] + s['length']}) of {name}, which "
                    + ("is missing." if sizes[name] < 0 else f"has {sizes[name]} bytes.")
                )
            stored += s["length"]
        transformed = any(s.get("transforms") for s in e.shards)  # e.g. compressed: unbounded
        if e.is_tensor and not transformed and e.nbytes > stored:
            raise CheckpointReadError(
                f"{directory}: {e.key} is a {list(e.shape or ())} {e.dtype} tensor of "
                f"{e.nbytes} bytes, but only {stored} bytes are stored for it."
            )


def check_metadata(metadata: Any, file: str) -> None:
    """``CheckpointReadError`` unless ``metadata`` has the structure DCP writes."""
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointReadError(f"{file} is damaged: {problem}.")


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(n, int) and n >= 0 for n in value)


def _metadata_problem(md: Any) -> str | None:
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}, not DCP metadata"
    if not isinstance(md.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"a key is a {type(key).__name__}, not a name"
        if isinstance(entry, TensorStorageMetadata):
            problem = _tensor_problem(entry)
            if problem:
                return f"{key}: {problem}"
        elif not isinstance(entry, BytesStorageMetadata):
            return f"{key}: a {type(entry).__name__} where tensor or bytes metadata belongs"
    if not isinstance(md.storage_data, dict):
        return "storage_data is not a dict"
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return "a storage entry has no key"
        if index.offset is not None and not _is_size(index.offset):
            return f"{index.fqn}: a storage offset is not a size"
        if not (
            isinstance(getattr(info, "relative_path", None), str)
            and isinstance(getattr(info, "offset", None), int)
            and isinstance(getattr(info, "length", None), int)
            and info.offset >= 0
            and info.length >= 0
        ):
            return f"{index.fqn}: its file, offset or length is not valid"
        if os.path.isabs(info.relative_path) or ".." in info.relative_path.split("/"):
            # A file outside the checkpoint: reading it would copy some other file's bytes
            # (a key, a password file) into whatever the checkpoint is converted to.
            return f"{index.fqn}: its data file {info.relative_path!r} is outside the checkpoint"
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not all(isinstance(t, str) for t in transforms):
            return f"{index.fqn}: its transforms are not names"
    return None


def _tensor_problem(entry: TensorStorageMetadata) -> str | None:
    dtype = getattr(entry.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return "no dtype"
    if not _is_size(entry.size):
        return "its size is not a torch.Size of non-negative ints"
    if not isinstance(entry.chunks, list):
        return "its chunks are not a list"
    for chunk in entry.chunks:
        if not (
            isinstance(chunk, ChunkStorageMetadata)
            and _is_size(chunk.offsets)
            and _is_size(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
        ):
            return "a chunk's offsets or sizes do not match its shape"
    return None
