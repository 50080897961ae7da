"""How many tokens one training step processes, and over how many devices.

Every rank of a data-parallel group loads the same local batch, which its CP, TP and PP
ranks then split: a step's tokens are the local batch's times the data-parallel degree
(times the torchft groups taking part), spread over ``world_size`` devices per group.
Throughput per device, ``global_tokens / seconds / devices``, is torchtitan's per-rank
``local_tokens / (seconds * cp * tp * pp)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_dims import ParallelDims

__all__ = ["StepTokens", "tokens_of_step"]


@dataclass(frozen=True)
class StepTokens:
    """The tokens of one training step, all ranks and replica groups together, and the
    devices that shared the work."""

    global_tokens: int
    devices: int

    @property
    def per_device(self) -> float:
        """Tokens per device: ``global_tokens / devices``."""
        return self.global_tokens / self.devices


def tokens_of_step(local_tokens: int, dims: ParallelDims, replica_groups: int = 1) -> StepTokens:
    """The step's tokens from ``local_tokens`` (this rank's batches, before any
    context-parallel split), for layout ``dims`` and ``replica_groups`` groups taking part.

    >>> tokens_of_step(4 * 64, ParallelDims(world_size=8, dp_shard=2, tp=2, pp=2))
    StepTokens(global_tokens=512, devices=8)
    """
    # This group's own step counts even if torchft reports no participants (e.g. healing).
    replica_groups = max(replica_groups, 1)
    return StepTokens(
        global_tokens=local_tokens * dims.dp_degree * replica_groups,
        devices=dims.world_size * replica_groups,
    )
