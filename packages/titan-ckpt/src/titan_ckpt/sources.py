"""Reading any checkpoint format entry by entry: DCP, safetensors (file, folder, HF), torch.save.

Every format is seen as a flat mapping of dotted keys to entries: a tensor (key, shape, dtype,
bytes, and for DCP its shards) or a non-tensor object. ``entries()`` reads metadata only;
``read(keys)`` loads just those keys, so the commands stream a checkpoint in bounded memory.
Model tensors sit at the top level by FQN; other states under their names, as DCP lays them out.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
import struct
import warnings
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_ckpt.layout import COMMIT_MARKER
from titan_ckpt.read_errors import (
    CheckpointFormatError,
    CheckpointReadError,
    UnsafeCheckpointError,
)
from titan_ckpt.safetensors_format import ST_DTYPES, TORCH_TO_ST, read_header

__all__ = [  # ST_DTYPES and TORCH_TO_ST are re-exported from safetensors_format
    "ST_DTYPES",
    "TORCH_TO_ST",
    "CheckpointFormatError",
    "CheckpointReadError",
    "DcpSource",
    "Entry",
    "SafetensorsSource",
    "Source",
    "TorchSource",
    "UnsafeCheckpointError",
    "batches",
    "detect",
    "group_of",
    "open_source",
]

STATE_GROUPS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")
DCP_METADATA = ".metadata"
OBJECT_PREFIX = "titan.object:"  # safetensors __metadata__ key of a non-tensor entry
_RANK_RE = re.compile(r"^__(\d+)_")
_STEP_RE = re.compile(r"^step-(\d+)$")


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def group_of(key: str) -> str:
    """The top-level state a key belongs to: its first component, or ``model`` for FQNs."""
    head = key.split(".", 1)[0]
    return head if head in STATE_GROUPS else "model"


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
        n = 1
        for s in self.shape or ():
            n *= s
        return n


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

    def close(self) -> None:
        pass

    def largest_tensor_bytes(self) -> int:
        return max((e.nbytes for e in self.entries.values() if e.is_tensor), default=0)


def batches(source: Source, keys: Iterable[str], budget: int) -> Iterator[list[str]]:
    """Groups of keys whose tensors together take at most ``budget`` bytes (or one tensor).

    Reading a group at a time amortizes DCP's per-load planning over many small tensors while
    holding at most ``budget`` bytes (callers pass about the largest tensor's size).
    """
    group: list[str] = []
    size = 0
    for key in keys:
        n = source.entries[key].nbytes
        if group and size + n > budget:
            yield group
            group, size = [], 0
        group.append(key)
        size += n
    if group:
        yield group


# --- DCP -----------------------------------------------------------------------------------


class DcpSource(Source):
    """A torch.distributed.checkpoint directory (ours or torchtitan's): ``.metadata`` + data."""

    format = "dcp"

    def __init__(self, path: str, *, trust_pickles: bool = False) -> None:
        super().__init__(path)
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from titan_ckpt.safe_dcp import SafeFileSystemReader

        meta_path = os.path.join(path, DCP_METADATA)
        if not os.path.exists(meta_path):
            raise FileNotFoundError(f"{meta_path} is missing: DCP cannot read this step.")
        # Metadata and non-tensor records are unpickled under an allowlist (safe_pickle).
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
                dtype = md.properties.dtype
                shape = tuple(md.size)
                entry = Entry(key, shape, dtype, 0)
                entry.nbytes = entry.numel * dtype.itemsize
                where = {tuple(i.offset): info for i, info in stored if i.offset is not None}
                for chunk in md.chunks:
                    info = where.get(tuple(chunk.offsets))
                    entry.shards.append(
                        {
                            "offsets": list(chunk.offsets),
                            "sizes": list(chunk.sizes),
                            "file": info.relative_path if info else None,
                            "rank": _rank(info.relative_path) if info else None,
                            "offset": info.offset if info else None,
                            "length": info.length if info else None,
                            "transforms": list(info.transform_descriptors or ()) if info else [],
                        }
                    )
            else:
                entry = Entry(key, None, None, sum(info.length for _, info in stored))
                entry.shards = [
                    {
                        "file": info.relative_path,
                        "rank": _rank(info.relative_path),
                        "offset": info.offset,
                        "length": info.length,
                    }
                    for _, info in stored
                ]
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
        # file. Loading that record directly skips DCP's copy into a preallocated tensor, so
        # a tensor costs its own bytes once instead of twice.
        e = self.entries[key]
        try:
            with open(os.path.join(self.path, s["file"]), "rb") as f:
                record = _FileSlice(f, s["offset"], s["length"])
                t = _load_contiguous_record(record, e)
                if t is None:
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
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from titan_ckpt.safe_dcp import check_stored, unwrap_read_errors

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
        keys = rest
        state: dict[str, Any] = out
        for key in keys:
            e = self.entries[key]
            state[key] = torch.empty(e.shape, dtype=e.dtype) if e.is_tensor else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to load in one process"
            try:
                with unwrap_read_errors():  # our own errors (an unsafe record) as they are
                    dcp.load(state, storage_reader=self._reader, no_dist=True)
            except CheckpointException as error:  # a BaseException: make it an ordinary one
                failures = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
                causes = [f"{type(e).__name__}: {e}" for e in failures]
                shown = ", ".join(keys[:4]) + (" ..." if len(keys) > 4 else "")
                raise CheckpointReadError(
                    f"{self.path}: DCP could not read {shown}: {'; '.join(causes)[:300]}"
                ) from None
        return state


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


def _load_contiguous_record(record: _FileSlice, e: Entry) -> torch.Tensor | None:
    """Read a torch.save record's tensor bytes straight into a new tensor, or None if the
    record is not one plain little-endian contiguous tensor stored uncompressed.

    ``torch.load`` from a file object stages the storage through a buffer of its own size, so
    this halves the peak memory of reading a large tensor. The pickle is still parsed (to the
    meta device, without data) to check shape, dtype and strides.
    """
    meta = torch.load(record, map_location="meta", weights_only=True)
    if (
        not isinstance(meta, torch.Tensor)
        or tuple(meta.shape) != e.shape
        or meta.dtype != e.dtype
        or not meta.is_contiguous()
        or meta.storage_offset() != 0
        or e.nbytes == 0
    ):
        return None
    record.seek(0)
    with zipfile.ZipFile(record) as archive:
        infos = archive.infolist()
        data = [i for i in infos if re.search(r"/data/\d+$", i.filename)]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if order and archive.read(order[0]).strip() != b"little":
            return None
        if len(data) != 1 or data[0].compress_type != zipfile.ZIP_STORED:
            return None
        info = data[0]
        if info.file_size != e.nbytes:
            return None
        record.seek(info.header_offset)
        local = record.read(30)
        name_len, extra_len = struct.unpack("<HH", local[26:30])
    t = torch.empty(e.shape, dtype=e.dtype)
    read_exactly(record, info.header_offset + 30 + name_len + extra_len, t, f"record of {e.key}")
    return t


def _rank(file_name: str) -> int | None:
    m = _RANK_RE.match(os.path.basename(file_name))
    return int(m.group(1)) if m else None


# --- safetensors ---------------------------------------------------------------------------


class SafetensorsSource(Source):
    """A ``.safetensors`` file, or a folder of them (sharded with an index, or an HF folder)."""

    format = "safetensors"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            self.root = path
            if os.path.exists(os.path.join(path, "config.json")):
                self.format = "hf"
                with open(os.path.join(path, "config.json")) as f:
                    self.info["config"] = json.load(f)
        else:
            names = [os.path.basename(path)]
            self.root = os.path.dirname(path) or "."
        self._files = names
        self._where: dict[str, str] = {}  # key -> file name
        self.objects: dict[str, str] = {}
        for name in names:
            full = os.path.join(self.root, name)
            with open(full, "rb") as f:
                header = read_header(f, os.path.getsize(full), full)
            for k, v in header.metadata.items():
                if k.startswith(OBJECT_PREFIX):
                    self.objects[k[len(OBJECT_PREFIX) :]] = v
                else:
                    self.info.setdefault("metadata", {})[k] = v
            for key, t in header.tensors.items():
                self._where[key] = name
                self.entries[key] = Entry(
                    key,
                    t.shape,
                    t.dtype,
                    t.nbytes,
                    shards=[{"file": name, "offset": t.begin, "length": t.nbytes}],
                )
        for key, blob in self.objects.items():
            self.entries[key] = Entry(key, None, None, len(blob))
        self.entries = dict(sorted(self.entries.items()))

    def files(self) -> list[str]:
        return list(self._files)

    def read(self, keys: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in keys:
            if key in self.objects:
                out[key] = decode_object(self.objects[key])
                continue
            name = self._where[key]
            e = self.entries[key]
            # read_header checked that these bytes lie inside the file.
            t = torch.empty(e.shape or (), dtype=e.dtype)
            with open(os.path.join(self.root, name), "rb") as f:
                read_exactly(f, e.shards[0]["offset"], t, f"{name}: {key}")
            out[key] = t
        return out


def encode_object(value: Any) -> str:
    """A non-tensor entry as text for safetensors' ``__metadata__`` (torch.save, base64)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return base64.b64encode(buf.getvalue()).decode()


def decode_object(text: str) -> Any:
    try:
        return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    except Exception as error:
        raise _refusal("a non-tensor entry in __metadata__", error) or CheckpointReadError(
            f"a non-tensor entry in __metadata__ does not load ({type(error).__name__}: "
            f"{str(error)[:200]})"
        ) from None


def _refusal(file: str, error: Exception) -> UnsafeCheckpointError | None:
    """torch.load(weights_only=True)'s refusal of a global, as our error naming it."""
    found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", str(error))
    if isinstance(error, pickle.UnpicklingError) and found:
        return UnsafeCheckpointError.refused(file, found.group(1))
    return None


# --- torch.save ----------------------------------------------------------------------------


class TorchSource(Source):
    """A ``torch.save`` file of a (nested) state dict, read one tensor at a time.

    The file is loaded to the meta device first (no data), which gives every storage's offset
    in the file; ``read`` then reads just those bytes into fresh tensors. Memory-mapping the
    file instead would be lazy too, but every page read stays mapped, and counted in the
    process's resident memory, until the whole file is closed. Files torch cannot place that
    way (the legacy format, big-endian data, tensors inside lists) are memory-mapped or, for
    the legacy format, loaded whole.
    """

    format = "torch"

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._offsets: dict[str, int] = {}
        try:
            obj = self._load_layout(path)
            self._lazy = obj is not None
            if obj is None:
                try:
                    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                    obj = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise _refusal(path, error) or CheckpointFormatError(
                f"{path} is not a readable torch.save file of tensors and plain values: {error}"
            ) from None
        if not isinstance(obj, dict):
            raise CheckpointFormatError(
                f"{path} holds a {type(obj).__name__}, not a state dict (a dict)."
            )
        self._values: dict[str, Any] = {}
        _flatten(obj, "", self._values)
        for key, value in self._values.items():
            if isinstance(value, torch.Tensor):
                self.entries[key] = Entry(
                    key, tuple(value.shape), value.dtype, value.numel() * value.element_size()
                )
            else:
                self.entries[key] = Entry(key, None, None, len(repr(value)))

    @staticmethod
    def _load_layout(path: str) -> Any:
        """The state dict with meta tensors whose storages know their file offsets, or None
        when that does not describe the file's data (then the caller maps it)."""
        try:
            with zipfile.ZipFile(path) as archive:
                order = [n for n in archive.namelist() if n.endswith("/byteorder")]
                if order and archive.read(order[0]).strip() != b"little":
                    return None
        except zipfile.BadZipFile:
            return None  # the legacy format
        obj = torch.load(path, map_location="meta", weights_only=True)
        if not isinstance(obj, dict):
            return obj  # refused by the caller
        flat: dict[str, Any] = {}
        _flatten(obj, "", flat)
        for value in flat.values():
            if isinstance(value, torch.Tensor):
                if getattr(value.untyped_storage(), "_checkpoint_offset", None) is None:
                    return None
            elif _holds_tensor(value):
                return None  # read() returns such values whole: map the file instead
        return obj

    def files(self) -> list[str]:
        return [os.path.basename(self.path)]

    def read(self, keys: list[str]) -> dict[str, Any]:
        if not self._lazy:
            return {k: self._values[k] for k in keys}
        out: dict[str, Any] = {}
        with open(self.path, "rb") as f:
            for key in keys:
                value = self._values[key]
                if not isinstance(value, torch.Tensor):
                    out[key] = value
                    continue
                try:
                    out[key] = _read_storage(f, value)
                except CheckpointReadError:
                    raise
                except Exception as error:  # a view that does not fit its storage
                    raise CheckpointReadError(
                        f"{self.path}: cannot read {key}: {type(error).__name__}: "
                        f"{str(error)[:200]}"
                    ) from None
        return out


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _read_storage(f: Any, meta: torch.Tensor) -> torch.Tensor:
    """The CPU tensor ``meta`` describes, read from its storage's bytes in the file ``f``."""
    storage = meta.untyped_storage()
    nbytes = storage.nbytes()
    end = storage._checkpoint_offset + nbytes
    if end > os.fstat(f.fileno()).st_size:  # checked before allocating: a damaged file
        raise CheckpointReadError(
            f"{f.name}: a {list(meta.shape)} {meta.dtype} tensor's storage ends at byte {end}, "
            "beyond the end of the file (a truncated or damaged file)."
        )
    whole = meta.is_contiguous() and meta.storage_offset() == 0 and meta.nbytes == nbytes
    if whole:
        out = torch.empty(meta.shape, dtype=meta.dtype)
    else:
        out = torch.empty(nbytes, dtype=torch.uint8)
    what = f"{f.name}: the data of a {list(meta.shape)} {meta.dtype} tensor"
    read_exactly(f, storage._checkpoint_offset, out, what)
    if whole:
        return out
    # A view into a larger storage (a slice, a transpose): rebuild it, then keep its own bytes.
    t = torch.empty(0, dtype=meta.dtype).set_(
        out.untyped_storage(), meta.storage_offset(), meta.shape, meta.stride()
    )
    return t.clone()


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    # Dicts nest by name, as DCP flattens them; lists and other values are leaves.
    if isinstance(obj, dict) and obj and all(isinstance(k, str) for k in obj):
        for k, v in obj.items():
            _flatten(v, f"{prefix}{k}.", out)
    else:
        out[prefix[:-1]] = obj


# --- detection -----------------------------------------------------------------------------


def detect(path: str) -> str:
    """``dcp``, ``safetensors``, ``hf``, ``torch`` or ``folder`` (of ``step-<N>`` dirs)."""
    if not os.path.exists(path):
        raise CheckpointFormatError(f"{path} does not exist.")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return "safetensors"
        return "torch"
    names = os.listdir(path)
    if DCP_METADATA in names or COMMIT_MARKER in names or any(n.endswith(".distcp") for n in names):
        return "dcp"
    if any(n.endswith(".safetensors") for n in names):
        return "hf" if "config.json" in names else "safetensors"
    if any(_STEP_RE.match(n) for n in names):
        return "folder"
    raise CheckpointFormatError(
        f"{path} is not a checkpoint: no .metadata (DCP), *.safetensors, or step-<N>/ "
        "directories in it. Pass a step directory, a checkpoint folder, a safetensors file or "
        "folder, or a torch.save file."
    )


def open_source(path: str, *, trust_pickles: bool = False) -> Source:
    """Open ``path`` for reading by its detected format (not a folder of steps); a DCP
    step's pickles are unpickled under the allowlist of ``safe_pickle`` unless
    ``trust_pickles``."""
    kind = detect(path)
    if kind == "dcp":
        return DcpSource(path, trust_pickles=trust_pickles)
    if kind in ("safetensors", "hf"):
        return SafetensorsSource(path)
    if kind == "torch":
        return TorchSource(path)
    raise CheckpointFormatError(
        f"{path} is a checkpoint folder (step-<N>/ directories); pass one step, e.g. "
        f"{os.path.join(path, 'step-<N>')}."
    )
