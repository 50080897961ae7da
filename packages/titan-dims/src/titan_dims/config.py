"""``ParallelismConfig``: the parallel degrees of a run, as a config section.

Field names follow torchtitan's ``[parallelism]`` section so that its TOML files carry over.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from titan_dims.errors import check_int

__all__ = ["ParallelismConfig"]


@dataclass(kw_only=True)
class ParallelismConfig:
    """How many ways each kind of parallelism splits the world. ``-1`` shards over the rest."""

    data_parallel_replicate_degree: int = 1
    """Replicas of the model (DDP, or the replicate dimension of HSDP)."""
    data_parallel_shard_degree: int = -1
    """Ranks the parameters are sharded over (FSDP); -1 takes every rank left over."""
    context_parallel_degree: int = 1
    """Ranks a sequence is split over (context parallel)."""
    tensor_parallel_degree: int = 1
    """Ranks each layer's matrices are split over (tensor and sequence parallel)."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages the layers are split into."""
    expert_parallel_degree: int = 1
    """Ranks the experts of a mixture-of-experts layer are split over; borrowed from
    data_parallel_shard_degree x context_parallel_degree."""

    def __post_init__(self) -> None:
        for f in fields(self):
            rest = f.name == "data_parallel_shard_degree"
            check_int(
                f"parallelism.{f.name}",
                getattr(self, f.name),
                minimum=1,
                sentinel=(-1, "use the remaining ranks") if rest else None,
            )
