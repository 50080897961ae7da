"""``titan-ckpt convert``: between DCP, torch.save, safetensors and Hugging Face folders.

Tensors stream from the source a bounded batch at a time into every writer, so a conversion
holds about one largest tensor whatever the checkpoint's size. HF conversion goes through a
registered ``StateDictAdapter`` built from the model record a titan step carries, a flavor,
or a ``config.json``; to HF the adapter checks them against the tensor shapes before
anything is written. The output goes to a temporary sibling renamed into place at the end,
so a failed conversion leaves nothing behind. Errors name ``options.<field>``; the command
shows them as its flags.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from titan_ckpt.adapter import (
    from_hf_items,
    load_state_dict_adapter,
    plan_items,
    streams,
    to_hf_items,
)
from titan_ckpt.commands import open_source
from titan_ckpt.errors import CheckpointConfigError
from titan_ckpt.formats.base import Source, TensorSpec, batches, dtype_name, group_of, select_keys
from titan_ckpt.formats.dcp import save_dcp_streaming, unwrap_read_errors
from titan_ckpt.formats.safetensors import encode_object, write_safetensors_shards
from titan_ckpt.formats.torch_save import save_torch_streaming
from titan_ckpt.layout import MODEL_RECORD, Manifest, commit_step, json_metadata, read_manifest
from titan_ckpt.storage import LocalStorage

__all__ = ["ConvertOptions", "convert", "read_hf_config"]

TARGETS = ("dcp", "torch", "safetensors", "hf")
ROPE_SCALINGS = ("none", "llama3")


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
    hf_config: str | None = None
    """A Hugging Face ``config.json`` describing the model instead of a flavor (for shapes no
    flavor has): the adapter is built from it, for either direction."""
    rope_scaling: str | None = None
    """RoPE of the written HF ``config.json`` (``none`` or ``llama3``) for a checkpoint that
    does not record its model args; ``None``: the recorded args', else the flavor's."""
    max_shard_size: int = 5 << 30
    """Largest safetensors file; more goes into numbered shards with an index json."""
    overwrite: bool = False
    """Replace an existing non-empty DST."""
    on_progress: Callable[[int, int], None] | None = None
    """Called with (tensor bytes done, total) after each tensor, and once more at the end."""
    on_note: Callable[[str], None] | None = None
    """Called with a note about an assumption made (e.g. the RoPE of the written
    config.json); None: a ``UserWarning``."""
    trust_pickles: bool = False
    """Unpickle a DCP SRC's metadata and records without the allowlist (see
    ``titan_ckpt.formats.pickles``)."""


def convert(src: str, dst: str, options: ConvertOptions) -> dict[str, Any]:
    """Convert ``src`` into ``dst``; returns a summary (keys, bytes, seconds)."""
    if options.to not in TARGETS:
        raise CheckpointConfigError(
            f"options.to={options.to!r}: choose one of {', '.join(TARGETS)}."
        )
    if options.rope_scaling is not None and options.to != "hf":
        raise CheckpointConfigError(
            "options.rope_scaling sets the RoPE of the written config.json; it needs "
            f"options.to='hf', not options.to={options.to!r}."
        )
    if options.rope_scaling not in (None, *ROPE_SCALINGS):
        raise CheckpointConfigError(
            f"options.rope_scaling={options.rope_scaling!r}: choose one of "
            f"{', '.join(ROPE_SCALINGS)}."
        )
    if options.flavor is not None and options.hf_config is not None:
        raise CheckpointConfigError(
            "Give options.flavor or options.hf_config, not both: each describes the model."
        )
    if options.to == "torch" and dst.endswith("/"):
        raise CheckpointConfigError(
            f"options.to='torch' writes one file; {dst!r} names a directory."
        )
    _check_destination(dst, options.overwrite)
    started = time.perf_counter()
    source = open_source(src, trust_pickles=options.trust_pickles)
    adapter = _adapter(source, options)
    keys = _selected(source, options, hf_model=adapter is not None)
    if not keys:
        raise CheckpointConfigError(
            f"No keys of {src} are left after options.model_only/options.include/options.exclude."
        )
    parent = os.path.dirname(os.path.abspath(dst))
    made = _make_dirs(parent)
    try:
        written = _write_beside(source, keys, dst, parent, options, adapter)
    except BaseException:
        for directory in made:  # ours, innermost first; left if not empty
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    return {
        "src": src,
        "dst": dst,
        "to": options.to,
        "keys": len(keys),
        "bytes": written,
        "seconds": round(time.perf_counter() - started, 3),
    }


def _make_dirs(directory: str) -> list[str]:
    """Create ``directory`` and its missing parents; returns those created, innermost first."""
    missing = []
    parent = directory
    while not os.path.isdir(parent) and parent != os.path.dirname(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    os.makedirs(directory, exist_ok=True)
    return missing


def _write_beside(
    source: Source, keys: list[str], dst: str, parent: str, options: ConvertOptions, adapter: Any
) -> int:
    """Write into a temporary sibling of ``dst`` in ``parent``, then rename it into place."""
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
    return written


def _check_destination(dst: str, overwrite: bool) -> None:
    if overwrite or not os.path.exists(dst) or (os.path.isdir(dst) and not os.listdir(dst)):
        return
    raise CheckpointConfigError(
        f"{dst} exists and is not empty; pass options.overwrite=True to replace it."
    )


def _replace(out: str, dst: str, overwrite: bool) -> None:
    # Rename is atomic within one filesystem; the old DST goes only once the new one is done.
    if os.path.exists(dst):
        if os.path.isdir(dst) and not os.path.islink(dst):
            if os.listdir(dst) and not overwrite:
                raise CheckpointConfigError(
                    f"{dst} appeared during the conversion; not replacing it."
                )
            shutil.rmtree(dst)
        else:
            os.remove(dst)
    os.replace(out, dst)


def _selected(source: Source, options: ConvertOptions, *, hf_model: bool) -> list[str]:
    keys = select_keys(source.entries, options.include, options.exclude)
    if options.model_only or hf_model:
        keys = [key for key in keys if group_of(key) == "model"]
    return keys


def _adapter(source: Source, options: ConvertOptions) -> Any:
    """The state-dict adapter when SRC or DST is an HF model folder and a model is named.

    To HF, the model is described by the model record of SRC's manifest (titan-train's real
    args), flavor and/or hf_config, checked against SRC's tensors by the adapter; a
    titan step with a record needs neither model nor flavor. From HF, by flavor, else
    hf_config, else SRC's config.json. A safetensors source without config.json counts as
    HF weights when flavor or hf_config says what model they are."""
    record = model_record(source) if options.to == "hf" else None
    model = options.model or (record["name"] if record and record.get("name") else None)
    if model is None:
        if options.to == "hf":
            raise CheckpointConfigError(
                "options.to='hf' needs options.model (an installed state-dict adapter, e.g. "
                "llama3) and options.flavor (e.g. debugmodel, 8B) or options.hf_config (a "
                "Hugging Face config.json) to name the Hugging Face layout and write "
                f"config.json; {source.path} records no model to take them from."
            )
        if options.flavor is not None or options.hf_config is not None:
            given = "options.flavor" if options.flavor is not None else "options.hf_config"
            raise CheckpointConfigError(f"{given} needs options.model (the adapter to use).")
        return None
    if record is not None and record.get("name") not in (None, model):
        record = None  # another model's record says nothing about this adapter's args
    described = options.flavor is not None or options.hf_config is not None
    from_hf = source.format == "hf" or (source.format == "safetensors" and described)
    if options.to != "hf" and not from_hf:
        raise CheckpointConfigError(
            f"options.model converts to or from a Hugging Face folder; {source.path} is "
            f"{source.format} and options.to={options.to!r}."
        )
    if options.to == "hf" and source.format == "hf":
        raise CheckpointConfigError(
            "SRC is already a Hugging Face folder; use options.to='safetensors' to copy."
        )
    if options.to == "hf" and not (described or record):
        raise CheckpointConfigError(
            "options.to='hf' needs options.flavor (e.g. debugmodel, 8B) or options.hf_config "
            f"(a Hugging Face config.json): {source.path} records no model args to describe "
            "the model."
        )
    where, kwargs = _descriptions(source, options, record)
    try:
        adapter = load_state_dict_adapter(model, **kwargs)
    except (ValueError, KeyError, TypeError) as error:
        # An adapter that cannot describe this model, a description that contradicts the
        # tensors, or an adapter that does not take what it was given.
        raise CheckpointConfigError(
            f"The {model!r} adapter cannot be built from {where}: {type(error).__name__}: {error}"
        ) from None
    except LookupError as error:  # no adapter of that name is installed
        raise CheckpointConfigError(str(error)) from None
    if options.to == "hf" and record is None and options.rope_scaling is None:
        _note_rope_assumption(source, options, adapter)
    return adapter


def _descriptions(
    source: Source, options: ConvertOptions, record: dict[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    """How the error message names the model's descriptions, and the adapter factory's
    keywords: the recorded args, flavor (or the recorded one), hf_config or SRC's
    config.json, rope_scaling, and (to HF) SRC's model tensor shapes."""
    kwargs: dict[str, Any] = {}
    names = []
    if record is not None:
        kwargs["model_args"] = record["args"]
        names.append(f"the model args recorded in {source.path}")
    if options.flavor is not None:
        kwargs["flavor"] = options.flavor
        names.append(f"options.flavor={options.flavor!r}")
    elif options.hf_config is not None:
        kwargs["hf_config"] = read_hf_config(options.hf_config)
        names.append(options.hf_config)
    elif record is not None and record.get("flavor"):
        # Only for an adapter factory that does not take model_args (it gets this alone).
        kwargs["recorded_flavor"] = record["flavor"]
    elif options.to != "hf":
        kwargs["hf_config"] = source.info.get("config")
        names.append(f"{source.path}/config.json")
    if options.rope_scaling is not None:
        kwargs["overrides"] = {"rope_scaling": options.rope_scaling}
        names.append(f"options.rope_scaling={options.rope_scaling!r}")
    if options.to == "hf":  # every model tensor's shape, to check the description against
        kwargs["tensor_shapes"] = {
            key: tuple(entry.shape or ())
            for key, entry in source.entries.items()
            if entry.is_tensor and group_of(key) == "model"
        }
    return " and ".join(names), kwargs


def _note_rope_assumption(source: Source, options: ConvertOptions, adapter: Any) -> None:
    """Say in one line which RoPE the written config.json assumes, when nothing recorded or
    asked for says what the checkpoint was trained with."""
    config = adapter.hf_config()
    if "rope_scaling" not in config or options.hf_config is not None:
        return  # a model without RoPE settings, or the given config.json says it
    scaling = config["rope_scaling"]
    said = "null (plain RoPE)" if scaling is None else json.dumps(scaling, sort_keys=True)
    note = (
        f"{source.path} records no model args; assuming the RoPE of "
        f"options.flavor={options.flavor!r}: rope_scaling = {said} (choose with "
        "options.rope_scaling='none' or options.rope_scaling='llama3')."
    )
    if options.on_note is not None:
        options.on_note(note)
    else:
        warnings.warn(note, stacklevel=3)


def read_hf_config(path: str) -> dict[str, Any]:
    """A Hugging Face ``config.json`` as a dict; ``CheckpointConfigError`` if it is not one."""
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as error:
        raise CheckpointConfigError(
            f"options.hf_config={path!r}: {error.strerror or error}."
        ) from None
    except ValueError as error:
        raise CheckpointConfigError(f"options.hf_config={path!r} is not JSON: {error}.") from None
    if not isinstance(config, dict):
        raise CheckpointConfigError(
            f"options.hf_config={path!r} holds a {type(config).__name__}, not an object."
        )
    return config


# --- streaming -----------------------------------------------------------------------------


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _stream(source: Source, keys: list[str], options: ConvertOptions):
    """(key, value) in ``keys`` order, reading a batch of about the largest tensor at a time."""
    total = max(sum(source.entries[k].nbytes for k in keys if source.entries[k].is_tensor), 1)
    report = options.on_progress or (lambda done, total: None)
    done = 0
    budget = max(max((source.entries[k].nbytes for k in keys), default=0), 1)
    try:
        for group in batches(source, keys, budget):
            values = source.read(group)
            for key in group:
                value = values.pop(key)
                yield key, _cast(value, options.dtype)
                if isinstance(value, torch.Tensor):
                    done += source.entries[key].nbytes
                    report(done, total)
                del value
    finally:
        report(total, total)


def _spec(source: Source, key: str, dtype: torch.dtype | None) -> TensorSpec:
    """The (shape, dtype) ``key`` is written with: floating-point tensors cast to ``dtype``."""
    entry = source.entries[key]
    assert entry.dtype is not None
    cast = dtype is not None and entry.dtype.is_floating_point
    return entry.shape or (), dtype if cast else entry.dtype


def _model_specs(
    source: Source, keys: list[str], options: ConvertOptions
) -> list[tuple[str, TensorSpec]]:
    """(key, (shape, dtype)) of the model tensors an HF conversion reads, in stream order."""
    others = [k for k in keys if not source.entries[k].is_tensor]
    if others:
        raise CheckpointConfigError(
            f"{source.path} holds non-tensor model entries {others[:3]}, which a Hugging Face "
            "model has no place for; drop them with options.exclude."
        )
    return [(k, _spec(source, k, options.dtype)) for k in keys]


def _plan(
    convert: Any, source: Source, keys: list[str], options: ConvertOptions
) -> dict[str, TensorSpec]:
    """The output layout of a streaming adapter, from a run over tensors without data."""
    try:
        return plan_items(convert, _model_specs(source, keys, options))
    except (KeyError, ValueError, TypeError, RuntimeError, NotImplementedError) as error:
        raise CheckpointConfigError(
            f"The {options.model!r} adapter cannot convert {source.path}: "
            f"{type(error).__name__}: {error}"
        ) from None


def _planned(
    source: Source, keys: list[str], options: ConvertOptions, adapter: Any
) -> tuple[dict[str, TensorSpec], dict[str, Any], Iterator[tuple[str, Any]]]:
    """What a writer needs: every tensor's (shape, dtype) up front, the non-tensor values
    (small), and the tensors as a bounded stream. Through ``adapter`` when given (to HF, or
    from HF), whose output is tensors only; an adapter that does not stream converts the
    whole dict at once (the model is held once)."""
    if adapter is not None:
        convert = partial(to_hf_items if options.to == "hf" else from_hf_items, adapter)
        if streams(adapter):
            specs = _plan(convert, source, keys, options)
            return specs, {}, convert(_stream(source, keys, options))
        _model_specs(source, keys, options)  # refuses non-tensor model entries
        whole = dict(convert(_stream(source, keys, options)))
        return {k: (tuple(v.shape), v.dtype) for k, v in whole.items()}, {}, iter(whole.items())
    object_keys = [k for k in keys if not source.entries[k].is_tensor]
    objects = source.read(object_keys) if object_keys else {}
    tensor_keys = [k for k in keys if source.entries[k].is_tensor]
    specs = {k: _spec(source, k, options.dtype) for k in tensor_keys}
    return specs, objects, _stream(source, tensor_keys, options)


# --- writers -------------------------------------------------------------------------------


def _write_safetensors(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    # From an HF folder with options.model: the adapter's native keys, as --to dcp/torch.
    specs, objects, values = _planned(source, keys, options, adapter)
    return write_safetensors_shards(
        out,
        specs,
        values,
        max_shard_size=options.max_shard_size,
        objects={k: encode_object(v) for k, v in objects.items()},
        single=out if out.endswith(".safetensors") else None,
    )


def _write_hf(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    specs, _, values = _planned(source, keys, options, adapter)
    written = write_safetensors_shards(out, specs, values, max_shard_size=options.max_shard_size)
    with open(os.path.join(out, "config.json"), "w") as f:
        # From hf_config: its keys that the adapter does not set (token ids, ...) stay.
        given = read_hf_config(options.hf_config) if options.hf_config is not None else {}
        config = {**given, **adapter.hf_config()}
        if options.dtype is not None:
            config["torch_dtype"] = dtype_name(options.dtype)
        else:
            dtypes = {dtype for _, dtype in specs.values() if dtype.is_floating_point}
            if len(dtypes) == 1:
                config["torch_dtype"] = dtype_name(dtypes.pop())
        json.dump(config, f, indent=2, sort_keys=True)
    return written


def _write_dcp(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    specs, objects, values = _planned(source, keys, options, adapter)
    # The tensors stream from SRC inside dcp.save, which wraps what a read raises (a damaged
    # SRC's CheckpointReadError) in its CheckpointException: raise the error itself, as the
    # other writers do.
    with unwrap_read_errors():
        written = save_dcp_streaming(out, specs, objects, values)
    step, metadata = 0, {}
    if source.format == "dcp":
        previous = read_manifest(LocalStorage(), source.path)
        step = previous.step if previous else 0
        metadata = previous.metadata if previous else {}  # e.g. the model record
    elif adapter is not None and options.model is not None:  # from HF: the model it describes
        record = adapter_record(adapter, options.model, options.flavor)
        metadata = {MODEL_RECORD: record} if record else {}
    groups = sorted({group_of(k) for k in [*specs, *objects]})
    manifest = Manifest(
        step=step,
        world_size=1,
        states=groups,
        model_only=groups == ["model"],
        metadata=metadata,
    )
    commit_step(LocalStorage(), out, manifest)
    return written


def _write_torch(
    source: Source, keys: list[str], out: str, options: ConvertOptions, adapter: Any
) -> int:
    specs, objects, values = _planned(source, keys, options, adapter)
    order = list(specs) + list(objects) if adapter is not None else keys
    return save_torch_streaming(out, order, specs, objects, values)


_WRITERS = {
    "safetensors": _write_safetensors,
    "hf": _write_hf,
    "dcp": _write_dcp,
    "torch": _write_torch,
}


def model_record(source: Source) -> dict[str, Any] | None:
    """The model record of a titan DCP step (``{"name", "flavor", "args"}``), or ``None``
    when the source is no committed titan step or records no model (an older titan,
    torchtitan, a plain DCP directory, safetensors, torch.save)."""
    if source.format != "dcp":
        return None
    try:
        manifest = read_manifest(LocalStorage(), source.path)  # None for a torn marker
    except OSError:  # an unreadable marker: as if none were recorded
        return None
    record = manifest.metadata.get(MODEL_RECORD) if manifest is not None else None
    if not isinstance(record, dict) or not isinstance(record.get("args"), dict):
        return None
    return record


def adapter_record(adapter: Any, name: str, flavor: str | None) -> dict[str, Any] | None:
    """The model record of a checkpoint converted from HF by ``adapter`` (registered as
    ``name``), when the adapter tells its model's args (an optional ``model_args()`` method
    returning a JSON object, e.g. as read from the HF ``config.json``); else ``None``."""
    method = getattr(adapter, "model_args", None)
    if not callable(method):
        return None
    try:
        args = json_metadata(method())
    except (TypeError, ValueError):  # not a JSON object: record nothing rather than fail
        return None
    return {"name": name, "flavor": flavor, "args": args}
