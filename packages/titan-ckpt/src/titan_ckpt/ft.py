"""torchft integration: replica groups that train on, heal from peers, and checkpoint once.

With a torchft ``Manager`` (or anything with its ``participating_rank()`` and
``register_state_dict_fn()``, or the older ``set_state_dict_fns()``), the CheckpointManager

- registers state-dict callbacks, so a recovering replica group copies model, optimizer, LR
  scheduler and train state live from a healthy peer (the dataloader is each group's own);
- writes the shared checkpoint from one replica group only (participating rank 0);
- when ``enable_ft_dataloader_checkpoints``, has every replica group save its own dataloader
  state in ``<folder>/ft-replica-<id>/step-<N>/``, so no group replays data after a restart.

torchft itself is never imported here: the manager object is passed in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from titan_ckpt.config import DATALOADER, MODEL
from titan_ckpt.errors import CheckpointConfigError
from titan_ckpt.layout import Manifest, read_manifest, step_dir, verify_step
from titan_ckpt.states import ModelState
from titan_ckpt.storage import Storage

__all__ = ["DATALOADER", "FaultTolerance"]

T = TypeVar("T")
FT_STATE_KEY = "titan_ckpt"
"""The key of our callbacks in torchft's recovery state (``Manager.register_state_dict_fn``)."""


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
        register = getattr(ft_manager, "register_state_dict_fn", None)
        legacy = getattr(ft_manager, "set_state_dict_fns", None)
        missing = [
            name
            for name, ok in (
                ("participating_rank", callable(getattr(ft_manager, "participating_rank", None))),
                ("register_state_dict_fn", callable(register) or callable(legacy)),
            )
            if not ok
        ]
        if missing:
            raise TypeError(
                f"ft_manager is a {type(ft_manager).__name__} without {'() or '.join(missing)}(); "
                "pass a torchft.Manager."
            )
        self.dataloader_checkpoints = dataloader_checkpoints and DATALOADER in states
        if self.dataloader_checkpoints and replica_id is None:
            raise CheckpointConfigError(
                "ft_replica_id is needed with a torchft manager and a dataloader: each replica "
                "group saves its dataloader under ft-replica-<id>/. Pass the replica group's id, "
                "or set checkpoint.enable_ft_dataloader_checkpoints=false."
            )
        self.manager = ft_manager
        self.replica_id = replica_id
        self.model = model
        self.states = states
        if callable(register):  # torchft >= 0.2; set_state_dict_fns is deprecated there
            register(FT_STATE_KEY, self.load_state_dict, self.state_dict)
        else:
            legacy(self.load_state_dict, self.state_dict)

    def is_writer(self) -> bool:
        """Whether this replica group writes the shared checkpoint."""
        return self.manager.participating_rank() == 0

    def replica_folder(self, storage: Storage, folder: str) -> str:
        """This replica group's own folder under the checkpoint folder ``folder``."""
        return storage.join(folder, f"ft-replica-{self.replica_id}")

    def save_dataloader(
        self,
        storage: Storage,
        folder: str,
        step: int,
        write: Callable[[str, dict[str, Any]], None],
    ) -> None:
        """Save this replica group's dataloader state at ``step`` in its own folder, through
        ``write(directory, state)`` (the manager's synchronous write and commit)."""
        directory = step_dir(storage, self.replica_folder(storage, folder), step)
        write(directory, {DATALOADER: self.states[DATALOADER]})

    def loads_dataloader(self, kind: str, manifest: Manifest | None, excluded: list[str]) -> bool:
        """Whether resuming a ``kind`` load of the step ``manifest`` describes restores this
        group's own dataloader state (not for model-only steps or initial loads)."""
        return (
            self.dataloader_checkpoints
            and kind == "resume"
            and manifest is not None
            and not manifest.model_only
            and DATALOADER not in excluded
        )

    def load_dataloader(
        self,
        storage: Storage,
        folder: str,
        step: int,
        *,
        checksums: bool,
        decide: Callable[[Callable[[], T]], T],
        read: Callable[[str, dict[str, Any]], None],
    ) -> None:
        """Load this replica group's dataloader state saved at ``step``: ``decide(check)``
        runs the check on the checkpointing group's rank 0 and raises its error on every
        rank; ``read(directory, state)`` loads through DCP on every rank."""
        directory = step_dir(storage, self.replica_folder(storage, folder), step)

        def check() -> None:
            manifest = read_manifest(storage, directory)
            if manifest is None:
                raise CheckpointConfigError(
                    f"Replica group {self.replica_id} has no committed dataloader checkpoint "
                    f"at step {step} ({directory}); add 'dataloader' to "
                    "checkpoint.exclude_from_loading to restart its data stream."
                )
            verify_step(storage, directory, manifest, checksums=checksums)

        decide(check)
        read(directory, {DATALOADER: self.states[DATALOADER]})

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
