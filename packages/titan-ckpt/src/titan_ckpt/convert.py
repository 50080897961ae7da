"""``titan-ckpt convert``: between DCP, torch.save, safetensors and Hugging Face folders.

Tensors stream from the source a bounded batch at a time (about the largest tensor's bytes),
so converting to safetensors or HF holds at most about twice the largest tensor. DCP and
torch.save outputs are written by one ``dcp.save`` / ``torch.save`` call, which needs the whole
state at once: tensors from a safetensors or torch.save source are then memory-mapped views
of the source file, not copies; from a DCP source they are loaded. Model-aware HF conversion
goes through a registered ``StateDictAdapter`` (``--model``), whose methods take whole state
dicts, so the model's weights are held once in memory.

The output is written into a temporary sibling of the destination and renamed into place at
the end: a failed conversion leaves nothing behind.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from titan_ckpt.layout import Manifest, read_manifest, write_commit
from titan_ckpt.sources import (
    OBJECT_PREFIX,
    ST_DTYPES,
    TORCH_TO_ST,
    SafetensorsSource,
    Source,
    TorchSource,
    batches,
    encode_object,
    group_of,
    open_source,
)
from titan_ckpt.storage import LocalStorage

__all__ = ["ConvertError", "ConvertOptions", "convert", "parse_size"]

TARGETS = ("dcp", "torch", "safetensors", "hf")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_ALIGN = 8  # safetensors pads its header so tensor data starts 8-byte aligned


class ConvertError(ValueError):
    """A conversion that cannot be done as asked (bad usage: exit status 2)."""


@dataclass(kw_only=True)
class ConvertOptions:
    """What ``convert`` does besides reading SRC and writing DST."""

    to: str
    """Output format: dcp, torch, safetensors or hf."""
    dtype: torch.dtype | None = None
    """Cast floating-point tensors to this dtype."""
    model_only: bool = False
    """Keep only the model's keys (drop optimizer, lr_scheduler, dataloader, train_state)."""
    include: list[str] = field(default_factory=list)
    """Keep only keys matching one of these glob patterns (all keys when empty)."""
    exclude: list[str] = field(default_factory=list)
    """Drop keys matching any of these glob patterns."""
    model: str | None = None
    """State-dict adapter name for HF conversion (e.g. llama3)."""
    flavor: str | None = None
    """Model flavor the adapter needs to write HF (head counts, config.json)."""
    max_shard_size: int = 5 << 30
    """Largest safetensors file; more goes into numbered shards with an index json."""
    overwrite: bool = False
    """Replace an existing non-empty DST."""
    progress: bool | None = None
    """Show a progress line on stderr; None: only when stderr is a terminal."""


def convert(src: str, dst: str, options: ConvertOptions) -> dict[str, Any]:
    """Convert ``src`` into ``dst``; returns a summary (keys, bytes, seconds)."""
    if options.to not in TARGETS:
        raise ConvertError(f"--to {options.to!r}: choose one of {', '.join(TARGETS)}.")
    if options.to == "hf" and not (options.model and options.flavor):
        raise ConvertError(
            "--to hf needs --model (an installed state-dict adapter, e.g. llama3) and --flavor "
            "(e.g. debugmodel, 8B) to name the Hugging Face layout and write config.json."
        )
    if options.to == "torch" and dst.endswith("/"):
        raise ConvertError(f"--to torch writes one file; {dst!r} names a directory.")
    _check_destination(dst, options.overwrite)
    started = time.perf_counter()
    source = open_source(src)
    try:
        adapter = _adapter(source, options)
        keys = _selected(source, options, hf_model=adapter is not None)
        if not keys:
            raise ConvertError(f"No keys of {src} are left after --model-only/--include/--exclude.")
        parent = os.path.dirname(os.path.abspath(dst))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(dst)}.tmp-")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would carry over to DST
        try:
            single_file = options.to == "torch" or (
                options.to == "safetensors" and dst.endswith(".safetensors")
            )
            out = os.path.join(tmp, os.path.basename(dst)) if single_file else tmp
            written = _WRITERS[options.to](source, keys, out, options, adapter)
            _replace(out, dst, options.overwrite)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        source.close()
    return {
        "src": src,
        "dst": dst,
        "to": options.to,
        "keys": len(keys),
        "bytes": written,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _check_destination(dst: str, overwrite: bool) -> None:
    if not os.path.exists(dst) or overwrite:
        return
    if os.path.isdir(dst) and not os.listdir(dst):
        return
    raise ConvertError(f"{dst} exists and is not empty; pass --overwrite to replace it.")


def _replace(out: str, dst: str, overwrite: bool) -> None:
    # Rename is atomic within one filesystem; the old DST goes only once the new one is done.
    if os.path.exists(dst):
        if os.path.isdir(dst) and not os.path.islink(dst):
            if os.listdir(dst) and not overwrite:
                raise ConvertError(f"{dst} appeared during the conversion; not replacing it.")
            shutil.rmtree(dst)
        else:
            os.remove(dst)
    os.replace(out, dst)


def _selected(source: Source, options: ConvertOptions, *, hf_model: bool) -> list[str]:
    keys = []
    for key in source.entries:
        if (options.model_only or hf_model) and group_of(key) != "model":
            continue
        if options.include and not any(fnmatch.fnmatchcase(key, p) for p in options.include):
            continue
        if any(fnmatch.fnmatchcase(key, p) for p in options.exclude):
            continue
        keys.append(key)
    return keys


def _adapter(source: Source, options: ConvertOptions) -> Any:
    """The state-dict adapter when SRC or DST is an HF model folder and --model is given."""
    if options.model is None:
        if options.to == "hf" or (source.format == "hf" and options.flavor):
            raise ConvertError("--flavor needs --model (the adapter to use).")
        return None
    from titan_ckpt.adapter import load_state_dict_adapter

    if options.to != "hf" and source.format != "hf":
        raise ConvertError(
            f"--model converts to or from a Hugging Face folder; {source.path} is "
            f"{source.format} and --to is {options.to}."
        )
    if options.to == "hf" and source.format == "hf":
        raise ConvertError("SRC is already a Hugging Face folder; use --to safetensors to copy.")
    try:
        if options.flavor is not None:
            return load_state_dict_adapter(options.model, flavor=options.flavor)
        return load_state_dict_adapter(options.model, hf_config=source.info.get("config"))
    except LookupError as error:
        raise ConvertError(str(error)) from None


# --- streaming -----------------------------------------------------------------------------


class _Progress:
    def __init__(self, total_bytes: int, enabled: bool | None) -> None:
        self.total = max(total_bytes, 1)
        self.done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.started = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        if self.enabled:
            rate = self.done / max(time.perf_counter() - self.started, 1e-9) / (1 << 20)
            sys.stderr.write(
                f"\rconverting: {100 * self.done / self.total:5.1f}% "
                f"({self.done / (1 << 20):.0f}/{self.total / (1 << 20):.0f} MiB, {rate:.0f} MiB/s)"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.add(self.total - self.done)
            sys.stderr.write("\n")


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _stream(source: Source, keys: list[str], options: ConvertOptions):
    """(key, value) in ``keys`` order, reading a batch of about the largest tensor at a time."""
    tensor_bytes = sum(source.entries[k].nbytes for k in keys if source.entries[k].is_tensor)
    progress = _Progress(tensor_bytes, options.progress)
    budget = max(max((source.entries[k].nbytes for k in keys), default=0), 1)
    try:
        for group in batches(source, keys, budget):
            values = source.read(group)
            for key in group:
                value = values.pop(key)
                yield key, _cast(value, options.dtype)
                if isinstance(value, torch.Tensor):
                    progress.add(source.entries[key].nbytes)
                del value
    finally:
        progress.close()


def _out_dtype(source: Source, key: str, dtype: torch.dtype | None) -> torch.dtype:
    stored = source.entries[key].dtype
    assert stored is not None
    return dtype if dtype is not None and stored.is_floating_point else stored


# --- safetensors / HF ----------------------------------------------------------------------


def _write_safetensors(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    objects = {}
    tensor_keys = [k for k in keys if source.entries[k].is_tensor]
    object_keys = [k for k in keys if not source.entries[k].is_tensor]
    if object_keys:
        objects = {k: encode_object(v) for k, v in source.read(object_keys).items()}
    specs = {
        k: (source.entries[k].shape or (), _out_dtype(source, k, options.dtype))
        for k in tensor_keys
    }
    single = out if out.endswith(".safetensors") else None
    values = _stream(source, tensor_keys, options)
    return _write_shards(out, specs, values, objects, options.max_shard_size, single=single)


def _write_shards(
    folder: str,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    values: Any,
    objects: dict[str, str],
    max_shard_size: int,
    *,
    single: str | None = None,
) -> int:
    """Write tensors (in ``specs`` order, fed by ``values``) as safetensors shards + index."""
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
        elif shard_index == 0:
            header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % _ALIGN)
        path = single or os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for key in shard_keys:
                got, value = next(it)
                if got != key:
                    raise RuntimeError(f"internal: expected {key}, streamed {got}")
                shape, dtype = specs[key]
                if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                    raise RuntimeError(
                        f"{key}: got {list(value.shape)} {value.dtype}, the header says "
                        f"{list(shape)} {dtype}"
                    )
                data = value.detach().contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                written += data.numel()
                # Drop the tensor before the next batch is read: peak memory stays about
                # one batch (at most the largest tensor) plus DCP's one temporary per tensor.
                del value, data
            f.flush()
            os.fsync(f.fileno())
    for extra, _ in it:  # runs the stream to its end: last progress update, then its close
        raise RuntimeError(f"internal: {extra} was streamed but not in the header")
    if len(shards) > 1:
        index = {"metadata": {"total_size": written}, "weight_map": weight_map}
        with open(os.path.join(folder, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    return written


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_hf(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    native = dict(_stream(source, keys, options))
    hf = adapter.to_hf(native)
    del native
    specs = {k: (tuple(v.shape), v.dtype) for k, v in hf.items()}
    written = _write_shards(out, specs, iter(hf.items()), {}, options.max_shard_size)
    with open(os.path.join(out, "config.json"), "w") as f:
        config = dict(adapter.hf_config())
        if options.dtype is not None:
            config["torch_dtype"] = str(options.dtype).removeprefix("torch.")
        else:
            dtypes = {v.dtype for v in hf.values() if v.is_floating_point()}
            if len(dtypes) == 1:
                config["torch_dtype"] = str(dtypes.pop()).removeprefix("torch.")
        json.dump(config, f, indent=2, sort_keys=True)
    return written


# --- DCP / torch.save ----------------------------------------------------------------------


def _whole(source: Source, keys: list[str], options: ConvertOptions, adapter: Any) -> dict:
    """Every selected value at once (DCP and torch.save writers take a whole state dict)."""
    if isinstance(source, SafetensorsSource) and adapter is None:
        state = _mapped_safetensors(source, keys)
        return {k: _cast(v, options.dtype) for k, v in state.items()}
    if isinstance(source, TorchSource):  # memory-mapped already
        return {k: _cast(v, options.dtype) for k, v in source.read(keys).items()}
    state = dict(_stream(source, keys, options))
    if adapter is not None:
        state = {k: _cast(v, options.dtype) for k, v in adapter.from_hf(state).items()}
    return state


def _mapped_safetensors(source: SafetensorsSource, keys: list[str]) -> dict[str, Any]:
    """Tensors viewing the memory-mapped files (read-only pages the OS can drop), objects."""
    state: dict[str, Any] = {}
    maps: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in source.objects:
            state.update(source.read([key]))
            continue
        name, spec, start = source._where[key]
        if name not in maps:
            path = os.path.join(source.root, name)
            maps[name] = torch.from_file(
                path, shared=False, size=os.path.getsize(path), dtype=torch.uint8
            )
        begin, end = spec["data_offsets"]
        e = source.entries[key]
        flat = maps[name][start + begin : start + end]
        state[key] = flat.view(ST_DTYPES[spec["dtype"]]).reshape(e.shape or ())
    return state


def _write_dcp(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    import warnings

    import torch.distributed.checkpoint as dcp

    state = _whole(source, keys, options, adapter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in one process"
        dcp.save(state, storage_writer=LocalStorage().dcp_writer(out), no_dist=True)
    step = 0
    if source.format == "dcp":
        previous = read_manifest(LocalStorage(), source.path)
        step = previous.step if previous else 0
    groups = sorted({group_of(k) for k in state})
    manifest = Manifest(
        step=step,
        world_size=1,
        states=groups,
        model_only=groups == ["model"],
    )
    write_commit(LocalStorage(), out, manifest)
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def _write_torch(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    state = _whole(source, keys, options, adapter)
    for key, value in state.items():
        # A view of a memory-mapped safetensors file would make torch.save write the whole file.
        if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() != value.nbytes:
            state[key] = value.clone()
    torch.save(state, out)
    return os.path.getsize(out)


_WRITERS = {
    "safetensors": _write_safetensors,
    "hf": _write_hf,
    "dcp": _write_dcp,
    "torch": _write_torch,
}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB``, ``1000`` -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}  # fmt: skip
    t = text.strip().upper()
    number = t.rstrip("KMGTIB")
    unit = t[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise ConvertError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MB or 2GiB.")
    return int(value * units[unit])
