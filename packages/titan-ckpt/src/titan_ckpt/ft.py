"""torchft integration: replica groups that train on, heal from peers, and checkpoint once.

With ``CheckpointManager(ft=FaultToleranceOptions(...))`` the manager registers state-dict
callbacks (a recovering group copies model, optimizer, LR scheduler and train state from a
healthy peer), writes the shared checkpoint from participating rank 0 only, and with
``dataloader_checkpoints`` saves each group's dataloader in ``<folder>/ft-replica-<id>/``.
torchft itself is never imported: the manager object is passed in.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt.config import DATALOADER, MODEL
from titan_ckpt.errors import CheckpointConfigError
from titan_ckpt.formats.dcp import unwrap_read_errors
from titan_ckpt.layout import Manifest, read_manifest, scan_steps, step_dir, verify_step
from titan_ckpt.states import ModelState
from titan_ckpt.storage import Storage

__all__ = ["DATALOADER", "FaultTolerance", "FaultToleranceOptions"]

T = TypeVar("T")
logger = logging.getLogger("titan_ckpt")
REPLICA_PREFIX = "ft-replica-"
"""Each replica group's own folder under the checkpoint folder: ``ft-replica-<id>``."""
FT_STATE_KEY = "titan_ckpt"
"""The key of our callbacks in torchft's recovery state (``Manager.register_state_dict_fn``)."""


@dataclass(frozen=True)
class FaultToleranceOptions:
    """A torchft run's checkpointing: ``CheckpointManager(..., ft=FaultToleranceOptions(...))``."""

    manager: Any
    """The replica group's ``torchft.Manager``."""
    replica_id: str | int | None = None
    """This replica group's id; names its dataloader's folder, ``ft-replica-<id>``."""
    dataloader_checkpoints: bool = True
    """Each replica group also saves its own dataloader state (when there is a
    ``dataloader`` state), so no group replays data after a restart."""


class FaultTolerance:
    """What the CheckpointManager needs from a torchft manager, and the callbacks it gives."""

    def __init__(
        self,
        options: FaultToleranceOptions,
        *,
        model: ModelState,
        states: dict[str, Any],
        before_heal: Callable[[], None] | None = None,
    ) -> None:
        ft_manager, replica_id = options.manager, options.replica_id
        needed = ("participating_rank", "register_state_dict_fn")  # torchft >= 0.2
        missing = [name for name in needed if not callable(getattr(ft_manager, name, None))]
        if missing:
            raise TypeError(
                f"FaultToleranceOptions.manager is a {type(ft_manager).__name__} without "
                f"{'() or '.join(missing)}(); pass a torchft.Manager."
            )
        self.dataloader_checkpoints = options.dataloader_checkpoints and DATALOADER in states
        if self.dataloader_checkpoints and replica_id is None:
            raise CheckpointConfigError(
                "FaultToleranceOptions.replica_id is needed with a dataloader: each replica "
                "group saves its dataloader under ft-replica-<id>/. Pass the replica group's id, "
                "or dataloader_checkpoints=False."
            )
        self.manager = ft_manager
        self.replica_id = replica_id
        # Run before a heal overwrites the tensors in place: an async save's background copy
        # may still read them (CheckpointManager.maybe_wait_for_staging).
        self._before_heal = before_heal
        self.model = model
        self.states = states
        ft_manager.register_state_dict_fn(FT_STATE_KEY, self.load_state_dict, self.state_dict)

    def is_writer(self) -> bool:
        """Whether this replica group writes the shared checkpoint."""
        return self.manager.participating_rank() == 0

    def replica_folder(self, storage: Storage, folder: str) -> str:
        """This replica group's own folder under the checkpoint folder ``folder``."""
        return storage.join(folder, f"{REPLICA_PREFIX}{self.replica_id}")

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
        trust_pickles: bool = False,
    ) -> None:
        """Load this replica group's dataloader state for a resume of ``step``, merged with the
        other groups' states of that step (the replica count may change). This group's own state
        wins: at ``step``, or its newest older one if it was down then. A key only other groups
        hold, on which they disagree, raises ``CheckpointConfigError``; a group with no state of its
        own that the others' do not fit starts its data over. ``decide`` runs the plan on rank 0."""
        own, others = decide(partial(self._plan_dataloader, storage, folder, step, checksums))
        if own is None and not others:
            logger.warning(
                "Replica group %s has no committed dataloader state at or before step %d "
                "and no other group saved one at step %d: its data starts over",
                self.replica_id,
                step,
                step,
            )
            return
        read = partial(read_entries, storage, prefix=f"{DATALOADER}.", trust_pickles=trust_pickles)
        merged = merge_dataloader_states(
            self.replica_id,
            step,
            None if own is None else read(own[1]),
            {replica: read(directory) for replica, directory in others},
        )
        try:
            self.states[DATALOADER].load_state_dict(unflatten(merged, f"{DATALOADER}."))
        except (ValueError, KeyError) as error:
            if own is not None:
                raise
            # A group that never saved (killed before its first save) finds only the other
            # groups' data shards, not its own: it starts its data over, as before it had any.
            logger.warning(
                "Replica group %s has no dataloader state of its own and the other groups' "
                "of step %d do not fit it (%s): its data starts over",
                self.replica_id,
                step,
                error,
            )

    def _plan_dataloader(
        self, storage: Storage, folder: str, step: int, checksums: bool
    ) -> tuple[tuple[int, str] | None, list[tuple[str, str]]]:
        """(this group's (step, directory) to load, or None; the other groups' directories
        of ``step``), each verified."""
        own_folder = self.replica_folder(storage, folder)
        own_steps = [s for s in scan_steps(storage, own_folder, log=False).committed if s <= step]
        own = None
        if own_steps:
            own = (max(own_steps), step_dir(storage, own_folder, max(own_steps)))
            if own[0] != step:
                logger.warning(
                    "Replica group %s has no committed dataloader state at step %d (it was "
                    "not running then): its data goes on from its own step %d",
                    self.replica_id,
                    step,
                    own[0],
                )
            manifest = read_manifest(storage, own[1])
            assert manifest is not None  # committed: found by scan_steps
            verify_step(storage, own[1], manifest, checksums=checksums)
        others = []
        for name in sorted(storage.list(folder)):
            if not name.startswith(REPLICA_PREFIX) or name == f"{REPLICA_PREFIX}{self.replica_id}":
                continue
            directory = step_dir(storage, storage.join(folder, name), step)
            if (manifest := read_manifest(storage, directory)) is not None:
                verify_step(storage, directory, manifest, checksums=checksums)
                others.append((name[len(REPLICA_PREFIX) :], directory))
        return own, others

    def state_dict(self) -> dict[str, Any]:
        """The state a recovering peer copies: everything but the dataloader."""
        out = {MODEL: self.model.state_dict()}
        out.update({k: v.state_dict() for k, v in self.states.items() if k != DATALOADER})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Heal from a peer's state: the model and every state but the dataloader, in place
        (after an async save's background copy of them, if one is running, ended)."""
        if self._before_heal is not None:
            self._before_heal()
        self.model.load_state_dict(state_dict[MODEL])
        for name, value in state_dict.items():
            if name != MODEL:
                self.states[name].load_state_dict(value)


def merge_dataloader_states(
    replica_id: str | int | None,
    step: int,
    own: dict[str, Any] | None,
    others: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """Flat dataloader entries: ``own`` (this group's), then every key only ``others`` (by
    group id) hold. Raises ``CheckpointConfigError`` when such a key differs between groups
    (no exact resume: which value would be right?)."""
    merged = dict(own or {})
    taken: dict[str, str] = {}  # key -> the group its value came from
    for replica, entries in others.items():
        for key, value in entries.items():
            if own is not None and key in own:
                continue
            if key in taken and merged[key] != value:
                raise CheckpointConfigError(
                    f"The replica groups' dataloader states of step {step} disagree on {key!r} "
                    f"(group {taken[key]}: {merged[key]!r}, group {replica}: {value!r}), and "
                    f"replica group {replica_id} has no state of its own to go by, so its data "
                    "cannot go on exactly. Resume with the replica group count the step was "
                    "saved with, or add 'dataloader' to checkpoint.exclude_from_loading to "
                    "start the data over."
                )
            merged.setdefault(key, value)
            taken.setdefault(key, replica)
    return merged


def read_entries(
    storage: Storage, directory: str, *, prefix: str, trust_pickles: bool = False
) -> dict[str, Any]:
    """The flat entries under ``prefix`` of the DCP step in ``directory``, read by this rank
    alone (small states: a replica group's dataloader)."""
    reader = storage.dcp_reader(directory, trust_pickles=trust_pickles)
    state: dict[str, Any] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(prefix):
            size = getattr(md, "size", None)  # a tensor's; other values are records
            dtype = getattr(getattr(md, "properties", None), "dtype", None)
            state[key] = 0 if size is None else torch.empty(tuple(size), dtype=dtype)
    with warnings.catch_warnings(), unwrap_read_errors(directory):
        # One process reading on its own is the intent, whatever the process group.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def unflatten(entries: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The nested state dict of the flat DCP entries under ``prefix`` (DCP joins nested
    keys with dots)."""
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if not key.startswith(prefix):
            continue
        *parents, leaf = key[len(prefix) :].split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
