"""Build the real ``DeviceMesh`` of any world size in one process, on a fake process group:
torch's fake backend answers every collective without communicating, so the mesh and its
rank groups come out as on a real job of that size, seen from one chosen rank (131,072
ranks in about a second)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch.distributed as dist

from titan_dims.errors import ParallelDimsError
from titan_dims.parallel_dims import ParallelDims

__all__ = ["fake_process_group", "simulate"]


@contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialize a fake default process group of ``world_size`` ranks, seen from ``rank``,
    for the duration of the ``with`` block."""
    # The fake store lives in torch's test utilities; it is a plain in-memory store.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ParallelDimsError(
            f"rank {rank} is outside a world of {world_size} ranks (valid: 0 to {world_size - 1})."
        )
    if dist.is_initialized():
        raise RuntimeError(
            "A process group is already initialized in this process; simulate in a process "
            "without one (a fake group would replace the real one)."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def simulate(parallel_dims: ParallelDims, rank: int = 0) -> Iterator[ParallelDims]:
    """Yield a copy of ``parallel_dims`` whose ``world_mesh`` and sub-meshes are built on a
    fake process group, as ``rank`` would see them; they die with the ``with`` block.

    >>> with simulate(ParallelDims(world_size=4096, tp=8, pp=4), rank=9) as dims:
    ...     dims.get_mesh("tp").mesh.tolist()
    [8, 9, 10, 11, 12, 13, 14, 15]
    """
    # A fresh copy (no cached mesh) on CPU: the fake backend is registered for CPU tensors.
    copy = replace(parallel_dims, device_type="cpu")
    with fake_process_group(parallel_dims.world_size, rank):
        copy.world_mesh  # noqa: B018  (build every mesh and group now, inside the fake world)
        yield copy
