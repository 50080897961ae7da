"""Disk space: how big a step is, how much room its folder has, and what a failed write means.

A full disk does not say so: torch's zip writer reports a short write as ``RuntimeError:
[enforce fail at inline_container.cc:...] unexpected pos`` inside DCP's
``CheckpointException``. So the cause is decided from facts: an ``ENOSPC``/``EDQUOT``
``OSError`` anywhere in the error, or a folder that (counting the partial step back) had
less room than the step needs, or is full now. A step's size is its tensors' full bytes
plus the pickled size of other values, once per key over all ranks (as DCP stores them).
"""

from __future__ import annotations

import errno
import logging
import pickle
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from titan_ckpt.errors import CheckpointWriteError, DiskFullError
from titan_ckpt.formats.dcp import _failures
from titan_ckpt.layout import committed_steps, remove_step
from titan_ckpt.preflight import local_path, nearest_existing
from titan_ckpt.storage import Storage

__all__ = ["WRITE_ERRORS", "SaveWatch", "free_bytes", "human_bytes", "state_bytes"]

logger = logging.getLogger("titan_ckpt")

WRITE_ERRORS = (OSError, CheckpointException)
"""What a failed write raises: an ``OSError`` (our own writes), or DCP's
``CheckpointException`` (a ``BaseException`` that reaches every rank). Anything else (a
collective broken by a dead rank) propagates as it is; the step stays uncommitted."""

FULL_SLACK = 1 << 20
"""Less than this free after a failed write: the filesystem is full."""


def human_bytes(n: int) -> str:
    """``n`` bytes as e.g. ``1.5 GiB (1,610,612,736 bytes)``."""
    value, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n:,} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({n:,} bytes)"


def _entry_bytes(value: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(value, torch.Tensor):  # a DTensor's numel is the full tensor's
        out[prefix] = value.numel() * value.element_size()
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _entry_bytes(item, f"{prefix}.{key}", out)
    elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        for i, item in enumerate(value):
            _entry_bytes(item, f"{prefix}.{i}", out)
    elif callable(getattr(value, "state_dict", None)):  # a Stateful: what DCP will save
        _entry_bytes(value.state_dict(), prefix, out)
    else:
        try:
            out[prefix] = len(pickle.dumps(value))
        except Exception:  # what DCP cannot pickle fails the save itself
            out[prefix] = 0


def state_bytes(
    state: Mapping[str, Any], *, distributed: bool = False, group: dist.ProcessGroup | None = None
) -> int:
    """Bytes a DCP save of ``state`` writes over all ranks (data only). With
    ``distributed`` a collective over ``group``: pipeline stages add up, replicas count once."""
    sizes: dict[str, int] = {}
    for key, value in state.items():
        _entry_bytes(value, key, sizes)
    if distributed:
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, sizes, group=group)
        for part in parts:
            for key, n in part.items():
                sizes[key] = max(n, sizes.get(key, 0))
    return sum(sizes.values())


def free_bytes(storage: Storage, path: str) -> int | None:
    """Bytes free for ``path`` (which need not exist), or None where storage cannot tell:
    the storage's own ``free_bytes(path)``, else the local filesystem's (``file://`` too)."""
    own = getattr(storage, "free_bytes", None)
    if callable(own):
        return own(path)
    local = local_path(storage, path)
    if local is None:
        return None
    try:
        return shutil.disk_usage(nearest_existing(local)).free
    except OSError:
        return None


def _errors_in(error: BaseException) -> list[BaseException]:
    """``error`` and every error inside it: causes, contexts, DCP's per-rank failures."""
    seen: list[BaseException] = []
    todo: list[Any] = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        if isinstance(e, CheckpointException):
            todo += _failures(e)
    return seen


def write_failure(
    error: BaseException,
    *,
    storage: Storage,
    directory: str,
    step: int,
    needed: int | None,
    committed: list[int],
) -> CheckpointWriteError:
    """The one error for a failed write of ``directory`` (on rank 0, after every rank
    stopped writing); removes that directory, ours and uncommitted."""
    if isinstance(error, CheckpointWriteError):
        return error
    try:
        partial = sum(
            storage.size(storage.join(directory, r)) for r in storage.walk_files(directory)
        )
    except OSError:
        partial = 0
    free_now = free_bytes(storage, directory)
    free_before = None if free_now is None else free_now + partial
    errors = _errors_in(error)
    out_of_space = any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in errors
    ) or (
        free_now is not None
        and (free_now < FULL_SLACK or (needed is not None and free_before < needed))
    )
    try:  # through remove_step: only what the save wrote goes, no link is followed
        if storage.exists(directory) and not remove_step(storage, directory):
            removed = "The partial step was not removed whole (see the warning); it is uncommitted."
        else:
            removed = "The partial step was removed."
    except Exception as e:
        removed = (
            f"The partial step could not be removed ({e}); it is uncommitted and never loaded."
        )
    if committed:
        intact = (
            f"Committed steps {committed} are intact; a rerun resumes from step {committed[-1]}."
        )
    else:
        intact = "No step of this run is committed yet; a rerun starts fresh."
    if out_of_space:
        need = "an unknown number of bytes" if needed is None else f"about {human_bytes(needed)}"
        had = "an unknown amount" if free_before is None else human_bytes(free_before)
        return DiskFullError(
            f"Checkpoint of step {step} failed: the disk is full at {directory}. The step needs "
            f"{need} and {had} was free. {removed} {intact} Free space on that filesystem, "
            "lower checkpoint.keep_latest_k, or point checkpoint.folder at a larger disk.",
            path=directory,
            needed=needed,
            free=free_before,
        )
    # The innermost error worth quoting (DCP's wrapper says only 'CheckpointException').
    cause = next((e for e in errors if not isinstance(e, CheckpointException)), error)
    return CheckpointWriteError(
        f"Checkpoint of step {step} failed while writing {directory}: "
        f"{type(cause).__name__}: {cause}. {removed} {intact}",
        path=directory,
    )


class SaveWatch:
    """One manager's watch over its saves: step sizes, free space, failed writes.

    Each kind of step (full, model-only) is measured at its first save (a collective), which
    also warns when the folder has room for fewer than two such steps (the newest stays while
    the next is written). ``settle`` is where every rank learns rank 0's verdict on a write.
    """

    def __init__(
        self,
        storage: Storage,
        folder: str,
        *,
        rank: int,
        distributed: bool,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.storage, self.folder = storage, folder
        self.rank, self.distributed, self.group = rank, distributed, group
        self.sizes: dict[str, int] = {}

    def step_bytes(self, state: Mapping[str, Any], kind: str) -> int:
        """Bytes a step of ``kind`` holding ``state`` needs (call on every rank)."""
        if self.sizes and self.rank == 0 and not self.storage.exists(self.folder):
            logger.warning(
                "Checkpoint folder %s vanished since the last save, with every step it held; "
                "the next save creates it again.",
                self.folder,
            )
        if kind not in self.sizes:
            size = self.sizes[kind] = state_bytes(
                state, distributed=self.distributed, group=self.group
            )
            free = free_bytes(self.storage, self.folder) if self.rank == 0 else None
            if free is not None and free < 2 * size:
                logger.warning(
                    "Checkpoint folder %s has %s free, and one step takes about %s: fewer than "
                    "two steps fit, so a save will fail with the disk full; free space or move "
                    "checkpoint.folder.",
                    self.folder,
                    human_bytes(free),
                    human_bytes(size),
                )
        return self.sizes[kind]

    def settle(
        self, error: BaseException | None, *, directory: str, step: int, needed: int | None
    ) -> None:
        """Raise on every rank if rank 0's ``error`` (its write or commit failed) is not None.
        A collective: every rank calls it after its part of the save, error or not."""
        final: CheckpointWriteError | None = None
        if self.rank == 0 and error is not None:
            try:  # reporting only: a folder that cannot be listed reports no steps
                committed = [s for s in committed_steps(self.storage, self.folder) if s != step]
            except Exception:
                committed = []
            final = write_failure(
                error,
                storage=self.storage,
                directory=directory,
                step=step,
                needed=needed,
                committed=committed,
            )
        if self.distributed:
            box: list[Any] = [final]
            dist.broadcast_object_list(box, group=self.group, group_src=0)
            final = box[0]
        if final is not None:
            raise final from error
