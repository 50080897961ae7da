"""The DCP format: restricted readers, ``DcpSource`` for the commands, and a streaming writer.

``SafeFileSystemReader`` (and ``safe_fsspec_reader``) is torch's reader that unpickles
``.metadata`` and non-tensor records once, under the allowlists of ``formats.pickles``, and
checks the metadata's structure, so damage ends in ``CheckpointReadError``; both skipped with
``trust_pickles``. ``save_dcp_streaming`` runs DCP's own planner over stand-in tensors and
writes each tensor's record as it arrives from a stream (DCP's writer keeps every tensor of a
file referenced until the file is done, so it cannot stream).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from titan_ckpt.errors import CheckpointFormatError, CheckpointReadError
from titan_ckpt.formats.base import Entry, Source, TensorSpec, check_streamed
from titan_ckpt.formats.hashing import records_without_crc32
from titan_ckpt.formats.pickles import load_metadata, load_record
from titan_ckpt.formats.torch_save import load_meta, read_storage

__all__ = [
    "DCP_METADATA",
    "DcpSource",
    "SafeFileSystemReader",
    "check_metadata",
    "check_stored",
    "safe_fsspec_reader",
    "save_dcp_streaming",
    "unwrap_read_errors",
]

DCP_METADATA = ".metadata"
_RANK_RE = re.compile(r"^__(\d+)_")


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
    """A load planner whose ``load_bytes`` unpickles each record once, under the record
    allowlist (``pickles.load_record``), and stores that object where DCP's default planner
    would: the bytes never reach the planner's own ``torch.load(weights_only=False)``."""

    def __init__(self, planner: Any, reader: _SafeReading) -> None:
        if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
            raise CheckpointReadError(
                f"{type(planner).__name__} unpickles records its own way, which titan-ckpt "
                "cannot restrict: load with DCP's DefaultLoadPlanner, or pass "
                "trust_pickles=True for a checkpoint you made yourself."
            )
        self._planner = planner
        self._reader = reader

    def load_bytes(self, read_item: Any, value: Any) -> None:
        info = self._reader.storage_data[read_item.storage_index]
        fqn = read_item.dest_index.fqn
        path = os.path.join(str(self._reader.path), info.relative_path)
        obj = load_record(value, f"{path} (the record of {fqn!r})")
        planner = self._planner
        # What DefaultLoadPlanner.load_bytes does with the object it unpickles.
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], obj)
        else:
            planner.state_dict[fqn] = obj

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
        failures = _failures(error)
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


def _failures(error: CheckpointException) -> list[BaseException]:
    """The per-rank errors inside DCP's ``CheckpointException``."""
    return [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]


def check_stored(directory: str, entries: list[Any]) -> None:
    """``CheckpointReadError``, before anything is allocated, for an entry (a
    ``base.Entry``) whose stored bytes lie outside its file, or a tensor larger than the
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


# --- reading for the commands ------------------------------------------------------------


class DcpSource(Source):
    """A torch.distributed.checkpoint directory (ours or torchtitan's): ``.metadata`` + data."""

    format = "dcp"

    def __init__(self, path: str, *, trust_pickles: bool = False) -> None:
        super().__init__(path)
        meta_path = os.path.join(path, DCP_METADATA)
        if not os.path.exists(meta_path):
            raise CheckpointFormatError(f"{meta_path} is missing: DCP cannot read this step.")
        # Metadata and non-tensor records are unpickled under an allowlist (formats.pickles).
        self._reader = SafeFileSystemReader(path, trust_pickles=trust_pickles)
        self.metadata = self._reader.read_metadata()
        # One metadata read for every later load: DCP would re-read and unpickle it per call.
        self._reader.read_metadata = lambda *a, **k: self.metadata  # type: ignore[method-assign]
        storage = self.metadata.storage_data or {}
        by_fqn: dict[str, list[tuple[Any, Any]]] = {}
        for index, info in storage.items():
            by_fqn.setdefault(index.fqn, []).append((index, info))
        for key, md in self.metadata.state_dict_metadata.items():
            stored = by_fqn.get(key, [])
            if isinstance(md, TensorStorageMetadata):
                shape, dtype = tuple(md.size), md.properties.dtype
                entry = Entry(key, shape, dtype, math.prod(shape) * dtype.itemsize)
                where = {tuple(i.offset): info for i, info in stored if i.offset is not None}
                for chunk in md.chunks:
                    shard = {"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)}
                    entry.shards.append(shard | _stored(where.get(tuple(chunk.offsets))))
            else:
                entry = Entry(key, None, None, sum(info.length for _, info in stored))
                entry.shards = [_stored(info) for _, info in stored]
            self.entries[key] = entry

    def files(self) -> list[str]:
        names = {s["file"] for e in self.entries.values() for s in e.shards if s.get("file")}
        return sorted(names)

    def _whole_chunk(self, key: str) -> dict[str, Any] | None:
        """The storage entry of a tensor stored as one untransformed chunk, else None."""
        e = self.entries[key]
        if not e.is_tensor or len(e.shards) != 1:
            return None
        s = e.shards[0]
        if s["file"] is None or any(s["offsets"]) or tuple(s["sizes"]) != e.shape:
            return None
        return s if not s.get("transforms") else None

    def _read_whole(self, key: str, s: dict[str, Any]) -> torch.Tensor:
        # DCP stores each chunk as a torch.save record at [offset, offset + length) of the
        # file. Reading its bytes straight into a new tensor (torch_save.read_storage) skips
        # DCP's copy into a preallocated tensor and torch.load's staging buffer (a file
        # object's storage is read through a buffer of its size): the tensor's bytes, once.
        e = self.entries[key]
        try:
            with open(os.path.join(self.path, s["file"]), "rb") as f:
                record = _FileSlice(f, s["offset"], s["length"])
                meta = load_meta(record)
                if isinstance(meta, torch.Tensor):
                    t = read_storage(record, meta, f"the record of {key}")
                else:
                    record.seek(0)
                    t = torch.load(record, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointReadError(
                f"{self.path}: cannot read {key} from {s['file']}: {type(error).__name__}: "
                f"{str(error)[:200]}"
            ) from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise CheckpointReadError(
                f"{self.path}: {key} in {s['file']} is not the {list(e.shape or ())} "
                f"{e.dtype} tensor .metadata describes."
            )
        return t

    def read(self, keys: list[str]) -> dict[str, Any]:
        # Nothing is allocated for a tensor the files cannot hold (a damaged .metadata).
        check_stored(self.path, [self.entries[k] for k in keys])
        out: dict[str, Any] = {}
        rest = []
        for key in keys:
            whole = self._whole_chunk(key)
            if whole is None:
                rest.append(key)
            else:
                out[key] = self._read_whole(key, whole)
        if not rest:
            return out
        # Only the rest: DCP would read the keys already in ``out`` again.
        state: dict[str, Any] = {}
        for key in rest:
            e = self.entries[key]
            state[key] = torch.empty(e.shape, dtype=e.dtype) if e.is_tensor else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in one process"
            try:
                with unwrap_read_errors():  # our own errors (an unsafe record) as they are
                    dcp.load(state, storage_reader=self._reader, no_dist=True)
            except CheckpointException as error:  # a BaseException: make it an ordinary one
                causes = [f"{type(e).__name__}: {e}" for e in _failures(error)]
                shown = ", ".join(rest[:4]) + (" ..." if len(rest) > 4 else "")
                raise CheckpointReadError(
                    f"{self.path}: DCP could not read {shown}: {'; '.join(causes)[:300]}"
                ) from None
        return out | state


class _FileSlice(io.RawIOBase):
    """A read-only, seekable window [offset, offset + length) of an open binary file."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = min(max(base + pos, 0), self._length)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


def _stored(info: _StorageInfo | None) -> dict[str, Any]:
    """Where a shard is stored: its file (and the rank that wrote it, from the file's name),
    byte range and transforms; all None for a chunk that ``.metadata`` stores nowhere."""
    if info is None:
        return {"file": None, "rank": None, "offset": None, "length": None, "transforms": []}
    m = _RANK_RE.match(os.path.basename(info.relative_path))
    return {
        "file": info.relative_path,
        "rank": int(m.group(1)) if m else None,
        "offset": info.offset,
        "length": info.length,
        "transforms": list(info.transform_descriptors or ()),
    }


# --- streaming writer ----------------------------------------------------------------------


def save_dcp_streaming(
    path: str,
    specs: dict[str, TensorSpec],
    objects: dict[str, Any],
    values: Iterable[tuple[str, torch.Tensor]],
) -> int:
    """Write a one-process DCP checkpoint into the directory ``path``: tensors ``specs``
    (shape, dtype) whose data ``values`` yields in any order, one at a time, and the
    non-tensor ``objects``. Returns the tensor bytes written."""
    # One element of memory each; DCP plans from shape, dtype and layout only.
    standins: dict[str, Any] = {
        k: torch.empty((), dtype=dtype).expand(shape) for k, (shape, dtype) in specs.items()
    }
    writer = _StreamingFileSystemWriter(path, specs, iter(values))
    # Records without zip CRC-32s, as the manager's saves (see titan_ckpt.formats.hashing).
    with warnings.catch_warnings(), records_without_crc32():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in one process"
        dcp.save({**standins, **objects}, storage_writer=writer, no_dist=True)
    return writer.written


class _StreamingFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose data comes from a stream, one tensor at a time."""

    def __init__(
        self, path: str, specs: dict[str, TensorSpec], values: Iterator[tuple[str, Any]]
    ) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self._specs = specs
        self._values = values
        self.written = 0

    def write_data(self, plan: Any, planner: Any) -> torch.futures.Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        by_key: dict[str, Any] = {}
        in_memory = []  # objects, and tensors inside them (DCP flattens lists of tensors)
        for item in plan.items:
            key = item.index.fqn
            if item.type == WriteItemType.BYTE_IO or key not in self._specs:
                in_memory.append(item)
                continue
            shape = tuple(self._specs[key][0])
            chunk = item.tensor_data.chunk
            if key in by_key or any(chunk.offsets) or tuple(chunk.sizes) != shape:
                raise RuntimeError(f"internal: DCP planned {key} in more than one chunk")
            by_key[key] = item
        results = []
        with open(os.path.join(os.fspath(self.path), name), "wb") as f:

            def record(item: Any, write: Any) -> None:
                offset = f.tell()
                write()
                length = f.tell() - offset
                info = _StorageInfo(name, offset, length)
                results.append(
                    WriteResult(index=item.index, size_in_bytes=length, storage_data=info)
                )

            for item in in_memory:
                data = planner.resolve_data(item)  # an object comes torch.save'd in a BytesIO
                if item.type == WriteItemType.BYTE_IO:
                    record(item, lambda data=data: f.write(data.getbuffer()))
                    continue
                data = data.detach().cpu()
                if data.untyped_storage().nbytes() != data.nbytes:
                    data = data.clone()
                record(item, lambda data=data: torch.save(data, f))
            for key, value in self._values:
                item = by_key.pop(key, None)
                if item is None:
                    raise RuntimeError(f"internal: {key} was streamed but not planned")
                tensor = check_streamed(key, value, self._specs[key])
                del value
                if tensor.untyped_storage().nbytes() != tensor.nbytes:
                    tensor = tensor.clone()  # save the tensor's bytes, not a larger storage
                # The record DCP's FileSystemWriter writes for a tensor: torch.save of it.
                record(item, lambda tensor=tensor: torch.save(tensor, f))
                self.written += tensor.nbytes
                del tensor  # before the next one is read
            if by_key:
                raise RuntimeError(f"internal: {sorted(by_key)[:3]} planned but not streamed")
            f.flush()
            os.fsync(f.fileno())
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done
