"""The safetensors file format: dtype names, and one checked reader of a file's header.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the data
section. The JSON maps each tensor's name to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (offsets relative to the data section), plus an optional ``__metadata__`` of strings.

``read_header`` trusts none of it: before anything is allocated, the header must fit in the
file (a header claiming terabytes is refused without reading it), and every tensor must have a
known dtype, a shape of non-negative whole numbers, and a byte range inside the data section
whose length is shape x dtype size, not overlapping another tensor's. A reader that then
allocates ``entry.nbytes`` allocates at most the file's size. Both the command's reader
(``titan_ckpt.sources``) and the manager's Hugging Face import (``titan_ckpt.hf``) use it.
"""

from __future__ import annotations

import itertools
import json
import struct
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from titan_ckpt.read_errors import CheckpointReadError

__all__ = ["MAX_HEADER_BYTES", "ST_DTYPES", "TORCH_TO_ST", "StHeader", "StTensor", "read_header"]

MAX_HEADER_BYTES = 100 << 20
"""The largest header read (the safetensors library's own limit)."""

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
    if len(raw) != 8 or file_size < 8:
        raise CheckpointReadError(f"{name} is too short ({file_size} bytes) to be safetensors.")
    (n,) = struct.unpack("<Q", raw)
    if n > file_size - 8 or n > MAX_HEADER_BYTES:
        raise CheckpointReadError(
            f"{name}: its header claims {n} bytes, but the file holds {file_size} bytes (and "
            f"headers are at most {MAX_HEADER_BYTES}): a damaged or truncated safetensors file."
        )
    text = f.read(n)
    if len(text) != n:
        raise CheckpointReadError(f"{name}: the header ends after {len(text)} of {n} bytes.")
    try:
        parsed = json.loads(text)
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
    numel = 1
    for d in shape:
        numel *= d
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
