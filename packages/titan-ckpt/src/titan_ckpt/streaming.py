"""Writing a DCP checkpoint or a ``torch.save`` file one tensor at a time.

Both formats are normally written by one call that takes the whole state dict. Here the
layout comes from torch itself, planned over tensors that hold no data, and the bytes are
then written as a stream of ``(key, tensor)`` pairs arrives, so the caller holds one tensor
(or one bounded batch) at a time:

- DCP: ``dcp.save`` runs DCP's own planner over stand-in tensors (the right shape and dtype,
  one element of memory each) and a ``FileSystemWriter`` whose ``write_data`` takes each
  tensor from the stream and writes DCP's record for it (a ``torch.save`` record, as
  ``FileSystemWriter`` writes it) into one ``__0_0.distcp``; DCP's ``finish`` writes
  ``.metadata``. The result is what ``dcp.save`` writes in one process. (DCP's own writer
  keeps every tensor of a file referenced until the file is done, so it cannot stream.)
- torch.save: ``torch.save`` under ``torch.serialization.skip_data`` writes the file's
  structure for FakeTensors (pickle, alignment, records with room for the bytes, no data);
  ``torch.load(map_location="meta")`` tells each storage's offset in the file; the bytes are
  then written in place, and the zip's CRC-32 fields filled in, so the file is what
  ``torch.save`` would have written (``zipfile`` checks pass too).
"""

from __future__ import annotations

import os
import struct
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter

__all__ = ["TensorSpec", "save_dcp_streaming", "save_torch_streaming"]

TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""A tensor's shape and dtype, as known before its data is read."""


def _check(key: str, value: Any, spec: TensorSpec) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise RuntimeError(f"internal: {key} was streamed as {type(value).__name__}")
    shape, dtype = spec
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise RuntimeError(
            f"{key}: got {list(value.shape)} {value.dtype}, the layout says {list(shape)} {dtype}"
        )
    return value.detach().cpu()


# --- DCP -----------------------------------------------------------------------------------


def save_dcp_streaming(
    path: str,
    specs: dict[str, TensorSpec],
    objects: dict[str, Any],
    values: Iterable[tuple[str, torch.Tensor]],
) -> int:
    """Write a one-process DCP checkpoint into the directory ``path``: tensors ``specs``
    (shape, dtype) whose data ``values`` yields in any order, one at a time, and the
    non-tensor ``objects``. Returns the tensor bytes written."""
    import torch.distributed.checkpoint as dcp

    # One element of memory each; DCP plans from shape, dtype and layout only.
    standins: dict[str, Any] = {
        k: torch.empty((), dtype=dtype).expand(shape) for k, (shape, dtype) in specs.items()
    }
    writer = _StreamingFileSystemWriter(path, specs, iter(values))
    with warnings.catch_warnings():
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
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

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
                tensor = _check(key, value, self._specs[key])
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


# --- torch.save ----------------------------------------------------------------------------


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
    from torch._subclasses.fake_tensor import FakeTensorMode

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
            tensor = _check(key, value, specs[key]).contiguous()
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
