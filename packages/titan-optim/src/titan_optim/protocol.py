"""``Optimizers``: what a trainer may rely on from an optimizer container. All three
containers satisfy it, with one ``clip_grad_norm_`` signature, so a trainer holds "the
optimizers" without knowing which; it is also a DCP ``Stateful``."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Optimizers"]


@runtime_checkable
class Optimizers(Protocol):
    """Several optimizers used as one: step, clear, clip, checkpoint."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every inner optimizer's param groups (read ``lr`` for logging)."""
        ...

    def step(self) -> None:
        """Step every optimizer (skipped after a non-finite clipped norm)."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient."""
        ...

    def clip_grad_norm_(
        self,
        max_norm: float,
        *,
        norm_type: float = 2.0,
        pp_group: dist.ProcessGroup | DeviceMesh | None = None,
        on_nonfinite: str = "skip",
        mirrored: Collection[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Clip all gradients by their global norm and return it (a plain tensor, equal on
        every rank); a non-finite norm skips the next ``step`` (``"skip"``) or raises.
        ``mirrored`` parameters are clipped but not counted (see ``clip_grad_norm_``)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """All optimizer state, one flat dict keyed by parameter FQN."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict from ``state_dict``, possibly saved at another layout."""
        ...
