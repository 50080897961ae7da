"""A restricted unpickler for the pickles inside checkpoints: DCP's ``.metadata`` and records.

torch's DCP reader unpickles ``.metadata`` with plain ``pickle.load`` and every non-tensor
record (a step counter, a dataloader position) with ``torch.load(weights_only=False)``, so
whoever wrote a checkpoint can run code in whoever opens it. Here both go through
``RestrictedUnpickler``, whose ``find_class`` resolves only the globals a checkpoint needs:

- DCP's metadata types (``torch.distributed.checkpoint.metadata``, the filesystem storage info);
- ``torch.Size``, torch dtypes, layouts and memory formats, ``torch.device``, storage classes,
  and the functions ``torch.save`` rebuilds tensors with (as ``torch.load(weights_only=True)``
  allows them);
- plain containers and values (``set``, ``frozenset``, ``bytearray``, ``complex``, ``slice``,
  ``collections.OrderedDict``, ``io.BytesIO``, ``pathlib`` paths, and ``_codecs.encode`` for
  protocol-2 bytes).

The list was derived from real titan checkpoints (full state with optimizer, LR scheduler,
dataloader and train state; model-only; local and ``memory://``; ``titan-ckpt convert --to
dcp`` output): see ``tests/test_safe_pickle.py``. Any other global stops the load with one
``UnsafeCheckpointError`` naming it and the file, before it is even imported; ``find_class``
is the only way a pickle reaches a callable, so nothing outside the list runs.

Before unpickling, the bytes are walked with ``pickletools`` (which executes nothing): every
length-prefixed argument must fit in the data, and memo indices stay below the pickle's
length, so a damaged or hostile pickle cannot make the C unpickler allocate beyond a small
multiple of the file's size (it allocates a ``BINBYTES8`` body, and grows its memo to the
largest index, before reading).
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import re
import struct
import types
import zipfile
from typing import IO, Any

import torch

from titan_ckpt.errors import CheckpointReadError, UnsafeCheckpointError

__all__ = [
    "ALLOWED_GLOBALS",
    "RestrictedUnpickler",
    "check_record",
    "load_metadata",
    "refusal",
    "stored_member",
]

_DCP_METADATA_TYPES = (
    "Metadata",
    "MetadataIndex",
    "ChunkStorageMetadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "TensorProperties",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
)
_TENSOR_REBUILDERS = (
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
    "_rebuild_parameter",
    "_rebuild_parameter_with_state",
    "_rebuild_device_tensor_from_numpy",
    "_rebuild_meta_tensor_no_storage",
    "_rebuild_wrapper_subclass",
    "_rebuild_sparse_tensor",
    "_rebuild_nested_tensor",
    "_rebuild_qtensor",
)

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_TYPES]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
    + [("torch._utils", name) for name in _TENSOR_REBUILDERS]
    + [
        ("torch", "Size"),
        ("torch", "Tensor"),
        ("torch", "device"),
        ("torch.nn.parameter", "Parameter"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "bytearray"),
        ("builtins", "complex"),
        ("builtins", "slice"),
        # torchtitan's train state before 2025 held BytesIO values (DCP torch.saves them).
        ("_io", "BytesIO"),
        ("io", "BytesIO"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    ]
)
"""(module, qualname) pairs the unpickler resolves, besides torch's dtype-like constants."""

_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)
_STORAGE_CLASSES = frozenset(torch._storage_classes)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED_GLOBALS:
        return True
    # torch.float32, torch.strided, torch.contiguous_format, ...: plain values of torch, and
    # the storage classes (torch.FloatStorage) torch.save names in tensor records.
    # (vars(), not getattr: torch's module __getattr__ would import submodules.)
    value = vars(torch).get(name) if module == "torch" else None
    return isinstance(value, _TORCH_CONSTANTS) or (value is not None and value in _STORAGE_CLASSES)


class _RefusedError(Exception):
    """Internal: a global outside the allowlist; the caller adds the file's name."""

    def __init__(self, found: str) -> None:
        super().__init__(found)
        self.found = found


class RestrictedUnpickler(pickle.Unpickler):
    """A ``pickle.Unpickler`` that resolves only ``ALLOWED_GLOBALS`` (and torch constants)."""

    def find_class(self, module: str, name: str) -> Any:
        if not (isinstance(module, str) and isinstance(name, str) and _allowed(module, name)):
            raise _RefusedError(f"{module}.{name}")
        return super().find_class(module, name)


def _opcode_table() -> dict[int, tuple[int, int, int]]:
    """opcode byte -> (argument size code as pickletools describes it, lines, role), where
    role is 0 plain, 1 a memo index (binary), 2 a memo index (text), 3 FRAME, 4 STOP."""
    roles = {"BINPUT": 1, "LONG_BINPUT": 1, "BINGET": 1, "LONG_BINGET": 1, "PUT": 2, "GET": 2}
    roles.update(FRAME=3, STOP=4)
    table = {}
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg is not None else 0
        lines = 2 if op.arg is not None and op.arg.name.endswith("_pair") else 1
        table[ord(op.code)] = (n, lines, roles.get(op.name, 0))
    return table


_OPCODES = _opcode_table()
# pickletools' codes for arguments whose length is read first: 1, 4 (signed), 4 or 8 bytes.
_LENGTH_BYTES = {-2: 1, -3: 4, -4: 4, -5: 8}


def prescan(data: bytes) -> None:
    """Walk the opcodes of ``data`` to its STOP without running them; ``ValueError`` for an
    unknown opcode, an argument running past the end, or a memo index or frame larger than
    the pickle itself (see the module docstring). A lean walk: ``pickletools.genops`` would
    be about three times slower on a large ``.metadata``."""
    limit, pos, table, find = len(data), 0, _OPCODES, data.find
    while pos < limit:
        entry = table.get(data[pos])
        if entry is None:
            raise ValueError(f"byte {pos} is not a pickle opcode ({data[pos]:#04x})")
        n, lines, role = entry
        pos += 1
        if n > 0:
            if role in (1, 3) and int.from_bytes(data[pos : pos + n], "little") > limit:
                raise ValueError(f"a memo index or frame at byte {pos} exceeds the pickle")
            pos += n
        elif n == -1:  # up to a newline (GLOBAL and INST: two lines)
            for _ in range(lines):
                end = find(b"\n", pos)
                if end < 0:
                    raise ValueError(f"an argument at byte {pos} has no end of line")
                if role == 2 and int(data[pos:end] or b"0") > limit:
                    raise ValueError(f"a memo index at byte {pos} exceeds the pickle")
                pos = end + 1
        elif n < -1:  # a length, then that many bytes
            size = _LENGTH_BYTES[n]
            length = int.from_bytes(data[pos : pos + size], "little", signed=n == -3)
            if length < 0:
                raise ValueError(f"a negative length at byte {pos}")
            pos += size + length
        if pos > limit:
            raise ValueError(f"an argument runs past the end of the {limit}-byte pickle")
        if role == 4:
            return
    raise ValueError(f"the {limit}-byte pickle ends before its STOP opcode")


def load_metadata(stream: IO[bytes], file: str, *, trust: bool = False) -> Any:
    """Unpickle DCP's ``.metadata`` from ``stream`` (``file`` names it in errors).

    ``UnsafeCheckpointError`` for a global outside the allowlist (unless ``trust``);
    ``CheckpointReadError`` for bytes that are not a readable pickle.
    """
    data = stream.read()
    if trust:
        try:
            return pickle.loads(data)
        except Exception as error:
            raise _damaged(file, error) from None
    try:
        prescan(data)
        return RestrictedUnpickler(io.BytesIO(data)).load()
    except _RefusedError as refused:
        raise UnsafeCheckpointError.refused(file, refused.found) from None
    except Exception as error:  # any damage: truncation, flipped opcodes, wrong types
        raise _damaged(file, error) from None


def _damaged(file: str, error: BaseException) -> CheckpointReadError:
    return CheckpointReadError(
        f"{file} is damaged: it does not unpickle ({type(error).__name__}: {str(error)[:200]})"
    )


def _restricted_pickle_module() -> types.ModuleType:
    """A stand-in for the ``pickle`` module that ``torch.load(pickle_module=...)`` accepts:
    torch subclasses its ``Unpickler`` (so ``find_class`` stays ours) and uses its ``load``
    for the legacy format's headers."""
    module = types.ModuleType("titan_ckpt_restricted_pickle")
    module.Unpickler = RestrictedUnpickler  # type: ignore[attr-defined]
    module.load = lambda f, **kw: RestrictedUnpickler(f, **kw).load()  # type: ignore[attr-defined]
    module.__dict__["UnpicklingError"] = pickle.UnpicklingError
    return module


_RESTRICTED_PICKLE = _restricted_pickle_module()


def check_record(value: io.BytesIO, file: str) -> None:
    """Prove that the ``torch.save`` record ``value`` unpickles under the allowlist.

    DCP's default planner then loads the same bytes with ``torch.load(weights_only=False)``,
    which resolves exactly the globals checked here. ``UnsafeCheckpointError`` for another
    global, ``CheckpointReadError`` for a damaged record; ``value`` is rewound either way.
    """
    if os.getenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() in ("1", "y", "yes", "true"):
        return  # torch then loads every record with weights_only=True, its own allowlist
    start = value.tell()
    try:
        prescan_record(value)
        value.seek(start)
        torch.load(value, map_location="cpu", weights_only=False, pickle_module=_RESTRICTED_PICKLE)
    except _RefusedError as refused:
        raise UnsafeCheckpointError.refused(file, refused.found) from None
    except Exception as error:
        raise CheckpointReadError(
            f"{file} is damaged: {type(error).__name__}: {str(error)[:200]}"
        ) from None
    finally:
        value.seek(start)


def stored_member(f: IO[bytes], info: zipfile.ZipInfo) -> bytes:
    """The bytes of ``info``, an uncompressed member of the zip in ``f`` (a ``torch.save``
    file or record), read through its local header without checking its CRC-32:
    ``torch.save`` may leave it zero (``torch.serialization.set_crc32_options``; titan's DCP
    writers do, see ``titan_ckpt.formats.hashing``), where ``zipfile``'s own read refuses.
    ``ValueError`` for a compressed member or a damaged header; ``f``'s position moves."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{info.filename} is compressed; torch.save stores its members")
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"the zip header of {info.filename} is damaged")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    # A damaged directory may claim any size: check it against the bytes there before
    # reading (a read allocates what it is asked for).
    if start + info.file_size > f.seek(0, io.SEEK_END):
        raise ValueError(f"{info.filename} ends early")
    f.seek(start)
    return f.read(info.file_size)


def prescan_record(value: io.BytesIO) -> None:
    """``prescan`` the pickle inside a ``torch.save`` zip record (a legacy, non-zip record
    is scanned whole: its pickles come first)."""
    start = value.tell()
    try:
        with zipfile.ZipFile(value) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(names) != 1:
                raise ValueError(f"a torch.save record holds {len(names)} data.pkl files")
            info = archive.getinfo(names[0])
            if info.file_size > len(value.getbuffer()):
                raise ValueError("data.pkl is larger than its record")
            prescan(stored_member(value, info))
    except zipfile.BadZipFile:
        value.seek(start)
        prescan(value.read())  # the legacy format: several pickles in a row, scan the first


def refusal(file: str, error: Exception) -> UnsafeCheckpointError | None:
    """torch.load(weights_only=True)'s refusal of a global, as our error naming it."""
    found = re.search(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)", str(error))
    if isinstance(error, pickle.UnpicklingError) and found:
        return UnsafeCheckpointError.refused(file, found.group(1))
    return None
