"""Writing safetensors files from a stream of tensors: one file, or Hugging Face's shards.

The header of a safetensors file (every tensor's dtype, shape and byte range) comes first,
so the writer takes every tensor's (shape, dtype) up front and the data as a stream of
``(key, tensor)`` pairs in that order; it holds one tensor at a time. Tensors go into files
of at most ``max_shard_size`` bytes (a larger tensor gets a file of its own), named as
Hugging Face names them: ``model.safetensors`` when one file holds everything, else
``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``
(``metadata.total_size`` and a ``weight_map`` from each key to its file).

Both ``titan-ckpt convert`` and the CheckpointManager's Hugging Face export write through
here, the latter through its ``Storage`` (any fsspec filesystem too).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable
from typing import IO, Any

import torch

from titan_ckpt.sources import OBJECT_PREFIX, TORCH_TO_ST
from titan_ckpt.storage import Storage

__all__ = ["INDEX_NAME", "SINGLE_NAME", "write_safetensors_shards"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ALIGN = 8  # safetensors pads its header so tensor data starts 8-byte aligned


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _sync(f: IO) -> None:
    """Flush ``f`` to disk where it is a local file (remote files sync on close)."""
    f.flush()
    # io.UnsupportedOperation (no file descriptor) is an OSError.
    with contextlib.suppress(OSError, AttributeError, ValueError):
        os.fsync(f.fileno())


def write_safetensors_shards(
    storage: Storage,
    folder: str,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    values: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int,
    objects: dict[str, str] | None = None,
    single: str | None = None,
) -> int:
    """Write the tensors ``specs`` (key -> (shape, dtype), in file order), whose data
    ``values`` yields in the same order, into ``folder`` as safetensors shards plus an index
    (or one ``model.safetensors``). ``objects`` (text) go into the first file's
    ``__metadata__``. ``single`` names one file to write everything into instead. Returns
    the tensor bytes written."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, (shape, dtype) in specs.items():
        n = _numel(shape) * dtype.itemsize
        if shards[-1] and size + n > max_shard_size and single is None:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    if len(shards) == 1:
        names = [SINGLE_NAME]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = 0
    weight_map = {}
    it = iter(values)
    for shard_index, (name, shard_keys) in enumerate(zip(names, shards, strict=True)):
        header: dict[str, Any] = {}
        offset = 0
        for key in shard_keys:
            shape, dtype = specs[key]
            n = _numel(shape) * dtype.itemsize
            header[key] = {
                "dtype": TORCH_TO_ST[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
            weight_map[key] = name
        if shard_index == 0 and objects:
            header["__metadata__"] = {f"{OBJECT_PREFIX}{k}": v for k, v in objects.items()}
        else:
            header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % _ALIGN)
        path = single or storage.join(folder, name)
        with storage.open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for key in shard_keys:
                got, value = next(it, (None, None))
                if got != key:
                    raise RuntimeError(
                        f"The tensor stream gave {got!r} where the layout planned {key!r}: a "
                        "state-dict adapter's output must not depend on tensor values."
                    )
                shape, dtype = specs[key]
                if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                    raise RuntimeError(
                        f"{key}: got {list(value.shape)} {value.dtype}, the header says "
                        f"{list(shape)} {dtype}"
                    )
                data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                written += data.numel()
                # Drop the tensor before the next one is read: the writer holds one at a time.
                del value, data
            _sync(f)
    for extra, _ in it:  # runs the stream to its end: last progress update, then its close
        raise RuntimeError(f"The tensor stream gave {extra!r}, which the layout did not plan.")
    if len(shards) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True)
        with storage.open(storage.join(folder, INDEX_NAME), "wb") as f:
            f.write(text.encode())
            _sync(f)
    return written
