"""torchft integration: replica groups that train on, heal from peers, and checkpoint once.

With a torchft ``Manager`` (or anything with its ``participating_rank()`` and
``set_state_dict_fns()``), the CheckpointManager

- registers state-dict callbacks, so a recovering replica group copies model, optimizer, LR
  scheduler and train state live from a healthy peer (the dataloader is each group's own);
- writes the shared checkpoint from one replica group only (participating rank 0);
- when ``enable_ft_dataloader_checkpoints``, has every replica group save its own dataloader
  state in ``<folder>/ft-replica-<id>/step-<N>/``, so no group replays data after a restart.

torchft itself is never imported here: the manager object is passed in.
"""

from __future__ import annotations

from typing import Any

from titan_ckpt.config import MODEL
from titan_ckpt.states import ModelState

__all__ = ["DATALOADER", "FaultTolerance"]

DATALOADER = "dataloader"


class FaultTolerance:
    """What the CheckpointManager needs from a torchft manager, and the callbacks it gives."""

    def __init__(
        self,
        ft_manager: Any,
        replica_id: str | int | None,
        *,
        model: ModelState,
        states: dict[str, Any],
        dataloader_checkpoints: bool,
    ) -> None:
        for method in ("participating_rank", "set_state_dict_fns"):
            if not callable(getattr(ft_manager, method, None)):
                raise TypeError(
                    f"ft_manager is a {type(ft_manager).__name__} without {method}(); pass a "
                    "torchft.Manager."
                )
        self.dataloader_checkpoints = dataloader_checkpoints and DATALOADER in states
        if self.dataloader_checkpoints and replica_id is None:
            raise ValueError(
                "ft_replica_id is needed with a torchft manager and a dataloader: each replica "
                "group saves its dataloader under ft-replica-<id>/. Pass the replica group's id, "
                "or set checkpoint.enable_ft_dataloader_checkpoints=false."
            )
        self.manager = ft_manager
        self.replica_id = replica_id
        self.model = model
        self.states = states
        ft_manager.set_state_dict_fns(self.load_state_dict, self.state_dict)

    def is_writer(self) -> bool:
        """Whether this replica group writes the shared checkpoint."""
        return self.manager.participating_rank() == 0

    def replica_folder(self, join: Any, folder: str) -> str:
        return join(folder, f"ft-replica-{self.replica_id}")

    def state_dict(self) -> dict[str, Any]:
        """The state a recovering peer copies: everything but the dataloader."""
        out = {MODEL: self.model.state_dict()}
        out.update({k: v.state_dict() for k, v in self.states.items() if k != DATALOADER})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.model.load_state_dict(state_dict[MODEL])
        for name, value in state_dict.items():
            if name != MODEL:
                self.states[name].load_state_dict(value)
