"""Hugging Face safetensors export and import of the model, through a ``StateDictAdapter``.

Export goes one parameter at a time: every rank gathers it (``full_tensor()``, cast to the
export dtype first); rank 0 streams the full tensors through the adapter into safetensors
shards of at most ``max_shard_size`` bytes and writes ``config.json``. Under pipeline
parallelism the lowest rank holding a parameter sends it to rank 0.

Import reads the folder lazily: each tensor is read, converted, and each rank copies its own
slice (cut on the host) into its possibly sharded parameter before the next is read. Keys and
shapes are checked against the model (all stages together) before any data is read. An
adapter without the streaming methods holds the whole model once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from titan_ckpt.adapter import (
    StateDictAdapter,
    from_hf_items,
    plan_items,
    streams,
    to_hf_items,
)
from titan_ckpt.errors import CheckpointConfigError
from titan_ckpt.formats.base import TensorSpec, dtype_name
from titan_ckpt.formats.safetensors import (
    INDEX_NAME,
    SafetensorsFiles,
    write_safetensors_shards,
)
from titan_ckpt.states import ModelState
from titan_ckpt.storage import Storage

__all__ = ["check_hf_folder", "hf_files", "load_hf", "require_safetensors", "save_hf"]

HF_CONFIG = "config.json"


def require_safetensors(what: str) -> None:
    """Raise a clear ImportError unless the optional ``safetensors`` package is installed."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{what} writes or reads safetensors files, which needs the optional dependency: "
            "pip install 'titan-ckpt[safetensors]'."
        ) from None


# --- export --------------------------------------------------------------------------------


def save_hf(
    storage: Storage,
    directory: str,
    model: ModelState,
    adapter: StateDictAdapter,
    dtype: torch.dtype,
    max_shard_size: int = 5 << 30,
    *,
    writer: bool | None = None,
) -> None:
    """Write the model as a Hugging Face folder at ``directory``: every rank gathers each
    parameter in turn, the ``writer`` rank (default: global rank 0) converts and writes
    (sharded above ``max_shard_size``)."""
    local: dict[str, torch.Tensor] = {}
    for part in model.model_parts:
        local.update(get_model_state_dict(part))
    local_specs = [
        (k, (tuple(v.shape), dtype if v.is_floating_point() else v.dtype)) for k, v in local.items()
    ]
    rank = dist.get_rank() if dist.is_initialized() else 0
    if writer is None:
        writer = rank == 0
    # Which rank sends each parameter to the writer: None where the writer holds it.
    specs, senders, writer_rank = _owners(local_specs, writer)
    planned = None
    if streams(adapter):
        # On every rank, before the first gather: a bad adapter fails everywhere at once.
        planned = plan_items(partial(to_hf_items, adapter), specs)
    # The writer receives into memory on its model's device (the backend's device).
    recv_device = next(iter(local.values())).device if local else torch.device("cpu")

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        """The full tensors, on the writer; on the other ranks, walking it does their part."""
        # Every rank walks the same keys in the same order: each full_tensor() is one
        # collective that all ranks of the parameter's mesh enter together, and each send
        # meets the writer's receive for the same key.
        for key, (shape, spec_dtype) in specs:
            value = local.get(key)
            if value is not None:
                value = value.detach()
                if value.is_floating_point():
                    value = value.to(dtype)
                if isinstance(value, DTensor):
                    value = value.full_tensor()
            sender = senders[key]
            if writer:
                if sender is not None:  # another pipeline stage's
                    value = torch.empty(shape, dtype=spec_dtype, device=recv_device)
                    dist.recv(value, src=sender)
                yield key, value.cpu()
            elif sender == rank:
                dist.send(value.contiguous(), dst=writer_rank)
            del value  # before the next gather: one full tensor at a time

    if not writer:
        for _ in gathered():
            pass
        return
    values = to_hf_items(adapter, gathered())
    if planned is None:  # the whole-dict fallback: rank 0 holds the model once
        hf = dict(values)
        planned = {k: (tuple(v.shape), v.dtype) for k, v in hf.items()}
        values = iter(hf.items())
        del hf
    storage.makedirs(directory)
    write_safetensors_shards(
        directory, planned, values, max_shard_size=max_shard_size, opener=storage.open
    )
    config = adapter.hf_config()
    config["torch_dtype"] = dtype_name(dtype)
    text = json.dumps(config, indent=2, sort_keys=True).encode()
    storage.write_atomic(storage.join(directory, HF_CONFIG), text)


def _owners(
    local_specs: list[tuple[str, TensorSpec]], writer: bool
) -> tuple[list[tuple[str, TensorSpec]], dict[str, int | None], int]:
    """Every rank's parameters in one order that all ranks share (rank 0's first, then each
    further rank's new ones); for each the rank that sends it to the writer (``None`` where
    the writer holds it, else the lowest rank that does: pipeline parallelism); and the
    writer's rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local_specs, {k: None for k, _ in local_specs}, 0
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (writer, local_specs))
    writers = [rank for rank, (is_writer, _) in enumerate(everyone) if is_writer]
    if len(writers) != 1:
        raise RuntimeError(f"save_hf needs exactly one writer rank; got ranks {writers}.")
    writer_rank = writers[0]
    writer_keys = {k for k, _ in everyone[writer_rank][1]}
    specs: list[tuple[str, TensorSpec]] = []
    senders: dict[str, int | None] = {}
    for rank, (_, rank_specs) in enumerate(everyone):
        for key, spec in rank_specs:
            if key not in senders:
                specs.append((key, spec))
                senders[key] = None if key in writer_keys else rank
    return specs, senders, writer_rank


# --- import --------------------------------------------------------------------------------


def hf_files(storage: Storage, directory: str) -> SafetensorsFiles:
    """The tensors of the Hugging Face folder ``directory``, read lazily: the files its
    index names when it has one, else every ``*.safetensors`` file."""
    names = storage.list(directory)
    if INDEX_NAME in names:
        with storage.open(storage.join(directory, INDEX_NAME), "rb") as f:
            try:
                weight_map = json.loads(f.read())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as error:
                raise CheckpointConfigError(
                    f"checkpoint.initial_load_path={directory!r}: its {INDEX_NAME} is not a "
                    f"Hugging Face index ({type(error).__name__}: {error})."
                ) from None
    else:
        files = sorted(n for n in names if n.endswith(".safetensors"))
    if not files:
        raise CheckpointConfigError(
            f"checkpoint.initial_load_path={directory!r} holds no *.safetensors files; "
            "with initial_load_in_hf=true it must be a Hugging Face model folder."
        )
    return SafetensorsFiles([storage.join(directory, n) for n in files], storage.open)


def load_hf(storage: Storage, directory: str, model: ModelState, adapter: StateDictAdapter) -> None:
    """Load the model parts from the Hugging Face folder at ``directory``, one tensor at a
    time (see the module docstring)."""
    source = hf_files(storage, directory)
    targets: dict[str, torch.Tensor] = {}
    for part in model.model_parts:
        targets.update(get_model_state_dict(part))
    shapes = {k: tuple(v.shape) for k, v in targets.items()}
    # Under pipeline parallelism the other stages' parameters are in the folder too.
    model_keys = set(targets)
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sorted(targets))
        model_keys = {key for keys in everyone for key in keys}
    if streams(adapter):
        planned = plan_items(partial(from_hf_items, adapter), source.specs.items())
        _check_keys(directory, planned, shapes, model_keys)
        native = from_hf_items(adapter, source.items())
    else:  # the whole-dict fallback: every rank holds the model once
        loaded = dict(from_hf_items(adapter, source.items()))
        found = {k: (tuple(v.shape), v.dtype) for k, v in loaded.items()}
        _check_keys(directory, found, shapes, model_keys)
        native = iter(loaded.items())
        del loaded
    for key, value in native:
        if key in targets:  # else another pipeline stage's
            _copy_into(targets[key], value)
        del value  # before the next tensor is read


def check_hf_folder(
    storage: Storage,
    directory: str,
    adapter: StateDictAdapter,
    model_shapes: dict[str, tuple[int, ...]],
) -> bool:
    """Raise ``CheckpointConfigError`` unless the Hugging Face folder at ``directory``, through
    ``adapter``, has exactly the keys of ``model_shapes`` (the whole model's native names and
    shapes, e.g. from a model built on the meta device) with those shapes: the check
    :func:`load_hf` makes, run before any work. Reads the safetensors headers only (no
    tensor data). Returns False, checking nothing, for an adapter that does not stream
    (its whole-dict conversion needs the tensors)."""
    if not streams(adapter):
        return False
    source = hf_files(storage, directory)
    planned = plan_items(partial(from_hf_items, adapter), source.specs.items())
    _check_keys(directory, planned, model_shapes, set(model_shapes))
    return True


def _check_keys(
    directory: str,
    native: dict[str, TensorSpec],
    shapes: dict[str, tuple[int, ...]],
    model_keys: set[str],
) -> None:
    """Refuse a conversion ``native`` that lacks a key of this rank's ``shapes``, has one no
    rank's model holds (``model_keys``), or has another shape."""
    missing = [k for k in shapes if k not in native]
    if missing:
        raise CheckpointConfigError(
            f"The Hugging Face checkpoint in {directory} lacks model keys {missing[:5]} "
            f"(of {len(missing)}) after the adapter's conversion."
        )
    unused = sorted(set(native) - model_keys)
    if unused:
        raise CheckpointConfigError(
            f"The Hugging Face checkpoint in {directory} has keys no model part owns after "
            f"the adapter's conversion: {unused[:5]} (of {len(unused)})."
        )
    wrong = [
        f"{k}: {list(native[k][0])} in the checkpoint, {list(shape)} in the model"
        for k, shape in shapes.items()
        if tuple(native[k][0]) != tuple(shape)
    ]
    if wrong:
        raise CheckpointConfigError(
            f"The Hugging Face checkpoint in {directory} does not fit the model: "
            f"{'; '.join(wrong[:3])} (of {len(wrong)} tensors)."
        )


@torch.no_grad()
def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor ``full`` (on the host) into the model tensor
    ``target``: the part is cut where ``full`` lies and only it is copied and cast."""
    if isinstance(target, DTensor):
        target.to_local().copy_(_local_slice(full, target))
    else:
        target.copy_(full)


def _local_slice(full: torch.Tensor, target: DTensor) -> torch.Tensor:
    """The part of ``full`` this rank holds of ``target``, a view of ``full`` where it lies.

    The cut is torch's ``distribute_tensor(..., src_data_rank=None)`` (mesh dimensions in
    order, uneven shards as ``torch.chunk``, FSDP-over-TP's strided shards), without its
    first step: moving the whole tensor to the mesh's device (torch 2.13
    ``distributed/tensor/_api.py``), which put every full tensor, e.g. a 128k x 16k fp32
    embedding of 8 GB, on every rank's GPU."""
    mesh = target.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank holds none of it
        return full.new_empty(0)
    local = full
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Shard | _StridedShard):
            chunks, _ = placement._split_tensor(
                local, mesh.size(mesh_dim), with_padding=False, contiguous=False
            )
            local = chunks[coordinate[mesh_dim]]
        elif not placement.is_replicate():  # Partial: a model tensor never is
            raise CheckpointConfigError(
                f"Cannot load a Hugging Face tensor into a parameter placed as {placement} "
                "on the mesh; only Shard and Replicate placements load."
            )
    return local
