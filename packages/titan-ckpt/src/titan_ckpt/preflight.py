"""The checkpoint folder, checked before a run does any work.

``check_folder_writable`` refuses (``CheckpointConfigError``) a folder no save could write: a
path component that is a file, no write permission or a read-only filesystem (of the folder
or its nearest existing ancestor), a URL whose fsspec filesystem is not installed.
``check_folder_contents`` refuses a ``foreign`` step directory (titan can neither resume from
it nor save beside it), and a torchtitan step that this run would save over. The manager
applies both; a trainer calls them first so the run stops before it builds anything.
"""

from __future__ import annotations

import os

from titan_ckpt.config import CheckpointConfig
from titan_ckpt.errors import CheckpointConfigError
from titan_ckpt.layout import StepScan, scan_steps, step_dir
from titan_ckpt.storage import FsspecStorage, LocalStorage, Storage, storage_for
from titan_ckpt.torchtitan import TORCHTITAN_STATES, read_state_keys

__all__ = [
    "check_folder_contents",
    "check_folder_writable",
    "foreign_steps_error",
    "open_storage",
    "resolve_start",
    "saves_step",
]


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


def check_folder_writable(
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
    local = local_path(storage, folder)
    if local is not None:
        _check_local(folder, local)
    elif storage.exists(folder) and not storage.is_dir(folder):
        raise CheckpointConfigError(f"checkpoint.folder={folder!r} exists and is not a directory.")
    return storage


def local_path(storage: Storage, folder: str) -> str | None:
    """``folder`` as a local filesystem path (``LocalStorage``, or fsspec's ``file://``);
    None on other storage."""
    if isinstance(storage, FsspecStorage):
        protocol = storage.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return storage.fs._strip_protocol(folder) if "file" in protocols else None
    return folder if isinstance(storage, LocalStorage) else None


def nearest_existing(path: str) -> str:
    """The absolute ``path`` (a local one) if it exists, else its nearest existing ancestor."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def _check_local(folder: str, path: str) -> None:
    path = os.path.abspath(path)
    existing = nearest_existing(path)
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


def saves_step(config: CheckpointConfig, step: int, *, last_step: bool = False) -> bool:
    """Whether the save policy of ``config`` writes a checkpoint after step ``step``."""
    if not config.enable or config.load_only:
        return False
    if last_step or step % config.interval == 0:
        return True
    return step == 1 and config.enable_first_step_checkpoint


def _describe(storage: Storage, directory: str) -> str:
    if not storage.is_dir(directory):
        return "not a directory"
    keys = read_state_keys(storage, directory)
    if keys is None:
        return "no titan marker and no readable DCP metadata"
    if not any(k.split(".", 1)[0] in TORCHTITAN_STATES for k in keys):
        return (
            "a model-only DCP checkpoint, e.g. torchtitan's seed or its last save with "
            "last_save_model_weights_only"
        )
    return "a DCP checkpoint without the training state of titan or torchtitan"


def foreign_steps_error(storage: Storage, folder: str, steps: list[int]) -> CheckpointConfigError:
    """The error for step directories under ``folder`` that titan did not write."""
    found = "; ".join(
        f"{step_dir(storage, folder, s)} ({_describe(storage, step_dir(storage, folder, s))})"
        for s in steps
    )
    return CheckpointConfigError(
        f"checkpoint.folder={folder!r} holds step directories titan did not write and cannot "
        f"resume from: {found}. titan never deletes, overwrites or writes into such a "
        "directory, so the run stops here. Use another checkpoint.folder, or move these "
        "directories away; to start from one of them, set checkpoint.initial_load_path to it "
        "with a checkpoint.folder that does not contain it."
    )


def _collisions(config: CheckpointConfig, scan: StepScan, final_step: int) -> list[int]:
    """torchtitan steps this run would save over."""
    start = config.load_step if config.load_step != -1 else max(scan.loadable, default=0)
    return [
        s
        for s in scan.torchtitan
        if start < s <= final_step and saves_step(config, s, last_step=s == final_step)
    ]


def check_folder_contents(
    config: CheckpointConfig, *, final_step: int | None = None, storage: Storage | None = None
) -> StepScan | None:
    """Raise ``CheckpointConfigError`` if the run would have to touch a directory that is not
    its own; returns the scan (None when checkpointing is off). With ``final_step``, saves that
    would land on a torchtitan step are refused too."""
    if not config.enable:
        return None
    storage = storage if storage is not None else open_storage(config.folder)
    scan = scan_steps(storage, config.folder, log=False)  # loading logs them
    if scan.foreign:
        raise foreign_steps_error(storage, config.folder, scan.foreign)
    # The start point too (load_step, initial_load_path): the same decision and errors as
    # the load, taken before the model exists.
    resolve_start(storage, config, scan, step=config.load_step)
    if final_step is not None:
        clash = _collisions(config, scan, final_step)
        if clash:
            where = ", ".join(str(step_dir(storage, config.folder, s)) for s in clash)
            raise CheckpointConfigError(
                f"This run would save step(s) {clash} over torchtitan checkpoint(s) {where} "
                "(it trains to step "
                f"{final_step} and saves every checkpoint.interval={config.interval} steps); "
                "titan never overwrites a checkpoint it did not write. Resume from the newest "
                f"torchtitan step (checkpoint.load_step={max(scan.torchtitan)}), move those "
                "directories away, or use another checkpoint.folder."
            )
    return scan


def resolve_start(
    storage: Storage, config: CheckpointConfig, scan: StepScan, *, step: int
) -> tuple[str, str] | None:
    """Where a run starts, from the folder's ``scan``: ``("resume", step directory)`` (the
    newest loadable step, or ``step`` unless it is -1), ``("initial", directory)`` or
    ``("hf", folder)`` from ``config.initial_load_path``, or None for a fresh start. Raises
    ``CheckpointConfigError`` for a start point that does not exist. Reads no tensor and no
    model: a trainer runs it before any work, and ``CheckpointManager.load`` again."""
    loadable = scan.loadable
    if loadable:
        if step == -1:
            step = loadable[-1]
        if step not in loadable:
            note = (
                " (present but uncommitted: an interrupted save)"
                if step in scan.uncommitted
                else ""
            )
            raise CheckpointConfigError(
                f"checkpoint.load_step={step} is not a committed checkpoint in "
                f"{config.folder}{note}; committed steps: {loadable}."
            )
        return "resume", step_dir(storage, config.folder, step)
    if step != -1:
        raise CheckpointConfigError(
            f"checkpoint.load_step={step}, but {config.folder} holds no committed "
            "checkpoint. Use -1 to start fresh, or point checkpoint.folder elsewhere."
        )
    path = config.initial_load_path
    if path is None:
        return None
    if not storage.exists(path):
        raise CheckpointConfigError(
            f"checkpoint.initial_load_path={path!r} does not exist. Point it at a step "
            "directory, a folder of step-<N> checkpoints or (with initial_load_in_hf) a "
            "Hugging Face folder, or unset it to start from fresh weights."
        )
    if config.initial_load_in_hf:
        return "hf", path
    if not storage.exists(storage.join(path, ".metadata")):
        inner = scan_steps(storage, path, log=False).loadable
        if not inner:
            raise CheckpointConfigError(
                f"checkpoint.initial_load_path={path!r} is neither a DCP checkpoint "
                "(no .metadata) nor a folder of committed step-<N> checkpoints."
            )
        path = step_dir(storage, path, inner[-1])
    return "initial", path
