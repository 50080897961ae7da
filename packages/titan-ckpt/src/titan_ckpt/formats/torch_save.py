"""The torch.save format: ``TorchSource`` reads a file lazily, ``save_torch_streaming``
writes one a tensor at a time."""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_ckpt.errors import CheckpointFormatError, CheckpointReadError
from titan_ckpt.formats.base import Entry, Source, TensorSpec, check_streamed, read_exactly
from titan_ckpt.formats.pickles import member_start, refusal, stored_member

__all__ = ["TorchSource", "load_meta", "read_storage", "save_torch_streaming"]


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
        with open(path, "rb") as f:
            obj = load_meta(f)
        if not isinstance(obj, dict):
            return obj  # None, or refused by the caller
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
                    out[key] = read_storage(f, value, self.path)
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
    return next(_tensors_in(value), None) is not None


def load_meta(f: IO[bytes]) -> Any:
    """The ``torch.save`` data in the binary file ``f`` loaded to the meta device, where
    every storage knows its offset in ``f`` (``read_storage`` reads it from there); None for
    data those offsets do not describe: the legacy format, big-endian data, a damaged zip."""
    try:
        with zipfile.ZipFile(f) as archive:
            order = [i for i in archive.infolist() if i.filename.endswith("/byteorder")]
            if order and stored_member(f, order[0]).strip() != b"little":
                return None
    except (zipfile.BadZipFile, ValueError):
        return None
    f.seek(0)
    return torch.load(f, map_location="meta", weights_only=True)


def read_storage(f: IO[bytes], meta: torch.Tensor, name: str) -> torch.Tensor:
    """The CPU tensor ``meta`` (from ``load_meta(f)``) describes, read from its storage's
    bytes in ``f`` (``name`` in errors)."""
    storage = meta.untyped_storage()
    nbytes = storage.nbytes()
    end = storage._checkpoint_offset + nbytes
    if end > f.seek(0, os.SEEK_END):  # checked before allocating: a damaged file
        raise CheckpointReadError(
            f"{name}: a {list(meta.shape)} {meta.dtype} tensor's storage ends at byte {end}, "
            "beyond the end of the file (a truncated or damaged file)."
        )
    whole = meta.is_contiguous() and meta.storage_offset() == 0 and meta.nbytes == nbytes
    if whole:
        out = torch.empty(meta.shape, dtype=meta.dtype)
    else:
        out = torch.empty(nbytes, dtype=torch.uint8)
    what = f"{name}: the data of a {list(meta.shape)} {meta.dtype} tensor"
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

_ALIGN = 64  # torch.save aligns each record's data so that a memory-mapped load can use it


def save_torch_streaming(
    path: str,
    keys: list[str],
    specs: dict[str, TensorSpec],
    objects: dict[str, Any],
    values: Iterable[tuple[str, torch.Tensor]],
) -> int:
    """Write ``{key: value for key in keys}`` as a ``torch.save`` file at ``path``: the
    tensors ``specs`` come from ``values`` in any order, one at a time; ``objects`` (small,
    non-tensor values, which may hold tensors) are given whole. Returns the file's size.

    ``torch.save`` under ``skip_data`` writes the structure for FakeTensors (its pickle
    names each storage's record) to a sparse skeleton; ``zipfile`` then writes the real file:
    the skeleton's small members, then each record as its tensor arrives (zipfile computes
    the CRC-32s; nothing is patched in place). torch finds records by name."""
    with FakeTensorMode():
        fakes = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in specs.items()}
    skeleton = f"{path}.skeleton"
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({k: fakes[k] if k in fakes else objects[k] for k in keys}, skeleton)
    del fakes
    try:
        layout = torch.load(skeleton, map_location="meta", weights_only=True)
        with open(skeleton, "rb") as src, zipfile.ZipFile(src) as archive:
            infos = {member_start(src, i): i for i in archive.infolist()}
            by_key = {k: _record(infos, layout[k]) for k in specs}
            with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as out:
                # data.pkl first: torch names the archive by it. No ``.format_version``: it
                # tells torch.load the records lie as miniz writes them (in order, with data
                # descriptors), so torch would compute their offsets instead of reading them.
                for info in infos.values():
                    if "/data/" not in info.filename and not info.filename.endswith(
                        "/.format_version"
                    ):
                        out.writestr(info.filename, stored_member(src, info))
                # Tensors inside non-tensor values (rare: a list of tensors), whole storages.
                done = set()
                for key in objects:
                    pairs = zip(_tensors_in(objects[key]), _tensors_in(layout[key]), strict=True)
                    for real, meta in pairs:
                        if (name := _record(infos, meta)) not in done:
                            done.add(name)
                            storage = real.detach().cpu().untyped_storage()
                            _write(out, name, torch.empty(0, dtype=torch.uint8).set_(storage))
                for key, value in values:
                    tensor = check_streamed(key, value, specs[key]).contiguous()
                    del value
                    _write(out, by_key.pop(key), tensor)
                    del tensor
                if by_key:
                    raise RuntimeError(f"internal: {sorted(by_key)[:3]} planned but not streamed")
    finally:
        os.remove(skeleton)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return os.path.getsize(path)


def _record(infos: dict[int, zipfile.ZipInfo], meta: torch.Tensor) -> str:
    """The name of the record holding ``meta``'s storage (by the offset torch reports)."""
    offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    if offset not in infos:
        raise RuntimeError(
            f"torch {torch.__version__} does not report storage offsets when loading to the "
            "meta device; streaming torch.save output needs torch >= 2.9."
        )
    return infos[offset].filename


def _aligned(out: zipfile.ZipFile, name: str, size: int) -> zipfile.ZipInfo:
    """A ``ZipInfo`` whose data will start at a multiple of ``_ALIGN`` (padding in its extra
    field, as torch's writer pads)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.file_size = size
    header = 30 + len(name.encode()) + 4 + (20 if size * 1.05 > zipfile.ZIP64_LIMIT else 0)
    pad = -(out.fp.tell() + header) % _ALIGN
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad
    return info


def _write(out: zipfile.ZipFile, name: str, tensor: torch.Tensor) -> None:
    with out.open(_aligned(out, name, tensor.nbytes), "w") as f:
        if tensor.numel():
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)
