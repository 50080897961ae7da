"""Disk space: how big a step is, how much room its folder has, and what a failed write means.

A save that runs out of space does not say so: torch's zip writer reports a short write as
``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos``, wrapped in DCP's
``CheckpointException``. So the cause of a failed write is decided from facts, not from the
message: an ``ENOSPC``/``EDQUOT`` ``OSError`` anywhere in the error, or a folder that, once
the step's partial files are counted back, had less room than the step needs (or is full
now). The step's size comes from the state being saved: every tensor's full (unsharded)
bytes plus the pickled size of every other object, counted once per key over all ranks, as
DCP stores replicated entries once.

``write_failure`` turns any failed write into one ``CheckpointWriteError`` (a
``DiskFullError`` when space ran out) naming the path, the bytes needed and free, and the
committed steps that remain; it removes the partial step directory, which is ours and
uncommitted.
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from titan_ckpt.errors import CheckpointWriteError, DiskFullError
from titan_ckpt.layout import read_manifest, remove_step
from titan_ckpt.storage import FsspecStorage, LocalStorage, Storage

__all__ = [
    "WRITE_ERRORS",
    "CheckpointWriteError",
    "DiskFullError",
    "SaveWatch",
    "free_bytes",
    "human_bytes",
    "state_bytes",
    "warn_if_tight",
    "write_failure",
]

logger = logging.getLogger("titan_ckpt")

WRITE_ERRORS = (OSError, CheckpointException)
"""What a failed write raises: an ``OSError`` (our own writes: the commit marker, the HF
export), or DCP's ``CheckpointException`` (a ``BaseException``), which gathers every rank's
error and reaches every rank. Anything else, e.g. a collective broken by a rank that died
mid-save, is not a write failure and propagates as it is: the job is going down, and the
step stays uncommitted."""

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
FULL_SLACK = 1 << 20
"""A filesystem with less than this free after a failed write is taken to be full: the
write stopped for lack of a block, whatever torch's message says."""


def human_bytes(n: int) -> str:
    """``n`` bytes as e.g. ``1.5 GiB (1,610,612,736 bytes)``."""
    value, unit = float(n), "bytes"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    short = f"{n:,} bytes" if unit == "bytes" else f"{value:.1f} {unit} ({n:,} bytes)"
    return short


# ---------------------------------------------------------------------- size of a step
def _entry_bytes(value: Any, prefix: str, out: dict[str, int]) -> None:
    if isinstance(value, DTensor):
        out[prefix] = value.numel() * value.element_size()  # the full tensor, all shards
    elif isinstance(value, torch.Tensor):
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
        except Exception:  # an object DCP cannot pickle either fails the save itself
            out[prefix] = 0


def state_bytes(
    state: Mapping[str, Any], *, distributed: bool = False, group: dist.ProcessGroup | None = None
) -> int:
    """Bytes a DCP save of ``state`` writes over all ranks (data only, without file overhead).

    With ``distributed``, every rank's entries are gathered over ``group`` (a collective:
    call it on every rank) so pipeline stages add up and replicated entries count once.
    """
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


# ---------------------------------------------------------------------- free space
def free_bytes(storage: Storage, path: str) -> int | None:
    """Bytes free for ``path`` (which need not exist yet), or None where storage cannot tell.

    A local folder asks its filesystem (``shutil.disk_usage`` of the nearest existing
    ancestor); an fsspec URL only when its filesystem is the local one, or when the
    storage has a ``free_bytes(path)`` method of its own.
    """
    own = getattr(storage, "free_bytes", None)
    if callable(own):
        return own(path)
    local: str | None = None
    if isinstance(storage, LocalStorage):
        local = path
    elif isinstance(storage, FsspecStorage) and "file" in _protocols(storage.fs):
        local = storage.fs._strip_protocol(path)
    if local is None:
        return None
    probe = os.path.abspath(local)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def warn_if_tight(storage: Storage, folder: str, needed: int) -> None:
    """Log one warning when ``folder`` has room for fewer than two steps of ``needed`` bytes.

    Two, because the newest committed step stays while the next one is written.
    """
    free = free_bytes(storage, folder)
    if free is None or free >= 2 * needed:
        return
    logger.warning(
        "Checkpoint folder %s has %s free, and one step takes about %s: fewer than two steps "
        "fit, so a save will fail with the disk full; free space or move checkpoint.folder.",
        folder,
        human_bytes(free),
        human_bytes(needed),
    )


# ---------------------------------------------------------------------- failed writes
def _errors_in(error: BaseException) -> list[BaseException]:
    """``error`` and every error inside it: causes, contexts, DCP's per-rank failures."""
    seen: list[BaseException] = []
    todo = [error]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch's CheckpointException
        if isinstance(e, CheckpointException) and isinstance(failures, Mapping):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    todo.append(inner)
        todo += list(getattr(e, "exceptions", ()))  # ExceptionGroup
    return seen


def _root_cause(error: BaseException) -> BaseException:
    """The innermost error worth quoting (DCP's wrapper says only 'CheckpointException')."""
    errors = _errors_in(error)
    return next((e for e in errors if not isinstance(e, CheckpointException)), error)


def _bytes_under(storage: Storage, directory: str) -> int:
    total = 0
    try:
        for rel in storage.walk_files(directory):
            total += storage.size(storage.join(directory, rel))
    except OSError:
        pass
    return total


def write_failure(
    error: BaseException,
    *,
    storage: Storage,
    directory: str,
    step: int,
    needed: int | None,
    committed: list[int],
) -> CheckpointWriteError:
    """The one error to raise for a failed write of ``directory``; removes that directory.

    Call on one rank (rank 0), after every rank stopped writing. ``committed`` are the
    committed steps of the folder, which the message reports as intact.
    """
    if isinstance(error, CheckpointWriteError):
        return error
    partial = _bytes_under(storage, directory)
    free_now = free_bytes(storage, directory)
    free_before = None if free_now is None else free_now + partial
    out_of_space = any(
        isinstance(e, OSError) and e.errno in _NO_SPACE for e in _errors_in(error)
    ) or (
        free_now is not None
        and (free_now < FULL_SLACK or (needed is not None and free_before < needed))
    )
    removed = _remove_partial(storage, directory)
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
    cause = _root_cause(error)
    return CheckpointWriteError(
        f"Checkpoint of step {step} failed while writing {directory}: "
        f"{type(cause).__name__}: {cause}. {removed} {intact}",
        path=directory,
    )


def _committed_steps(storage: Storage, folder: str) -> list[int]:
    """Committed steps of ``folder`` (quietly: the failed step is expected to be uncommitted)."""
    steps = []
    try:
        for name in storage.list(folder):
            number = name.removeprefix("step-")
            if number.isdigit() and read_manifest(storage, storage.join(folder, name)):
                steps.append(int(number))
    except Exception:  # reporting only: a folder that cannot be listed reports no steps
        pass
    return sorted(steps)


def _remove_partial(storage: Storage, directory: str) -> str:
    # Through remove_step: only what the save wrote goes, no link is followed.
    try:
        if storage.exists(directory) and not remove_step(storage, directory):
            return "The partial step was not removed whole (see the warning); it is uncommitted."
        return "The partial step was removed."
    except Exception as e:
        return f"The partial step could not be removed ({e}); it is uncommitted and never loaded."


class SaveWatch:
    """One manager's watch over its saves: step sizes, free space, failed writes.

    The size of each kind of step (full, model-only, ...) is measured at its first save,
    with a collective over ``group``; that first save also warns when the folder has room
    for fewer than two such steps. ``settle`` is the point where every rank learns whether
    a write failed, as one ``CheckpointWriteError`` decided on rank 0.
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
        """Bytes of a step, by kind, as measured at its first save."""

    def step_bytes(self, state: Mapping[str, Any], kind: str) -> int:
        """Bytes a step of ``kind`` holding ``state`` needs (call on every rank)."""
        if self.sizes and self.rank == 0 and not self.storage.exists(self.folder):
            logger.warning(
                "Checkpoint folder %s vanished since the last save, with every step it held; "
                "the next save creates it again.",
                self.folder,
            )
        if kind not in self.sizes:
            size = state_bytes(state, distributed=self.distributed, group=self.group)
            self.sizes[kind] = size
            if self.rank == 0:
                warn_if_tight(self.storage, self.folder, size)
        return self.sizes[kind]

    def settle(
        self, error: BaseException | None, *, directory: str, step: int, needed: int | None
    ) -> None:
        """Raise on every rank if rank 0's ``error`` (its write or commit failed) is not None.

        A collective: every rank calls it after its part of the save, error or not. Rank 0
        removes the partial step and builds the message (``write_failure``).
        """
        final: CheckpointWriteError | None = None
        if self.rank == 0 and error is not None:
            committed = _committed_steps(self.storage, self.folder)
            final = write_failure(
                error,
                storage=self.storage,
                directory=directory,
                step=step,
                needed=needed,
                committed=[s for s in committed if s != step],
            )
        if self.distributed:
            box: list[Any] = [final]
            dist.broadcast_object_list(box, group=self.group, group_src=0)
            final = box[0]
        if final is not None:
            raise final from error
