"""Layout-independent initialization: a parameter's initial values depend on the run's seed,
its name in the whole (unparallelized) model and its full shape, never on how the model is
split over ranks. One process, FSDP, TP, PP, EP and their mixes start from the same weights,
bit for bit, with no seed checkpoint.

Inside ``seeded_init(model, seed)``, :func:`normal_` and :func:`trunc_normal_` (drop-ins for
``torch.nn.init``'s, which the families' ``init_weights`` call) draw a parameter on the host
in blocks of rows (along dim 0, about 2^20 values each): block ``i`` of parameter ``name``
comes from a ``torch.Generator`` seeded by ``(seed, name, i)``. A rank draws only the blocks
its part of the parameter spans and keeps that part:

- a plain tensor (one process, or a pipeline stage without sharding) is the whole parameter;
- a DTensor (FSDP, TP, EP expert stacks, their mixes) keeps its local shard, located by
  ``compute_local_shape_and_global_offset``, the rule DCP places shards in checkpoints by;
- a pipeline stage keeps the whole model's names (``layers.3...``), so its blocks draw what
  they draw in one process. Names leave out the wrappers activation checkpointing and
  ``torch.compile`` insert.

Outside the context the two functions are ``torch.nn.init``'s, drawing from the global
generator (a model initialized alone, e.g. in tests, behaves as before).

Cost: the draws run on the host CPU whatever the device (the same values on CPU and
accelerators), at about 8 ns a value on one core of the 2-core CI machine (a 16384 x 4096
truncated normal: 0.51 s, against 0.45 s for ``torch.nn.init`` drawing in place; the Llama 3
and DeepSeek-V3 debug models initialize in the same time as before). A rank draws the rows
of each parameter its shard spans: its share under dim-0 sharding (FSDP, column-wise TP,
expert parallel), whole rows where only columns are sharded (row-wise TP without FSDP). An
8B model takes about a minute in one process, about 8 s a rank on 8 FSDP ranks. Peak extra
memory is those rows of one parameter at a time, in float32 on the host.

Why not torch's own: DTensor's random ops draw from ``OffsetBasedRNGTracker`` only on CUDA-
like devices (on CPU each rank draws its shard from its own generator), and even there the
values depend on the order and set of random ops a rank runs, which differ between pipeline
stages and between expert-parallel and plain layouts. Seeding by name removes the order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_models.errors import ModelError

__all__ = ["normal_", "parameter_name", "seeded_init", "trunc_normal_"]

BLOCK_VALUES = 1 << 20
"""About how many values one generator draws: a block is ``max(1, BLOCK_VALUES // row)``
rows of the full parameter, where ``row`` is the number of values in one dim-0 row."""

# Wrappers that activation checkpointing, torch.compile and FSDP1 insert into names.
WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")

Draw = Callable[[torch.Tensor, torch.Generator | None], object]


def parameter_name(name: str) -> str:
    """``name`` (from ``named_parameters``/``named_modules``) without the segments that
    activation checkpointing and ``torch.compile`` wrappers insert: the name in the plain
    model, which checkpoints use too."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


@dataclass(frozen=True)
class _Seeded:
    seed: int
    names: dict[int, str]
    """``id(parameter)`` -> its name in the unparallelized model."""


_ACTIVE: ContextVar[_Seeded | None] = ContextVar("titan_models_seeded_init", default=None)


@contextmanager
def seeded_init(model: nn.Module, seed: int) -> Iterator[None]:
    """Within this block, :func:`normal_` and :func:`trunc_normal_` on a parameter of
    ``model`` (a whole model, a parallelized one, or one pipeline stage) fill it by ``seed``
    and its name alone (see the module docstring). Wrap a model's ``init_weights`` call::

        with seeded_init(model, seed=0):
            model.init_weights()
    """
    names = {id(p): parameter_name(n) for n, p in model.named_parameters()}
    token = _ACTIVE.set(_Seeded(seed, names))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def normal_(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> torch.Tensor:
    """``torch.nn.init.normal_``; by seed and name inside :func:`seeded_init`."""
    return _fill(tensor, lambda t, g: nn.init.normal_(t, mean, std, generator=g))


def trunc_normal_(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0
) -> torch.Tensor:
    """``torch.nn.init.trunc_normal_`` (``a``, ``b``: absolute bounds); by seed and name
    inside :func:`seeded_init`."""
    return _fill(tensor, lambda t, g: nn.init.trunc_normal_(t, mean, std, a, b, generator=g))


@torch.no_grad()
def _fill(tensor: torch.Tensor, draw: Draw) -> torch.Tensor:
    seeded = _ACTIVE.get()
    if seeded is None:
        draw(tensor, None)
        return tensor
    name = seeded.names.get(id(tensor))
    if name is None:
        raise ModelError(
            f"a tensor of shape {list(tensor.shape)} is not a parameter of the model "
            "seeded_init was entered with: initialize only that model's parameters inside "
            "it (buffers are not drawn at random)."
        )
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if local.numel() == 0:
        return tensor  # an empty shard (uneven FSDP sharding)
    full, (shape, offset) = tuple(tensor.shape) or (1,), _local_box(tensor)
    if not shape:  # a scalar: one row of one value
        shape, offset = (1,), (0,)
    rows = _draw_rows(seeded.seed, name, full, offset[0], shape[0], draw)
    box = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
    local.copy_(rows[(slice(None), *box)].view_as(local))
    return tensor


def _local_box(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's part of ``tensor`` as (shape, offset) in the full parameter."""
    if not isinstance(tensor, DTensor):
        return tuple(tensor.shape), (0,) * tensor.dim()
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    if tuple(shape) != tuple(tensor.to_local().shape):  # a shard that is not one box
        raise ModelError(
            f"seeded_init cannot place a shard of placements {tensor.placements}: its local "
            f"shape {list(tensor.to_local().shape)} is not the box {list(shape)} torch "
            "computes for it. Initialize this model without seeded_init."
        )
    return tuple(shape), tuple(offset)


def _draw_rows(
    seed: int, name: str, full: tuple[int, ...], start: int, count: int, draw: Draw
) -> torch.Tensor:
    """Rows ``start .. start + count`` of the full parameter (shape ``full``), in float32
    on the host: the blocks they span, each drawn from its own generator."""
    row = max(1, torch.Size(full[1:]).numel())
    per_block = max(1, BLOCK_VALUES // row)
    first, end = start // per_block, -(-(start + count) // per_block)
    out = torch.empty((min(end * per_block, full[0]) - first * per_block, *full[1:]))
    for block in range(first, end):
        lo = block * per_block - first * per_block
        draw(out[lo : lo + per_block], _generator(seed, name, block))
    skip = start - first * per_block
    return out[skip : skip + count]


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    """A host generator seeded by ``(seed, name, block)`` alone (a hash: Python's ``hash``
    of a string differs between processes)."""
    digest = hashlib.sha256(f"{seed}\0{name}\0{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
