"""``FTOptimizersContainer``: an ``OptimizersContainer`` driven by a torchft ``Manager``.

torchft's per-step duties live in the calls a trainer already makes: ``zero_grad`` starts the
quorum; ``clip_grad_norm_`` (or ``step``, without clipping) first averages every gradient
over the participating replica groups, in buckets of ``bucket_cap_mb`` (one all-reduce each,
all in flight, not hundreds of latency-bound small ones); ``step`` commits only when the
manager says every participant's gradients were reduced.

A recovering peer reads the optimizer state from a background thread, possibly mid-step,
when computing it could initialise empty state (``get_optimizer_state_dict`` steps with lr 0,
shifting Adam's step count) or read a half-updated lr. So the state dict is cached on the
training thread, rebuilt on first read after each committed step or load.

Buffers that must agree over the groups though no gradient carries them (an MoE layer's token
counts, which each group's after-step hook turns into bias updates) are summed over the
groups with the gradient average (``sum_over_replica_groups``); a step that does not commit
restores their local values. Needs the ``torchft`` extra."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titan_optim.container import OptimizersContainer

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["DEFAULT_BUCKET_CAP_MB", "FTOptimizersContainer", "gradient_buckets"]

DEFAULT_BUCKET_CAP_MB = 25.0
"""Bucket size of the replica-group gradient average, in MiB (DDP's default)."""


class FTOptimizersContainer:
    """Fault-tolerant wrapper over an ``OptimizersContainer`` (a ``Stateful`` too). ``state_key``
    registers the cached state with the manager (``None``: the caller does). ``bucket_cap_mb``
    caps the buckets of the replica-group average (0: one all-reduce per gradient); in flight
    the buckets hold one more copy of the gradients."""

    def __init__(
        self,
        optimizers: OptimizersContainer,
        manager: Manager,
        *,
        state_key: str | None = "optimizer",
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        if not isinstance(bucket_cap_mb, int | float) or bucket_cap_mb < 0:
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb!r} is not allowed; use a size in MiB >= 0 "
                f"(0: one all-reduce per gradient; default {DEFAULT_BUCKET_CAP_MB})."
            )
        try:
            import torchft  # noqa: F401
        except ImportError as e:
            raise ImportError(
                "FTOptimizersContainer needs torchft; install it with "
                "`pip install titan-optim[torchft]`."
            ) from e
        self.optimizers = optimizers
        self.manager = manager
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        """Bucket size of the gradient average in bytes (0: no buckets)."""
        self._cache: dict[str, Any] | None = None
        self._summed: list[Callable[[], Sequence[torch.Tensor]]] = []
        self._local: list[tuple[torch.Tensor, torch.Tensor]] = []
        """This step's summed buffers with their local values (restored without a commit)."""
        self._averaged = False
        """Whether this step's gradients were averaged over the replica groups already."""
        if state_key is not None:
            manager.register_state_dict_fn(state_key, self.load_state_dict, self.state_dict)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner container's param groups."""
        return self.optimizers.param_groups

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def sum_over_replica_groups(self, buffers: Callable[[], Sequence[torch.Tensor]]) -> None:
        """Sum the tensors ``buffers()`` returns over the participating replica groups at
        every step, in place, with the gradient average (before the commit; integer tensors
        stay exact). Without a commit (or when the inner container skips the step) they get
        their local values back, to be summed with the next step's. ``buffers`` is
        called each step, so it may return tensors a model re-created since."""
        self._summed.append(buffers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start the manager's quorum for this step, then clear gradients."""
        self.manager.start_quorum()
        self.optimizers.zero_grad(set_to_none=set_to_none)
        self._averaged = False

    @torch.no_grad()
    def average_gradients(self) -> None:
        """Average every gradient's local tensor over the participating replica groups
        (every group has the same layout, so local shards line up); once per step."""
        if self._averaged:
            return
        grads = [
            grad.to_local() if isinstance(grad, DTensor) else grad
            for part in self.optimizers.model_parts
            for param in part.parameters()
            if (grad := param.grad) is not None
        ]
        in_flight = []
        for bucket in gradient_buckets(grads, self.bucket_bytes):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                in_flight.append((self.manager.allreduce(bucket[0]), None, bucket))
            else:
                flat = torch.cat([grad.reshape(-1) for grad in bucket])
                in_flight.append((self.manager.allreduce(flat), flat, bucket))
        self._local = [(t, t.clone()) for buffers in self._summed for t in buffers()]
        summed = [self.manager.allreduce(t, reduce_op=dist.ReduceOp.SUM) for t, _ in self._local]
        for work in summed:
            work.wait()
        for work, flat, bucket in in_flight:
            work.wait()
            if flat is not None:  # the averaged values back into the gradients
                offset = 0
                for grad in bucket:
                    grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
        self._averaged = True

    def step(self) -> None:
        """Average the gradients (if clipping did not), then step only if the manager
        commits this step; the cached state is then rebuilt when next asked for (a peer's
        recovery, a checkpoint), not at every step."""
        self.average_gradients()
        stepped = False
        if self.manager.should_commit():
            skipped = self.optimizers.skipped_steps
            self.optimizers.step()
            stepped = self.optimizers.skipped_steps == skipped
            self._cache = None
        if not stepped:  # no after-step hook read the sums: the next step sums again
            for tensor, local in self._local:
                tensor.copy_(local)
        self._local = []

    def clip_grad_norm_(
        self,
        max_norm: float,
        *,
        norm_type: float = 2.0,
        pp_group: dist.ProcessGroup | DeviceMesh | None = None,
        on_nonfinite: str = "skip",
        mirrored: Collection[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Average the gradients over the replica groups, then the inner container's
        ``clip_grad_norm_``."""
        self.average_gradients()
        return self.optimizers.clip_grad_norm_(
            max_norm,
            norm_type=norm_type,
            pp_group=pp_group,
            on_nonfinite=on_nonfinite,
            mirrored=mirrored,
        )

    def state_dict(self) -> dict[str, Any]:
        """The state as of the last committed step (safe to call from any thread: torchft
        asks for it between steps, or while the next step's quorum runs, before its update).
        Built once per committed step, on the first call."""
        if self._cache is None:
            self._cache = self.optimizers.state_dict()
        return self._cache

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the inner container and refresh the cache."""
        self.optimizers.load_state_dict(state_dict)
        self._cache = self.optimizers.state_dict()


def gradient_buckets(tensors: Iterable[torch.Tensor], cap_bytes: int) -> list[list[torch.Tensor]]:
    """``tensors`` in buckets of at most ``cap_bytes`` each, in order; a bucket holds one
    device and dtype (it is flattened into one tensor), and a tensor larger than the cap
    is a bucket of its own. ``cap_bytes`` 0 puts every tensor in its own bucket."""
    buckets: list[list[torch.Tensor]] = []
    filling: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], int]] = {}
    for tensor in tensors:
        key, size = (tensor.device, tensor.dtype), tensor.numel() * tensor.element_size()
        bucket, used = filling.get(key, (None, 0))
        if bucket is None or used + size > cap_bytes:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(tensor)
        filling[key] = (bucket, used + size)
    return buckets
