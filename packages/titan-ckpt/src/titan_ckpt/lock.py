"""One writer per checkpoint folder: an advisory lock a saving run holds for its lifetime.

Two runs saving into one folder replace and delete each other's steps and both exit 0. So a
saving manager takes ``<folder>/.titan-ckpt.lock`` before any work and keeps it until
``close()``; a second writer gets one ``CheckpointLockError`` naming the holder. Readers take
no lock. With torchft each replica group locks its own ``ft-replica-<id>`` folder.

- Local storage: ``fcntl.flock``, which the kernel drops when the holder dies, so a file left
  behind is taken over. Where flock is refused (some network filesystems), a heartbeat.
- Other fsspec storage: a heartbeat every ``HEARTBEAT_SECONDS``; a lock not rewritten for
  ``STALE_SECONDS`` is taken over. Best effort (object stores have no atomic create).

A save also refuses to replace a step another writer committed after this manager started
(``claim_step``).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, BinaryIO

import torch.distributed as dist

from titan_ckpt.config import CheckpointConfig
from titan_ckpt.errors import CheckpointConfigError, CheckpointLockError, CheckpointWriteError
from titan_ckpt.ft import REPLICA_PREFIX
from titan_ckpt.layout import classify_step, read_manifest, remove_step, write_owner
from titan_ckpt.preflight import local_path, open_storage
from titan_ckpt.storage import Storage

__all__ = [
    "HEARTBEAT_SECONDS",
    "LOCK_FILE",
    "STALE_SECONDS",
    "FolderLock",
    "acquire",
    "claim_step",
    "lock_checkpoint_folder",
]

logger = logging.getLogger("titan_ckpt")

LOCK_FILE = ".titan-ckpt.lock"
HEARTBEAT_SECONDS = 10.0
"""How often the holder of a heartbeat lock rewrites it."""
STALE_SECONDS = 60.0
"""A heartbeat lock not rewritten for this long belongs to a process that is gone."""
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _me(*, heartbeat: bool) -> dict[str, Any]:
    """This process as its lock file names it (host, pid, since, heartbeat, token)."""
    now = time.time()
    beat = now if heartbeat else None
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": now, "heartbeat": beat,
            "token": uuid.uuid4().hex}  # fmt: skip


def _parse(data: bytes) -> dict[str, Any] | None:
    """The holder a lock file records; None for an empty or unreadable one."""
    try:
        holder = json.loads(data)
        str(holder["host"]), int(holder["pid"]), float(holder["since"])  # only a dict passes
    except (ValueError, TypeError, KeyError):
        return None
    return holder


def _describe(holder: dict[str, Any]) -> str:
    beat = holder.get("heartbeat")
    ago = "" if beat is None else f", last heartbeat {time.time() - beat:.0f} s ago"
    return f"process {holder['pid']} on host {holder['host']} (since {_when(holder['since'])}{ago})"


class FolderLock:
    """The writer's lock on one checkpoint folder, held until ``release()``. One that holds
    nothing (``held`` false) stands for it on other ranks and for a run that does not save."""

    def __init__(
        self,
        folder: str,
        *,
        path: str = "",
        holder: dict[str, Any] | None = None,
        file: BinaryIO | None = None,
        storage: Storage | None = None,
        created: tuple[str, ...] = (),
    ) -> None:
        self.folder, self.path, self.holder = folder, path, holder
        self._file = file  # a flock lock (closed, so released, also when garbage)
        self._storage = storage  # else a heartbeat lock on this storage
        self._created = created  # folders made for the lock, deepest first
        self._lost = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if holder is not None and file is None:
            self._beat = threading.Thread(
                target=self._heartbeats, name="titan-ckpt-lock", daemon=True
            )
            self._beat.start()

    @property
    def held(self) -> bool:
        """Whether this object holds the folder's lock."""
        return self.holder is not None

    def release(self) -> None:
        """Give the lock up and remove the lock file (idempotent)."""
        if self.holder is None:
            return
        self.holder, file = None, self._file
        if file is not None:
            try:  # unlinked while held: a taker that opened it meanwhile sees it went
                if _same_file(file.fileno(), self.path):
                    os.unlink(self.path)
            finally:
                file.close()  # drops the flock
            for folder in self._created:  # a run refused later leaves nothing behind
                try:
                    os.rmdir(folder)  # only while empty
                except OSError:
                    break
            return
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        try:
            if not self._lost and self._storage is not None:
                self._storage.remove(self.path)
        except OSError as e:  # stale in STALE_SECONDS: the next writer takes it over
            logger.warning("Could not remove the lock file %s: %s", self.path, e)

    def _heartbeats(self) -> None:
        storage, me = self._storage, self.holder
        assert storage is not None  # a heartbeat lock
        assert me is not None
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                current = _read(storage, self.path)
                if current is not None and current.get("token") != me["token"]:
                    self._lost = True
                    logger.error(
                        "Lost the lock of checkpoint folder %s to %s: this run's heartbeat "
                        "stalled past %.0f s, and two runs now write the folder; stop one.",
                        self.folder,
                        _describe(current),
                        STALE_SECONDS,
                    )
                    return
                me = {**me, "heartbeat": time.time()}
                storage.write_atomic(self.path, json.dumps(me).encode())
            except Exception as e:  # a storage hiccup: the next beat tries again
                logger.warning("Checkpoint folder lock heartbeat failed: %s", e)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _read(storage: Storage, path: str) -> dict[str, Any] | None:
    try:
        with storage.open(path, "rb") as f:
            return _parse(f.read())
    except FileNotFoundError:
        return None


def _busy_error(folder: str, holder: dict[str, Any] | None) -> CheckpointLockError:
    """The one message for a folder another writer holds."""
    who = _describe(holder) if holder else ""
    return CheckpointLockError(
        f"Checkpoint folder {folder} is in use by another run: "
        f"{who or 'another process (not yet named in the file)'} holds its lock "
        f"({LOCK_FILE}). Two runs saving into one folder replace and delete each other's "
        "checkpoints, so this one stops before any work. Wait for that run to end or stop it, "
        "point checkpoint.folder (or job.dump_folder) elsewhere, or read the folder without "
        f"saving: checkpoint.load_only=true, or titan-ckpt inspect {folder}.",
        holder=who,
    )


def _took_over(folder: str, previous: dict[str, Any], why: str) -> None:
    logger.warning("Took over checkpoint folder %s from %s, %s", folder, _describe(previous), why)


def acquire(storage: Storage, folder: str) -> FolderLock:
    """Take ``folder``'s writer lock for this process (creating the folder); raise
    ``CheckpointLockError`` naming the holder if another process holds it."""
    local = local_path(storage, folder)  # LocalStorage, or fsspec's file://
    if local is not None:
        created, path = [], os.path.abspath(local)
        while not os.path.exists(path):
            created.append(path)
            path = os.path.dirname(path)
        storage.makedirs(folder)
        lock = _flock(folder, os.path.join(local, LOCK_FILE), tuple(created))
        if lock is not None:
            return lock
        logger.info("%s refuses flock: locking checkpoint folder by heartbeat", folder)
    storage.makedirs(folder)
    path = storage.join(folder, LOCK_FILE)
    previous = _read(storage, path)
    beat = previous and (previous.get("heartbeat") or previous["since"])
    if previous is not None and time.time() - beat < STALE_SECONDS:
        raise _busy_error(folder, previous)
    me = _me(heartbeat=True)
    storage.write_atomic(path, json.dumps(me).encode())
    back = _read(storage, path)  # no atomic create on object stores: best effort
    if back is None or back.get("token") != me["token"]:
        raise _busy_error(folder, back)  # another taker wrote after us
    if previous is not None:
        _took_over(folder, previous, f"whose heartbeat stopped over {STALE_SECONDS:.0f} s ago")
    return FolderLock(folder, path=path, holder=me, storage=storage)


def _flock(folder: str, path: str, created: tuple[str, ...]) -> FolderLock | None:
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _parse(os.pread(fd, 1 << 16, 0))
            os.close(fd)
            if isinstance(error, BlockingIOError):
                raise _busy_error(folder, holder) from None
            if error.errno in _NO_FLOCK:
                return None
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it between our open and flock: open it anew
    previous = _parse(os.pread(fd, 1 << 16, 0))
    me = _me(heartbeat=False)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    os.fsync(fd)
    if previous is not None:
        _took_over(folder, previous, "which had not released it (its process ended, or its "
                   "manager was dropped without close())")  # fmt: skip
    return FolderLock(folder, path=path, holder=me, file=os.fdopen(fd, "r+b"), created=created)


def lock_checkpoint_folder(
    config: CheckpointConfig,
    *,
    storage: Storage | None = None,
    group: dist.ProcessGroup | None = None,
    torchft: bool = False,
    ft_replica_id: str | int | None = None,
) -> FolderLock:
    """The writer's lock of a run checkpointing as ``config`` says, taken before any work by
    rank 0 of ``group`` (the process itself without torch.distributed). Every rank raises
    rank 0's refusal (``CheckpointLockError``), so none is left waiting in a collective;
    the other ranks get a lock that holds nothing, as does a run that does not save
    (disabled or ``load_only``). With ``torchft``, the lock is on the replica group's own
    ``ft-replica-<ft_replica_id>`` folder (none without an id). Pass the lock to the
    ``CheckpointManager`` (``folder_lock=``), which releases it on ``close()``.
    """
    if not config.enable or config.load_only or (torchft and ft_replica_id is None):
        return FolderLock(config.folder)
    storage = storage if storage is not None else open_storage(config.folder)
    folder = config.folder
    if torchft:
        folder = storage.join(folder, f"{REPLICA_PREFIX}{ft_replica_id}")
    distributed = dist.is_available() and dist.is_initialized()
    lock, error = FolderLock(folder), None
    if not distributed or dist.get_rank(group) == 0:
        try:
            lock = acquire(storage, folder)
        except Exception as e:  # delivered to every rank, raised there
            error = e
    if distributed:
        box: list[BaseException | None] = [error]
        dist.broadcast_object_list(box, group=group, group_src=0)
        error = box[0]
    if error is not None:  # then no rank holds the lock
        raise error
    return lock


def claim_step(storage: Storage, directory: str, step: int, since: float, own: set[str]) -> None:
    """Make ``directory`` ours and empty before writing step ``step`` into it: remove what an
    earlier save of ours left there; refuse a directory someone else wrote, and
    (``CheckpointWriteError``) a step committed after ``since`` (this manager's start) that
    this manager did not commit (``own``): another writer of the folder committed it."""
    if storage.exists(directory):
        kind = classify_step(storage, directory)
        if kind not in ("committed", "interrupted"):
            raise CheckpointConfigError(
                f"Cannot save step {step}: {directory} exists and is a {kind} checkpoint "
                "directory that titan did not write; titan never deletes, overwrites or "
                "writes into it. Move it away, or use another checkpoint.folder."
            )
        if kind == "committed":
            manifest = read_manifest(storage, directory)
            if manifest is not None and directory not in own and manifest.created >= since:
                raise CheckpointWriteError(
                    f"Cannot save step {step}: {directory} was committed at "
                    f"{_when(manifest.created)}, after this run started ({_when(since)}), so "
                    "another run is writing this folder too; titan never replaces a step "
                    "another writer committed, and wrote nothing. Stop one of the runs, or give "
                    "each its own checkpoint.folder.",
                    path=directory,
                )
            logger.warning("Replacing committed checkpoint %s", directory)
        # Killed halfway, it stays "interrupted"; one it must leave (a link inside, files not
        # ours) is no place to write into.
        if not remove_step(storage, directory):
            raise CheckpointConfigError(
                f"Cannot save step {step}: {directory} holds what titan did not write "
                "(see the warning). Move it away, or use another checkpoint.folder."
            )
    write_owner(storage, directory, step)
