"""The safetensors format: dtype names, a checked header reader, a lazy tensor reader, the
(sharded) writer and the codec for non-tensor entries.

Hand-written rather than the ``safetensors`` package, which is optional: the commands read
and write without it, and its writer takes a whole dict where ours streams one tensor at a
time. ``read_header`` trusts nothing: the header must fit in the file, and every tensor needs
a known dtype, a shape of non-negative ints and a byte range inside the data section of
exactly its size, overlapping no other; a reader then allocates at most the file's size.
``write_safetensors_shards`` writes files of at most ``max_shard_size`` bytes, named as
Hugging Face names them (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json``).
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from titan_ckpt.errors import CheckpointReadError
from titan_ckpt.formats.base import (
    Entry,
    Source,
    TensorSpec,
    check_streamed,
    read_exactly,
    size_groups,
)
from titan_ckpt.formats.pickles import refusal

__all__ = [
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "OBJECT_PREFIX",
    "SINGLE_NAME",
    "ST_DTYPES",
    "TORCH_TO_ST",
    "SafetensorsFiles",
    "SafetensorsSource",
    "StHeader",
    "StTensor",
    "decode_object",
    "encode_object",
    "read_header",
    "write_safetensors_shards",
]

MAX_HEADER_BYTES = 100 << 20
"""The largest header read (the safetensors library's own limit)."""
OBJECT_PREFIX = "titan.object:"  # safetensors __metadata__ key of a non-tensor entry
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
Opener = Callable[[str, str], IO]
"""Opens a path in a mode: ``open``, or a ``Storage``'s ``open``."""
_ALIGN = 8  # safetensors pads its header so tensor data starts 8-byte aligned

# safetensors dtype names <-> torch dtypes (the format's own spelling).
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}


@dataclass(frozen=True)
class StTensor:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class StHeader:
    """A checked safetensors header: tensors by key (file order) and ``__metadata__``."""

    tensors: dict[str, StTensor] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    data_start: int = 8


def read_header(f: IO[bytes], file_size: int, name: str) -> StHeader:
    """Read and check the header of the safetensors file open as ``f`` (``file_size`` bytes,
    ``name`` in errors); ``CheckpointReadError`` saying what is wrong."""
    f.seek(0)
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointReadError(f"{name} is too short ({file_size} bytes) to be safetensors.")
    (n,) = struct.unpack("<Q", raw)
    if n > file_size - 8 or n > MAX_HEADER_BYTES:
        raise CheckpointReadError(
            f"{name}: its header claims {n} bytes, but the file holds {file_size} bytes (and "
            f"headers are at most {MAX_HEADER_BYTES}): a damaged or truncated safetensors file."
        )
    try:
        parsed = json.loads(f.read(n))
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise CheckpointReadError(f"{name}: the header is not JSON ({error}).") from None
    if not isinstance(parsed, dict):
        raise CheckpointReadError(f"{name}: the header is a {type(parsed).__name__}, not a map.")
    header = StHeader(data_start=8 + n)
    meta = parsed.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointReadError(f"{name}: __metadata__ is not a map of strings.")
    header.metadata = meta
    data_size = file_size - header.data_start
    for key, spec in parsed.items():
        header.tensors[key] = _tensor(name, key, spec, header.data_start, data_size)
    _check_disjoint(name, header.tensors.values())
    return header


def _tensor(name: str, key: str, spec: Any, start: int, data_size: int) -> StTensor:
    where = f"{name}: tensor {key!r}"
    if not isinstance(spec, dict):
        raise CheckpointReadError(f"{where} is described by a {type(spec).__name__}, not a map.")
    dtype = ST_DTYPES.get(spec.get("dtype")) if isinstance(spec.get("dtype"), str) else None
    if dtype is None:
        raise CheckpointReadError(
            f"{where} has dtype {spec.get('dtype')!r}; known: {', '.join(ST_DTYPES)}."
        )
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise CheckpointReadError(f"{where} has shape {shape!r}, not a list of sizes >= 0.")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_whole(o) for o in offsets)):
        raise CheckpointReadError(f"{where} has data_offsets {offsets!r}, not [begin, end].")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise CheckpointReadError(
            f"{where}: data_offsets [{begin}, {end}] lie outside the {data_size}-byte data "
            "section (a truncated or damaged file)."
        )
    numel = math.prod(shape)
    if numel * dtype.itemsize != end - begin:
        raise CheckpointReadError(
            f"{where}: a {shape} {dtype} tensor has {numel * dtype.itemsize} bytes, but its "
            f"data_offsets [{begin}, {end}] span {end - begin}."
        )
    return StTensor(key, dtype, tuple(shape), start + begin, start + end)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_disjoint(name: str, tensors: Any) -> None:
    placed = sorted((t for t in tensors if t.nbytes), key=lambda t: t.begin)
    for a, b in itertools.pairwise(placed):
        if b.begin < a.end:
            raise CheckpointReadError(
                f"{name}: the bytes of tensors {a.key!r} and {b.key!r} overlap (a damaged file)."
            )


# --- reading -------------------------------------------------------------------------------


class SafetensorsFiles:
    """The tensors of safetensors files, read lazily through ``opener`` (``open``, or a
    storage's ``open``): every header is
    read and checked first (``read_header``), the data of a key only when asked for, into
    memory of its own (not mapped: mapped pages would stay resident).

    ``tensors``: key -> (file path, checked header entry), in key order; ``metadata``: each
    file's ``__metadata__`` merged (the non-tensor entries titan writes live there).
    """

    def __init__(self, paths: Iterable[str], opener: Opener = open) -> None:
        self.opener = opener
        self.tensors: dict[str, tuple[str, StTensor]] = {}
        self.metadata: dict[str, str] = {}
        for path in paths:
            with opener(path, "rb") as f:
                header = read_header(f, f.seek(0, os.SEEK_END), path)
            self.metadata.update(header.metadata)
            for key, t in header.tensors.items():
                self.tensors[key] = (path, t)
        self.tensors = dict(sorted(self.tensors.items()))

    @property
    def specs(self) -> dict[str, TensorSpec]:
        """Every tensor's (shape, dtype), in key order."""
        return {key: (t.shape, t.dtype) for key, (_, t) in self.tensors.items()}

    def items(self, keys: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(key, tensor)`` for ``keys`` (default: all, in key order), one tensor at a time;
        each file is opened once."""
        with contextlib.ExitStack() as stack:
            opened: dict[str, Any] = {}
            for key in self.tensors if keys is None else keys:
                path, t = self.tensors[key]
                if path not in opened:
                    opened[path] = stack.enter_context(self.opener(path, "rb"))
                # read_header checked that [begin, end) is inside the file and is the
                # tensor's size, so this allocates no more than the file holds.
                tensor = torch.empty(t.shape, dtype=t.dtype)
                read_exactly(opened[path], t.begin, tensor, f"{path}: {key}")
                yield key, tensor
                del tensor


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
        self._data = SafetensorsFiles([os.path.join(self.root, n) for n in names])
        self.objects: dict[str, str] = {}
        for k, v in self._data.metadata.items():
            if k.startswith(OBJECT_PREFIX):
                self.objects[k[len(OBJECT_PREFIX) :]] = v
            else:
                self.info.setdefault("metadata", {})[k] = v
        for key, (full, t) in self._data.tensors.items():
            name = os.path.basename(full)
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
        out = {key: decode_object(self.objects[key]) for key in keys if key in self.objects}
        out.update(self._data.items([k for k in keys if k not in self.objects]))
        return {key: out[key] for key in keys}


# --- writing -------------------------------------------------------------------------------


def encode_object(value: Any) -> str:
    """A non-tensor entry as text for safetensors' ``__metadata__`` (torch.save, base64)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return base64.b64encode(buf.getvalue()).decode()


def decode_object(text: str) -> Any:
    """The value ``encode_object`` wrote (only plain values and tensors unpickle)."""
    try:
        return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    except Exception as error:
        raise refusal("a non-tensor entry in __metadata__", error) or CheckpointReadError(
            f"a non-tensor entry in __metadata__ does not load ({type(error).__name__}: "
            f"{str(error)[:200]})"
        ) from None


def _sync(f: IO) -> None:
    """Flush ``f`` to disk where it is a local file (remote files sync on close)."""
    f.flush()
    with contextlib.suppress(OSError, AttributeError, ValueError):  # no descriptor
        os.fsync(f.fileno())


def write_safetensors_shards(
    folder: str,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    values: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int,
    objects: dict[str, str] | None = None,
    single: str | None = None,
    opener: Opener = open,
) -> int:
    """Write the tensors ``specs`` (key -> (shape, dtype), in file order), whose data
    ``values`` yields in the same order, into ``folder`` as safetensors shards plus an index
    (or one ``model.safetensors``). ``objects`` (text) go into the first file's
    ``__metadata__``. ``single`` names one file to write everything into instead. Returns
    the tensor bytes written."""
    sizes = ((key, math.prod(shape) * dtype.itemsize) for key, (shape, dtype) in specs.items())
    # A new shard where one would pass max_shard_size; one file for ``single``.
    shards = list(size_groups(sizes, math.inf if single is not None else max_shard_size)) or [[]]
    if len(shards) == 1:
        names = [SINGLE_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = 0
    weight_map = {}
    it = iter(values)
    for shard_index, (name, shard_keys) in enumerate(zip(names, shards, strict=True)):
        for key in shard_keys:
            weight_map[key] = name
        raw = _shard_header(specs, shard_keys, objects if shard_index == 0 else None)
        path = single or f"{folder.rstrip('/')}/{name}"
        with opener(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            written += _write_shard_data(f, specs, shard_keys, it)
            _sync(f)
    for extra, _ in it:  # runs the stream to its end: last progress update, then its close
        raise RuntimeError(f"The tensor stream gave {extra!r}, which the layout did not plan.")
    if len(shards) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True)
        with opener(f"{folder.rstrip('/')}/{INDEX_NAME}", "wb") as f:
            f.write(text.encode())
            _sync(f)
    return written


def _shard_header(
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    shard_keys: list[str],
    objects: dict[str, str] | None,
) -> bytes:
    """One shard's JSON header, padded to the alignment; ``objects`` go into its metadata."""
    header: dict[str, Any] = {}
    offset = 0
    for key in shard_keys:
        shape, dtype = specs[key]
        n = math.prod(shape) * dtype.itemsize
        header[key] = {
            "dtype": TORCH_TO_ST[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    if objects:
        header["__metadata__"] = {f"{OBJECT_PREFIX}{k}": v for k, v in objects.items()}
    else:
        header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    return raw


def _write_shard_data(
    f: IO,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    shard_keys: list[str],
    it: Iterator[tuple[str, torch.Tensor]],
) -> int:
    """Write the shard's tensors from the stream ``it`` into ``f``, one held at a time."""
    written = 0
    for key in shard_keys:
        got, value = next(it, (None, None))
        if got != key:
            raise RuntimeError(
                f"The tensor stream gave {got!r} where the layout planned {key!r}: a "
                "state-dict adapter's output must not depend on tensor values."
            )
        data = check_streamed(key, value, specs[key]).contiguous().reshape(-1).view(torch.uint8)
        del value
        f.write(memoryview(data.numpy()))
        written += data.numel()
        del data
    return written
