"""Weights shared by the first and the last pipeline stage: tied input and output embeddings.

A pipeline puts the two ends of a tied model on different stages, each holding a copy;
:class:`TiedWeights` keeps the copies one weight: the last stage takes the first's values
after init (``sync_weights``); after each backward both get the sum of the two gradients
(``sync_grads``), the tied matrix's gradient, so equal updates keep them equal; the last
stage's copy is ``mirrored``, counted once in a global gradient norm. The two ranks exchange
local tensors point to point over the pipeline group (a rank holding both ends, as in the V
schedules, adds in place). Both ends must be sharded alike (over the vocabulary, by FSDP and
TP), so their local shards hold the same rows; shapes are checked at ``sync_weights``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from titan_models.errors import ModelConfigError

__all__ = ["TiedWeights"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _grad_as_placed(param: nn.Parameter) -> torch.Tensor:
    """The local gradient of ``param``, placed as the parameter is: an embedding's gradient
    under tensor parallel comes back unsharded (partial sums), the output projection's
    sharded, and only shards placed alike hold the same rows."""
    grad = param.grad
    if grad is None:
        raise RuntimeError("a tied weight has no gradient: call sync_grads after a backward.")
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        grad = grad.redistribute(grad.device_mesh, param.placements)
        param.grad = grad
    return _local(grad)


class TiedWeights:
    """The tied parameter pairs of this rank's pipeline stages (see the module docstring):
    ``names`` ``(on the first stage, on the last)`` per pair, this rank's stage modules
    ``parts`` (in the order of ``stage_ids``), the pipeline's ``num_stages``, the pipeline rank
    of the last stage (the first is on rank 0) and the pipeline ``pp_group``."""

    def __init__(
        self,
        names: Sequence[tuple[str, str]],
        parts: Sequence[nn.Module],
        stage_ids: Sequence[int],
        *,
        num_stages: int,
        last_stage_pp_rank: int,
        pp_group: dist.ProcessGroup,
    ) -> None:
        by_stage = dict(zip(stage_ids, parts, strict=True))
        first, last = by_stage.get(0), by_stage.get(num_stages - 1)
        self._ends = (first, last)
        self.names = list(names)
        self._group = pp_group
        pp_rank = dist.get_rank(pp_group)
        holds_one = (first is None) != (last is None)
        self._peer = (last_stage_pp_rank if pp_rank == 0 else 0) if holds_one else None

    @property
    def pairs(self) -> list[tuple[nn.Parameter | None, nn.Parameter | None]]:
        """``(first stage's, last stage's)`` parameter of each pair; ``None`` for an end this
        rank does not hold. Looked up on each call: materializing (``to_empty``) or loading
        may replace a module's parameters."""
        first, last = self._ends
        return [
            (
                first.get_parameter(first_name) if first is not None else None,
                last.get_parameter(last_name) if last is not None else None,
            )
            for first_name, last_name in self.names
        ]

    @property
    def mirrored(self) -> list[nn.Parameter]:
        """The last stage's copies on this rank: clip their gradients with the others, but
        leave them out of the global norm (the first stage counts the matrix once)."""
        return [last for _, last in self.pairs if last is not None]

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Give the last stage the first stage's values; call after initialization (a
        checkpoint holds both ends, equal). Raises ``ModelConfigError`` if the two ends are
        sharded differently."""
        for (first, last), names in zip(self.pairs, self.names, strict=True):
            if first is not None and last is not None:
                _same_shape(_local(first), _local(last), names)
                _local(last).copy_(_local(first))
            elif first is not None or last is not None:
                mine = _local(first if first is not None else last)
                shape = torch.tensor(mine.shape, dtype=torch.int64, device=mine.device)
                _same_shape(mine, self._exchange(shape).tolist(), names)
                peer = self._exchange(mine)
                if last is not None:
                    mine.copy_(peer)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Give both copies the sum of their gradients (the tied matrix's gradient); call
        once after each backward of a whole step, before clipping and the optimizer step."""
        for first, last in self.pairs:
            if first is not None and last is not None:
                a, b = _grad_as_placed(first), _grad_as_placed(last)
                total = a + b
                a.copy_(total)
                b.copy_(total)
            elif first is not None or last is not None:
                grad = _grad_as_placed(first if first is not None else last)
                grad.add_(self._exchange(grad))

    def _exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send ``tensor`` to the peer rank and return the peer's tensor of the same shape."""
        assert self._peer is not None
        received = torch.empty_like(tensor)
        sent = tensor.contiguous()
        ops = [
            dist.P2POp(dist.isend, sent, group=self._group, group_peer=self._peer),
            dist.P2POp(dist.irecv, received, group=self._group, group_peer=self._peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received


def _same_shape(mine: torch.Tensor, other: torch.Tensor | list[int], names: tuple[str, str]):
    theirs = list(other.shape) if isinstance(other, torch.Tensor) else other
    if list(mine.shape) != theirs:
        raise ModelConfigError(
            f"the tied weights {names[0]} (first pipeline stage) and {names[1]} (last stage) "
            f"hold local shards of different shapes ({list(mine.shape)} here, {theirs} on the "
            "other end): the parallel plan must shard both over the same dimension. Untie "
            "them, or use a plan that shards both alike."
        )
