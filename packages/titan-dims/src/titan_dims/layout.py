"""The arithmetic of a device-mesh layout, with no process group involved.

A ``MeshLayout`` is the recipe a ``DeviceMesh`` is built from: named dimensions (outermost
first) and flattened sub-meshes merging some of them. It answers which coordinates a rank
has and which ranks share its groups, for any world size, in microseconds; ``ParallelDims``
builds its real mesh from the same recipe, and the tests check both agree at every rank."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from titan_dims.errors import ParallelDimsError

__all__ = ["MeshLayout"]


@dataclass(frozen=True)
class MeshLayout:
    """Named mesh dimensions (outermost to innermost) and flattened sub-meshes over them.

    Ranks are laid out row-major: the last dimension varies fastest, exactly as
    ``init_device_mesh`` lays out ``torch.arange(world_size).view(sizes)``.
    """

    dim_names: tuple[str, ...]
    """Names of the mesh dimensions, outermost first."""
    dim_sizes: tuple[int, ...]
    """Size of each dimension; their product is the world size."""
    flattened: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Flattened sub-mesh name -> the dimensions it merges, in mesh order."""

    def __post_init__(self) -> None:
        if len(self.dim_names) != len(self.dim_sizes):
            raise ParallelDimsError(
                f"MeshLayout needs one size per dimension name: got names {self.dim_names} "
                f"and sizes {self.dim_sizes}."
            )
        if len(set(self.dim_names)) != len(self.dim_names):
            raise ParallelDimsError(f"MeshLayout dimension names must be unique: {self.dim_names}.")
        for name, sources in self.flattened.items():
            if name in self.dim_names:
                raise ParallelDimsError(f"Flattened sub-mesh {name!r} reuses a dimension's name.")
            unknown = [s for s in sources if s not in self.dim_names]
            if unknown or not sources:
                raise ParallelDimsError(
                    f"Flattened sub-mesh {name!r} merges {sources}, which are not all "
                    f"dimensions of this layout {self.dim_names}."
                )
            order = [self.dim_names.index(s) for s in sources]
            if order != sorted(order):
                raise ParallelDimsError(
                    f"Flattened sub-mesh {name!r} must list its dimensions in mesh order "
                    f"{self.dim_names}; got {sources}."
                )

    @property
    def world_size(self) -> int:
        """Number of ranks the layout covers."""
        return math.prod(self.dim_sizes)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name a group can be looked up by: dimensions, then flattened sub-meshes."""
        return self.dim_names + tuple(self.flattened)

    def sources(self, name: str) -> tuple[str, ...]:
        """The mesh dimensions that ``name`` (a dimension or flattened sub-mesh) spans."""
        if name in self.dim_names:
            return (name,)
        if name in self.flattened:
            return self.flattened[name]
        raise KeyError(
            f"{name!r} is neither a dimension nor a flattened sub-mesh of this layout; "
            f"known names: {', '.join(self.names) or '(none: a one-rank layout)'}."
        )

    def size(self, name: str) -> int:
        """Number of ranks in each group of ``name``."""
        return math.prod(self._size_of(d) for d in self.sources(name))

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` along every mesh dimension."""
        self._check_rank(rank)
        coords: dict[str, int] = {}
        for name, stride, size in zip(self.dim_names, self._strides, self.dim_sizes, strict=True):
            coords[name] = (rank // stride) % size
        return coords

    def local_rank(self, name: str, rank: int) -> int:
        """The position of ``rank`` inside its group of ``name`` (its rank in that group)."""
        coords = self.coordinates(rank)
        local = 0
        for dim in self.sources(name):
            local = local * self._size_of(dim) + coords[dim]
        return local

    def group(self, name: str, rank: int) -> list[int]:
        """The global ranks in ``rank``'s group of ``name``, ordered by their local rank."""
        return list(self._iter_group(name, rank))

    def _iter_group(self, name: str, rank: int) -> Iterator[int]:
        sources = self.sources(name)
        coords = self.coordinates(rank)
        strides = dict(zip(self.dim_names, self._strides, strict=True))
        base = rank - sum(coords[d] * strides[d] for d in sources)
        ranges = [range(self._size_of(d)) for d in sources]
        for combo in itertools.product(*ranges):
            yield base + sum(c * strides[d] for c, d in zip(combo, sources, strict=True))

    @property
    def _strides(self) -> tuple[int, ...]:
        strides = []
        running = 1
        for size in reversed(self.dim_sizes):
            strides.append(running)
            running *= size
        return tuple(reversed(strides))

    def _size_of(self, dim: str) -> int:
        return self.dim_sizes[self.dim_names.index(dim)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"rank {rank} is outside this layout's world of {self.world_size} ranks "
                f"(valid: 0 to {self.world_size - 1})."
            )
