"""The torch.save format: ``TorchSource`` reads a file lazily, ``save_torch_streaming`` writes.

Writing one tensor at a time: ``torch.save`` under ``torch.serialization.skip_data`` writes the
file's structure for FakeTensors (pickle, alignment, records with room for the bytes, no data);
``torch.load(map_location="meta")`` tells each storage's offset in the file; the bytes are then
written in place as the stream of ``(key, tensor)`` pairs arrives, and the zip's CRC-32 fields
filled in, so the file is what ``torch.save`` would have written (``zipfile`` checks pass too).
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_ckpt.errors import CheckpointFormatError, CheckpointReadError
from titan_ckpt.formats.base import Entry, Source, TensorSpec, check_streamed, read_exactly
from titan_ckpt.formats.pickles import refusal, stored_member

__all__ = ["TorchSource", "save_torch_streaming"]


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
            if (refused := refusal(path, error)) is not None:
                raise refused from None
            if _starts_as_torch_save(path):  # damage (a truncated copy), not another format
                raise CheckpointReadError(
                    f"{path} is a damaged torch.save file (truncated?): it does not load "
                    f"({type(error).__name__}: {str(error)[:200]})."
                ) from None
            raise CheckpointFormatError(
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
            with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
                order = [i for i in archive.infolist() if i.filename.endswith("/byteorder")]
                if order and stored_member(f, order[0]).strip() != b"little":
                    return None
        except (zipfile.BadZipFile, ValueError):
            return None  # the legacy format, or a damaged zip: the caller maps it
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


_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
"""The first bytes of the legacy (pre-zip) format: its magic number, pickled."""


def _starts_as_torch_save(path: str) -> bool:
    """Whether ``path`` begins as ``torch.save`` writes: a zip whose first member is
    ``<name>/data.pkl``, or the legacy format's magic number."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:  # unreadable: the caller's format error says so
        return False
    if head.startswith(_LEGACY_MAGIC):
        return True
    if not head.startswith(b"PK\x03\x04") or len(head) < 30:
        return False
    name_length = struct.unpack_from("<H", head, 26)[0]
    return head[30 : 30 + name_length].endswith(b"data.pkl")


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


# --- streaming writer ----------------------------------------------------------------------


def save_torch_streaming(
    path: str,
    keys: list[str],
    specs: dict[str, TensorSpec],
    objects: dict[str, Any],
    values: Iterable[tuple[str, torch.Tensor]],
) -> int:
    """Write ``{key: value for key in keys}`` as a ``torch.save`` file at ``path``: the
    tensors ``specs`` come from ``values`` in any order, one at a time; ``objects`` (small,
    non-tensor values, which may hold tensors) are given whole. Returns the file's size."""
    with FakeTensorMode():
        fakes = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in specs.items()}
    state = {k: fakes[k] if k in fakes else objects[k] for k in keys}
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, path)
    del state, fakes
    layout = torch.load(path, map_location="meta", weights_only=True)
    crcs: dict[int, int] = {}  # data offset -> CRC-32 of the record
    with open(path, "r+b") as f:
        for key, value in values:
            if key not in specs:
                raise RuntimeError(f"internal: {key} was streamed but not in the layout")
            tensor = check_streamed(key, value, specs[key]).contiguous()
            del value
            meta = layout[key]
            if meta.storage_offset() != 0 or meta.untyped_storage().nbytes() != tensor.nbytes:
                raise RuntimeError(f"internal: {key} is not laid out as one whole storage")
            crcs[_offset(meta)] = _write_at(f, _offset(meta), tensor)
            del tensor
        # Tensors inside non-tensor values (rare: a list of tensors) were saved with their
        # structure but without their bytes: write each storage whole.
        for key, obj in objects.items():
            for real, meta in zip(_tensors_in(obj), _tensors_in(layout[key]), strict=True):
                storage = real.detach().cpu().untyped_storage()
                data = torch.empty(0, dtype=torch.uint8).set_(storage)
                crcs[_offset(meta)] = _write_at(f, _offset(meta), data)
        _fill_crcs(f, crcs)
        f.flush()
        os.fsync(f.fileno())
    return os.path.getsize(path)


def _offset(meta: torch.Tensor) -> int:
    offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if offset is None:
        raise RuntimeError(
            f"torch {torch.__version__} does not report storage offsets when loading to the "
            "meta device; streaming torch.save output needs torch >= 2.9."
        )
    return int(offset)


def _write_at(f: Any, offset: int, tensor: torch.Tensor) -> int:
    """Write ``tensor``'s bytes at ``offset``; returns their CRC-32."""
    if tensor.numel() == 0:
        return 0
    data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    f.seek(offset)
    f.write(data)
    return zlib.crc32(data)


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"


def _fill_crcs(f: Any, crcs: dict[int, int]) -> None:
    """Set the CRC-32 of the records starting at the given data offsets, in the central
    directory and in each record's data descriptor (``skip_data`` left them 0)."""
    f.seek(0)
    archive = zipfile.ZipFile(f)  # reads the central directory only
    infos = archive.infolist()
    start = archive.start_dir
    for info in infos:
        f.seek(info.header_offset)
        local = f.read(30)
        if local[:4] != _LOCAL:
            raise RuntimeError(f"internal: no local header for {info.filename}")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        data_offset = info.header_offset + 30 + name_len + extra_len
        crc = crcs.pop(data_offset, None)
        # Walk the central directory entry of this record (entries are in infolist order).
        f.seek(start)
        central = f.read(46)
        if central[:4] != _CENTRAL:
            raise RuntimeError("internal: the central directory is not where zipfile said")
        n, m, k = struct.unpack("<HHH", central[28:34])
        entry, start = start, start + 46 + n + m + k
        if crc is None or crc == info.CRC:
            continue
        f.seek(entry + 16)
        f.write(struct.pack("<I", crc))
        if info.flag_bits & 0x08:  # a data descriptor follows the data
            f.seek(data_offset + info.compress_size)
            if f.read(4) == _DESCRIPTOR:
                f.write(struct.pack("<I", crc))
    if crcs:
        raise RuntimeError("internal: tensor data written outside any zip record")
