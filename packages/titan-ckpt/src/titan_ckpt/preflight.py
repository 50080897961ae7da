"""Checks of the checkpoint folder before any work: the first save must not be the first sign.

``check_checkpoint_folder`` refuses, with one ``CheckpointConfigError``, a folder that no save
could write: a path component that is a file, a folder (or its nearest existing ancestor,
where the folder would be created) without write permission or on a read-only filesystem,
and a URL whose fsspec filesystem is not installed (``s3://`` without ``s3fs``). The
``CheckpointManager`` runs it on construction; ``titan-train`` runs it before it builds the
model. A folder that vanishes later, mid-run, is recreated by the next save (with a warning:
the steps it held are gone), as DCP's writer creates the step directory with its parents.
"""

from __future__ import annotations

import os

from titan_ckpt.config import CheckpointConfig, CheckpointConfigError
from titan_ckpt.storage import FsspecStorage, LocalStorage, Storage, storage_for

__all__ = ["check_checkpoint_folder", "open_storage"]


def open_storage(folder: str) -> Storage:
    """``storage_for(folder)``, with a missing fsspec or filesystem package as a config error."""
    try:
        return storage_for(folder)
    except (ImportError, ValueError) as e:
        scheme = folder.split("://", 1)[0]
        raise CheckpointConfigError(
            f"checkpoint.folder={folder!r} is a {scheme}:// URL, which this environment cannot "
            f"open ({e}). Install fsspec and the filesystem's package (s3fs for s3://, gcsfs for "
            "gs://, adlfs for az://), or use a local path."
        ) from None


def check_checkpoint_folder(
    config: CheckpointConfig, storage: Storage | None = None
) -> Storage | None:
    """Raise ``CheckpointConfigError`` unless saves into ``config.folder`` can work.

    Returns the folder's storage (None when checkpointing is off). A load-only run needs no
    write access. A storage passed in that is neither local nor fsspec is only asked whether
    the folder is a directory (it knows its own limits).
    """
    if not config.enable:
        return storage
    folder = config.folder
    if storage is None:
        storage = open_storage(folder)
    if config.load_only:
        return storage
    local = _local_path(storage, folder)
    if local is not None:
        _check_local(folder, local)
    elif storage.exists(folder) and not storage.is_dir(folder):
        raise CheckpointConfigError(f"checkpoint.folder={folder!r} exists and is not a directory.")
    return storage


def _local_path(storage: Storage, folder: str) -> str | None:
    if isinstance(storage, FsspecStorage):
        protocol = storage.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return storage.fs._strip_protocol(folder) if "file" in protocols else None
    return folder if isinstance(storage, LocalStorage) else None


def _check_local(folder: str, path: str) -> None:
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "" if existing == path else f": {existing} is a file, not a directory"
        raise CheckpointConfigError(
            f"checkpoint.folder={folder!r} cannot be used as a folder{what}. Point "
            "checkpoint.folder (or job.dump_folder) elsewhere, or move that file."
        )
    if os.access(existing, os.W_OK | os.X_OK):
        return
    role = "" if existing == path else f" cannot be created: its parent {existing}"
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    why = "is on a read-only filesystem" if read_only else "is not writable by this user"
    raise CheckpointConfigError(
        f"checkpoint.folder={folder!r}{role} {why}, so no checkpoint could be saved. Point "
        "checkpoint.folder (or job.dump_folder) at a writable folder, or set "
        "checkpoint.load_only=true to only read checkpoints."
    )
