"""The pickles inside checkpoints, unpickled once and under an allowlist.

torch's DCP reader unpickles ``.metadata`` with ``pickle.load`` and non-tensor records with
``torch.load(weights_only=False)``: whoever wrote a checkpoint could run code in whoever
opens it. Here each pickle is unpickled **once**, restricted, and that object is the one
used (checking first and letting DCP load the same bytes again is a hole: the check runs the
opcodes too, and a mutated allowlisted global changes what the second load resolves).

- Records (``load_record``): torch's weights-only unpickler plus ``RECORD_GLOBALS``.
- ``.metadata`` (``load_metadata``): a protocol-4 pickle of DCP's dataclasses, which torch's
  unpickler cannot read, so ``RestrictedUnpickler`` (Python's pure-Python unpickler with
  ``find_class`` limited to ``ALLOWED_GLOBALS`` and every opcode that changes an object
  limited to objects this load made). Hand-written: nothing in torch or the standard library
  reads that protocol with such limits.

A refused global raises ``UnsafeCheckpointError`` before anything runs; ``trust_pickles`` is
the only way to unpickle freely. ``prescan`` first walks the bytes (executing nothing) so a
hostile pickle cannot make an unpickler allocate beyond a small multiple of its size.
"""

from __future__ import annotations

import collections
import enum
import io
import pathlib
import pickle
import pickletools
import re
import struct
import zipfile
from typing import IO, Any, ClassVar

import torch

from titan_ckpt.errors import CheckpointReadError, UnsafeCheckpointError

__all__ = [
    "ALLOWED_GLOBALS",
    "RECORD_GLOBALS",
    "RestrictedUnpickler",
    "load_metadata",
    "load_record",
    "member_start",
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
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA_TYPES]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
    + [
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # how a layout pickles: a constant by name
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("builtins", "slice"),
        # StorageMeta.checkpoint_id is the path a writer was given, str or pathlib.
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
    ]
)
"""(module, qualname) pairs ``RestrictedUnpickler`` resolves for ``.metadata``, besides torch's
constants (dtypes, layouts, memory formats). Each is DCP's own metadata type or a value type
whose construction and ``__setstate__`` only store what they are given."""

_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


def _allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED_GLOBALS:
        return True
    # torch.float32, torch.strided, torch.contiguous_format: plain values of torch.
    # (vars(), not getattr: torch's module __getattr__ would import submodules.)
    return module == "torch" and isinstance(vars(torch).get(name), _TORCH_CONSTANTS)


class _RefusedError(Exception):
    """Internal: a global outside the allowlist, or a forbidden state change; the caller
    adds the file's name."""

    def __init__(self, found: str) -> None:
        super().__init__(found)
        self.found = found


class RestrictedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Python's pure-Python unpickler, limited so that a pickle can build values and nothing
    else: ``find_class`` resolves only ``ALLOWED_GLOBALS`` (and torch's constants) by exact
    ``str`` names; ``BUILD`` applies only to an instance this load made by calling an allowlisted
    class (never an enum member, global, function or class); ``APPEND(S)``, ``SETITEM(S)`` and
    ``ADDITEMS`` add only to a ``list``, ``dict`` (or a fresh ``OrderedDict``) and ``set``. The C
    unpickler has no per-opcode hooks; this one is slower (8.2 s against 3.0 s for a 15 MB
    ``.metadata`` of 100,000 chunks)."""

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        # id -> object of the instances this load made (the object is held so that its id
        # cannot be reused by another object during the load).
        self._fresh: dict[int, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if not (type(module) is str and type(name) is str and _allowed(module, name)):
            raise _RefusedError(f"{module}.{name}")
        return super().find_class(module, name)

    def _made(self, cls: Any, obj: Any) -> Any:
        if isinstance(cls, type) and type(obj) is cls and not isinstance(obj, enum.Enum):
            self._fresh[id(obj)] = obj
        return obj

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        self.stack[-1] = self._made(func, func(*args))

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._made(cls, cls.__new__(cls, *args)))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._made(cls, cls.__new__(cls, *args, **kwargs)))

    def _instantiate(self, klass: Any, args: Any) -> None:  # OBJ and INST
        self.append(self._made(klass, klass(*args)))

    def _load_build(self) -> None:
        inst = self.stack[-2]  # under its state
        if self._fresh.get(id(inst)) is not inst:
            raise _RefusedError(f"a change to the state of {_describe(inst)}")
        super().load_build()

    def _target(self, allowed: tuple[type, ...], op: str) -> Any:
        target = self.stack[-1]
        if type(target) not in allowed or (
            type(target) is collections.OrderedDict and self._fresh.get(id(target)) is not target
        ):
            raise _RefusedError(f"{op} on {_describe(target)}")
        return target

    def _load_append(self) -> None:
        value = self.stack.pop()
        self._target((list,), "APPEND").append(value)

    def _load_appends(self) -> None:
        items = self.pop_mark()
        self._target((list,), "APPENDS").extend(items)

    def _load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._target((dict, collections.OrderedDict), "SETITEM")[key] = value

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._target((dict, collections.OrderedDict), "SETITEMS")
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]

    def _load_additems(self) -> None:
        items = self.pop_mark()
        self._target((set,), "ADDITEMS").update(items)

    for _op, _fn in (
        (pickle.REDUCE, _load_reduce),
        (pickle.NEWOBJ, _load_newobj),
        (pickle.NEWOBJ_EX, _load_newobj_ex),
        (pickle.BUILD, _load_build),
        (pickle.APPEND, _load_append),
        (pickle.APPENDS, _load_appends),
        (pickle.SETITEM, _load_setitem),
        (pickle.SETITEMS, _load_setitems),
        (pickle.ADDITEMS, _load_additems),
    ):
        dispatch[_op[0]] = _fn
    del _op, _fn


def _describe(obj: Any) -> str:
    kind = "class" if isinstance(obj, type) else type(obj).__name__
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    return f"{kind} {name}" if name else f"a {kind} it did not make"


_BOUNDED = frozenset({"BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET", "PUT", "GET", "FRAME"})
"""Opcodes whose argument the C unpickler allocates for (a memo index, a frame) before it
reads on: bounded here by the size of the pickle."""


def prescan(data: bytes) -> None:
    """Walk the opcodes of ``data`` to its STOP without running them; ``ValueError`` for an
    unknown opcode, an argument running past the end, or a memo index or frame larger than
    the pickle itself (see the module docstring)."""
    limit = len(data)
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name in _BOUNDED and int(arg) > limit:
                raise ValueError(f"a memo index or frame at byte {pos} exceeds the pickle")
    except ValueError as error:
        why = str(error)
        if "exhausted before seeing STOP" in why:
            why = f"the {limit}-byte pickle ends before its STOP opcode"
        elif why.endswith("unknown"):
            why = f"{why}: not a pickle opcode"
        elif "remain" in why or "not enough data" in why or "no newline" in why:
            why = f"an argument runs past the end of the {limit}-byte pickle ({why})"
        raise ValueError(why) from None


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


RECORD_GLOBALS: tuple[tuple[Any, str], ...] = (
    (frozenset, "builtins.frozenset"),
    (slice, "builtins.slice"),
    # torchtitan's train state before 2025 held BytesIO values (DCP torch.saves them).
    (io.BytesIO, "_io.BytesIO"),
    (io.BytesIO, "io.BytesIO"),
    (pathlib.Path, "pathlib.Path"),
    (pathlib.PosixPath, "pathlib.PosixPath"),
    (pathlib.WindowsPath, "pathlib.WindowsPath"),
    (pathlib.PurePosixPath, "pathlib.PurePosixPath"),
    (pathlib.PureWindowsPath, "pathlib.PureWindowsPath"),
)
"""What records may hold beyond torch's weights-only allowlist: value types whose
construction and ``__setstate__`` only store what they are given."""


def load_record(value: IO[bytes], file: str) -> Any:
    """The object of the ``torch.save`` record ``value``, unpickled once by torch's
    weights-only unpickler with ``RECORD_GLOBALS`` allowed besides torch's own list.

    ``UnsafeCheckpointError`` for anything else the pickle asks for (a global, or a state
    change torch refuses), ``CheckpointReadError`` for a damaged record.
    """
    start = value.tell()
    try:
        prescan_record(value)
        value.seek(start)
        with torch.serialization.safe_globals(list(RECORD_GLOBALS)):
            return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as error:
        raise refusal(file, error) or CheckpointReadError(
            f"{file} is damaged: {type(error).__name__}: {str(error)[:200]}"
        ) from None


def stored_member(f: IO[bytes], info: zipfile.ZipInfo) -> bytes:
    """The bytes of ``info``, an uncompressed member of the zip in ``f`` (a ``torch.save``
    file or record), read through its local header without checking its CRC-32:
    ``torch.save`` may leave it zero (``torch.serialization.set_crc32_options``; titan's DCP
    writers do, see ``titan_ckpt.formats.hashing``), where ``zipfile``'s own read refuses.
    ``ValueError`` for a compressed member or a damaged header; ``f``'s position moves."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{info.filename} is compressed; torch.save stores its members")
    start = member_start(f, info)
    # A damaged directory may claim any size: check it against the bytes there before
    # reading (a read allocates what it is asked for).
    if start + info.file_size > f.seek(0, io.SEEK_END):
        raise ValueError(f"{info.filename} ends early")
    f.seek(start)
    return f.read(info.file_size)


def member_start(f: IO[bytes], info: zipfile.ZipInfo) -> int:
    """Where the bytes of ``info``, a member of the zip in ``f``, begin (after its local
    header); ``ValueError`` for a damaged header."""
    f.seek(info.header_offset)
    local = f.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValueError(f"the zip header of {info.filename} is damaged")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len


def prescan_record(value: IO[bytes]) -> None:
    """``prescan`` the pickle inside a ``torch.save`` zip record (a legacy, non-zip record
    is scanned whole: its pickles come first)."""
    start = value.tell()
    try:
        with zipfile.ZipFile(value) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            if len(names) != 1:
                raise ValueError(f"a torch.save record holds {len(names)} data.pkl files")
            prescan(stored_member(value, archive.getinfo(names[0])))
    except zipfile.BadZipFile:
        value.seek(start)
        prescan(value.read())  # the legacy format: several pickles in a row, scan the first


_TORCH_REFUSALS = (
    # torch.load(weights_only=True)'s words -> what the pickle asked for, in ours.
    (re.compile(r"(?:Unsupported global: |unsupported )GLOBAL ([\w.]+)"), "{}"),
    (re.compile(r"Can only build .*but got <class '([\w.]+)'>"), "a change to the state of a {}"),
    (
        re.compile(r"Can only (?:append to|extend|SETITEMS? for) .*but got <class '([\w.]+)'>"),
        "a change to a {}",
    ),
    (re.compile(r"Can only create new object .*but got (.{1,80})"), "a new {}"),
    (re.compile(r"call reduce for unrecognized function (.{1,80})"), "a call of {}"),
)


def refusal(file: str, error: Exception) -> UnsafeCheckpointError | None:
    """torch.load(weights_only=True)'s refusal of a global, a call or a state change, as our
    error naming it; None for any other failure."""
    if isinstance(error, pickle.UnpicklingError):
        for pattern, found in _TORCH_REFUSALS:
            match = pattern.search(str(error))
            if match:
                return UnsafeCheckpointError.refused(file, found.format(match.group(1)))
    return None
