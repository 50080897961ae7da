"""The on-disk layout: ``<folder>/step-<N>/``, its commit marker and manifest, and discovery.

A step directory is a DCP checkpoint, loadable only once rank 0 wrote ``titan-commit.json``
after DCP finished on every rank. The marker is the manifest: every file's size and checksum,
computed by the writers as they wrote (``formats.hashing``). Before any DCP file, rank 0
writes ``titan-owner.json``. So a step directory is (``classify_step``) ``committed``,
``interrupted`` (ours, never committed), ``torchtitan`` (loadable) or ``foreign``. titan
never deletes, overwrites or writes into one that is neither committed nor interrupted, and
deletes its own in an order (``remove_step``) that a crash leaves ``interrupted``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from titan_ckpt.errors import CheckpointIntegrityError
from titan_ckpt.formats.checksums import (
    entry_algorithm,
    new_hasher,
    require_algorithms,
    resolve_checksum,
)
from titan_ckpt.storage import Storage
from titan_ckpt.torchtitan import is_torchtitan_checkpoint, read_state_keys

__all__ = [
    "COMMIT_MARKER",
    "MODEL_RECORD",
    "OWNER_MARKER",
    "STEP_KINDS",
    "STEP_RE",
    "Manifest",
    "Purger",
    "StepScan",
    "classify_step",
    "commit_step",
    "committed_steps",
    "file_digest",
    "file_problems",
    "hash_files",
    "integrity_error",
    "json_metadata",
    "read_manifest",
    "remove_step",
    "scan_steps",
    "step_dir",
    "step_name",
    "step_of",
    "verify_step",
    "write_owner",
]

logger = logging.getLogger("titan_ckpt")

COMMIT_MARKER = "titan-commit.json"
OWNER_MARKER = "titan-owner.json"
UNREADABLE_MARKER_MEANS = (
    "a run takes this step as an interrupted save: it does not load it, and a save of the "
    "same step replaces it"
)
"""What a commit marker that does not parse means, as ``verify`` and ``inspect`` say it."""
MODEL_RECORD = "model"
"""The key of the model's record in ``Manifest.metadata``: ``{"name", "flavor", "args"}``,
which ``titan-ckpt convert`` hands to the state-dict adapter named ``name``."""
STEP_KINDS = ("committed", "interrupted", "torchtitan", "foreign")
_MARKERS = (COMMIT_MARKER, OWNER_MARKER)  # ours, not checkpoint data: not in the manifest
FORMAT = "titan-ckpt/1"
STEP_RE = re.compile(r"^step-(\d+)$")
"""A step directory's name (the one pattern: discovery, detection, the commands)."""


def step_name(step: int) -> str:
    """The name of step ``step``'s directory: ``step-<N>``."""
    return f"step-{step}"


def step_of(name: str) -> int | None:
    """The step a directory name ``step-<N>`` stands for, else None."""
    m = STEP_RE.match(name)
    return int(m.group(1)) if m else None


def step_dir(storage: Storage, folder: str, step: int) -> str:
    """The directory of step ``step`` under ``folder``."""
    return storage.join(folder, step_name(step))


@dataclass(kw_only=True)
class Manifest:
    """What the commit marker records about a step."""

    step: int
    """Training step of the checkpoint."""
    world_size: int
    """Processes that wrote it."""
    states: list[str]
    """Top-level states saved ("model" plus e.g. "optimizer", "dataloader")."""
    model_only: bool
    """Whether only the model was saved (seed checkpoint, last save)."""
    data_parallel_degree: int | None = None
    """Data-parallel ranks of the run that wrote it (its dataloader's sharding), if known;
    None in older markers, where ``world_size`` stands in."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Relative path -> {"size": bytes, <algorithm>: hex digest}, the algorithm one of
    ``titan_ckpt.formats.checksums.ALGORITHMS`` ("xxh3_128" or "sha256")."""
    created: float = 0.0
    """Unix time of the commit."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the writer recorded about the checkpoint (``CheckpointManager(metadata=...)``),
    as JSON. By convention ``metadata["model"]`` = ``{"name": ..., "flavor": ..., "args":
    {...}}`` describes the model (titan-train writes it; ``titan-ckpt convert`` reads it)."""

    def to_json(self) -> bytes:
        body = {"format": FORMAT, **self.__dict__}
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """The manifest in ``data``; ``ValueError`` for anything that is not a well-formed
        marker (damaged or foreign), so that no reader fails on it later."""
        body = json.loads(data)  # its errors, UnicodeDecodeError included, are ValueErrors
        if not isinstance(body, dict) or body.pop("format", None) != FORMAT:
            raise ValueError(f"not a {FORMAT} commit marker")
        try:
            manifest = cls(**body)
        except TypeError as error:  # a field missing or unknown
            raise ValueError(f"not a {FORMAT} commit marker: {error}") from None
        if not _well_formed(manifest):
            raise ValueError(f"a {FORMAT} commit marker with fields of the wrong types")
        return manifest


def _well_formed(m: Manifest) -> bool:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    return (
        whole(m.step)
        and whole(m.world_size)
        and isinstance(m.states, list)
        and all(isinstance(s, str) for s in m.states)
        and isinstance(m.model_only, bool)
        and (m.data_parallel_degree is None or whole(m.data_parallel_degree))
        and isinstance(m.metadata, dict)
        and isinstance(m.created, (int, float))
        and isinstance(m.files, dict)
        and all(
            # A size and at least one digest; an algorithm a later version adds still parses
            # (the step stays committed), and only verifying its checksums is refused.
            isinstance(info, dict)
            and whole(info.get("size"))
            and len(info) > 1
            and all(isinstance(v, str) for k, v in info.items() if k != "size")
            for info in m.files.values()
        )
    )


def json_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as a plain JSON dict for ``Manifest.metadata``; ``TypeError`` now (not at
    the first save) unless it is JSON-serializable."""
    try:
        return json.loads(json.dumps(dict(metadata or {})))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"Checkpoint metadata must be JSON-serializable (it goes into the commit manifest "
            f"{COMMIT_MARKER}): {error}."
        ) from None


def file_digest(storage: Storage, path: str, algorithm: str) -> str:
    """The ``algorithm`` checksum (hex) of the file ``path``, read through ``storage.open``."""
    with storage.open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: new_hasher(algorithm)).hexdigest()  # type: ignore[arg-type]


def _temporary(rel: str) -> bool:
    """Whether ``rel`` is the temporary file of an atomic write (``Storage.write_atomic``)."""
    return rel.rsplit("/", 1)[-1].startswith(".tmp-")


def _data_files(storage: Storage, directory: str, prefix: str = "") -> list[str]:
    """The checkpoint files of ``directory`` (relative paths), less our markers and
    temporary files, whose names start with ``prefix``."""
    return [
        rel
        for rel in storage.walk_files(directory)
        if rel not in _MARKERS and not _temporary(rel) and rel.startswith(prefix)
    ]


def _file_entry(storage: Storage, path: str, algorithm: str) -> dict[str, Any]:
    return {"size": storage.size(path), algorithm: file_digest(storage, path, algorithm)}


def hash_files(
    storage: Storage, directory: str, *, prefix: str = "", checksum: str = "auto"
) -> dict[str, dict]:
    """Size and checksum (``checkpoint.checksum``'s values) of the files in ``directory``
    whose names start with ``prefix``, by reading them (a save does not: its writer hashes
    while writing; see ``commit_step``)."""
    algorithm = resolve_checksum(checksum)
    return {
        rel: _file_entry(storage, storage.join(directory, rel), algorithm)
        for rel in _data_files(storage, directory, prefix)
    }


def commit_step(
    storage: Storage,
    directory: str,
    manifest: Manifest,
    written: Mapping[str, dict] | None = None,
    *,
    checksum: str = "auto",
) -> Manifest:
    """Commit the step in ``directory``: fill the manifest with every file's size and checksum,
    then write the commit marker, last. ``written`` (what the writers hashed) is taken after a
    size check; only other files are hashed here, by reading. A file of ``written`` missing or
    of another size fails the commit (``OSError``): the step stays uncommitted."""
    algorithm = resolve_checksum(checksum)
    written = dict(written or {})
    read_back = []
    for rel in _data_files(storage, directory):
        path = storage.join(directory, rel)
        entry = written.pop(rel, None)
        if entry is None:
            entry = _file_entry(storage, path, algorithm)
            read_back.append(rel)
        elif storage.size(path) != entry["size"]:
            raise OSError(
                errno.EIO,
                f"{path} is {storage.size(path)} bytes on storage but {entry['size']} were "
                "written; not committing this step",
            )
        manifest.files[rel] = dict(entry)
    missing = sorted(written)
    if missing:
        raise OSError(
            errno.ENOENT,
            f"{directory} lacks files the save wrote ({', '.join(missing[:3])}); not committing "
            "this step",
        )
    if read_back:
        logger.debug("%s: hashed by reading: %s", directory, read_back)
    manifest.created = time.time()
    storage.write_atomic(storage.join(directory, COMMIT_MARKER), manifest.to_json())
    return manifest


def _parse_marker(storage: Storage, directory: str) -> tuple[Manifest | None, str | None]:
    """The commit marker of ``directory`` parsed: (manifest, None); (None, why it does not
    parse); or (None, None) when there is none."""
    path = storage.join(directory, COMMIT_MARKER)
    if not storage.exists(path):
        return None, None
    with storage.open(path, "rb") as f:
        data = f.read()
    try:
        return Manifest.from_json(data), None
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested too deep
        return None, str(error).strip()[:200] or type(error).__name__


def read_manifest(storage: Storage, directory: str) -> Manifest | None:
    """The commit marker of ``directory``, or None if it has none or a torn one (not committed)."""
    manifest, problem = _parse_marker(storage, directory)
    if problem is not None:
        # The marker is written last and whole (rename), so one that does not parse was torn
        # by a crash on a storage without atomic writes: the step was never committed.
        logger.warning(
            "%s: unreadable commit marker (%s); the step is uncommitted",
            storage.join(directory, COMMIT_MARKER),
            problem,
        )
    return manifest


def marker_problem(storage: Storage, directory: str) -> str | None:
    """Why the commit marker of ``directory`` does not parse (damaged, or torn by a crash),
    for the commands that report it; None when it parses or there is none."""
    return _parse_marker(storage, directory)[1]


def verify_step(storage: Storage, directory: str, manifest: Manifest, *, checksums: bool) -> None:
    """Raise ``CheckpointIntegrityError`` naming every file that differs from the manifest;
    with ``checksums``, first ``CheckpointConfigError`` if an entry's algorithm cannot be
    computed here (``titan_ckpt.formats.checksums.require_algorithms``), before any file is read."""
    if checksums:
        require_algorithms(manifest.files.values(), directory)
    problems = file_problems(storage, directory, manifest.files, checksums=checksums)
    if problems:
        raise integrity_error(directory, problems)


def file_problems(
    storage: Storage, directory: str, files: Mapping[str, dict], *, checksums: bool
) -> list[str]:
    """One line per file of ``files`` (a manifest's entries, or a rank's share of them) that
    is missing, of another size, or (``checksums``) of other contents, by the algorithm each
    entry names. Files are hashed in parallel threads: the hashes and reads release the GIL.
    The caller checked the algorithms first (``require_algorithms``)."""

    def problem(rel: str) -> str | None:
        info = files[rel]
        path = storage.join(directory, rel)
        try:
            if not storage.exists(path):
                return f"{rel}: missing"
            size = storage.size(path)
            if size != info["size"]:
                return f"{rel}: {size} bytes, the manifest says {info['size']}"
            algorithm = entry_algorithm(info) if checksums else None
            if algorithm and file_digest(storage, path, algorithm) != info[algorithm]:
                return f"{rel}: {algorithm} differs from the manifest (contents changed)"
        except OSError as error:
            return f"{rel}: unreadable ({error})"
        return None

    names = sorted(files)
    workers = min(len(names), os.cpu_count() or 1, 8) if checksums else 1
    if workers <= 1:
        found = [problem(rel) for rel in names]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="titan-ckpt-verify") as pool:
            found = list(pool.map(problem, names))
    return [p for p in found if p is not None]


def integrity_error(directory: str, problems: list[str]) -> CheckpointIntegrityError:
    """The error for a step whose files differ from its manifest (``file_problems``)."""
    return CheckpointIntegrityError(
        f"Checkpoint {directory} is damaged: " + "; ".join(problems) + ". Load an earlier "
        "step (checkpoint.load_step) or restore these files.",
        problems=problems,
    )


def write_owner(storage: Storage, directory: str, step: int) -> None:
    """Create ``directory`` and mark it as ours, before any checkpoint file goes in."""
    storage.makedirs(directory)
    body = {"format": FORMAT, "step": step, "created": time.time()}
    storage.write_atomic(storage.join(directory, OWNER_MARKER), json.dumps(body).encode())


def classify_step(storage: Storage, directory: str) -> str:
    """Which of ``STEP_KINDS`` the step directory ``directory`` is (see the module docstring)."""
    if not storage.is_dir(directory):
        return "foreign"
    if storage.exists(storage.join(directory, COMMIT_MARKER)):
        # A marker that does not parse was torn mid-write: ours, never committed.
        return "committed" if read_manifest(storage, directory) is not None else "interrupted"
    if storage.exists(storage.join(directory, OWNER_MARKER)) or _holds_no_data(storage, directory):
        return "interrupted"
    keys = read_state_keys(storage, directory)
    if keys is not None and is_torchtitan_checkpoint(keys):
        return "torchtitan"
    return "foreign"


def _holds_no_data(storage: Storage, directory: str) -> bool:
    """Whether ``directory`` holds no file but our atomic writes' temporaries: a save killed
    while writing the owner marker, or a deletion (``remove_step``) killed after the marker
    went and before the directory did. Empty subdirectories do not count."""
    return all(_temporary(rel) for rel in storage.walk_files(directory))


def remove_step(storage: Storage, directory: str) -> bool:
    """Delete a step directory of ours in an order a crash cannot turn into a foreign one:
    commit marker, data, owner marker, directory. Returns whether it is gone. Only what titan
    wrote goes and no link is followed: a directory that is a link or lacks our owner marker is
    left whole; inside one, a link or a file the manifest does not list is left (with the owner
    marker: an interrupted step). One warning names what was left."""
    if storage.is_link(directory):
        _leave(
            f"Not deleting {directory}: it is a symbolic link, and titan-ckpt never deletes "
            "through one"
        )
        return False
    entries = storage.walk_files(directory)
    if OWNER_MARKER not in entries and not _holds_no_data(storage, directory):
        _leave(f"Not deleting {directory}: it has no {OWNER_MARKER}, so it is not provably titan's")
        return False
    manifest, _ = _parse_marker(storage, directory)
    links = {rel for rel in entries if storage.is_link(storage.join(directory, rel))}

    def ours(rel: str) -> bool:
        if rel in links:
            return False
        if rel in _MARKERS or _temporary(rel):
            return True
        return manifest is None or rel in manifest.files

    if COMMIT_MARKER in entries:
        storage.remove(storage.join(directory, COMMIT_MARKER))
    for rel in entries:
        if rel not in _MARKERS and ours(rel):
            storage.remove(storage.join(directory, rel))
    left = [rel for rel in entries if not ours(rel)]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        _leave(
            f"Deleted titan's files of {directory} but not the directory (uncommitted: never "
            f"loaded), which holds what titan did not write: {shown}"
        )
        return False
    owner = storage.join(directory, OWNER_MARKER)
    if storage.exists(owner):
        storage.remove(owner)
    storage.remove(directory)  # what is left: empty subdirectories
    return True


def _leave(message: str) -> None:
    logger.warning("%s. Move it away or delete it yourself if it should go.", message)


@dataclass
class StepScan:
    """Step directories under a folder, by kind (see ``classify_step``)."""

    committed: list[int]
    uncommitted: list[int]
    """Ours, never committed (interrupted or in progress)."""
    torchtitan: list[int] = field(default_factory=list)
    foreign: list[int] = field(default_factory=list)

    @property
    def loadable(self) -> list[int]:
        """The steps a run can resume from (committed and torchtitan), in order."""
        return sorted(self.committed + self.torchtitan)


def _step_names(storage: Storage, folder: str) -> list[tuple[int, str]]:
    named = ((step_of(name), name) for name in storage.list(folder))
    return sorted((step, name) for step, name in named if step is not None)


def committed_steps(storage: Storage, folder: str) -> list[int]:
    """The committed steps under ``folder``, without examining any other directory."""
    return [
        step
        for step, name in _step_names(storage, folder)
        if read_manifest(storage, storage.join(folder, name)) is not None
    ]


def scan_steps(storage: Storage, folder: str, *, log: bool = True) -> StepScan:
    """Find and classify ``step-<N>`` directories; ours uncommitted ones are logged
    (unless ``log`` is false)."""
    scan = StepScan([], [])
    for step, name in _step_names(storage, folder):
        kind = classify_step(storage, storage.join(folder, name))
        getattr(scan, "uncommitted" if kind == "interrupted" else kind).append(step)
    if scan.uncommitted and log:
        logger.warning(
            "Ignoring uncommitted checkpoint directories in %s (interrupted or in-progress "
            "saves): %s",
            folder,
            ", ".join(map(step_name, scan.uncommitted)),
        )
    return scan


class Purger:
    """Retention: deletes committed steps beyond the newest ``keep_latest_k`` under one folder,
    in a background thread (on one rank), only through ``remove_step``; a step it must leave
    is not tried again, and a failed pass is logged while the next request carries on."""

    def __init__(self, storage: Storage, folder: str, keep_latest_k: int) -> None:
        if keep_latest_k < 2:
            raise ValueError(f"keep_latest_k={keep_latest_k}: the purger keeps at least 2.")
        self.storage, self.folder, self.keep = storage, folder, keep_latest_k
        self.left: set[str] = set()
        """Steps ``remove_step`` left in place (a link, files not ours): not tried again."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="titan-ckpt-purge")

    def request(self) -> None:
        """Ask for a purge pass; returns at once."""
        self._pool.submit(self._run)

    def close(self) -> None:
        """Finish every pass already requested, then stop the thread (idempotent)."""
        self._pool.shutdown(wait=True)

    def _run(self) -> None:
        try:
            self._purge_once()
        except Exception:  # the next pass must run even if this one failed
            logger.exception("Checkpoint purge pass in %s failed", self.folder)

    def _purge_once(self) -> None:
        # Only steps with our commit marker count and go: never torchtitan's, a foreign
        # directory, or an interrupted save (see titan_ckpt.layout).
        committed = committed_steps(self.storage, self.folder)
        for step in committed[: max(0, len(committed) - self.keep)]:
            directory = step_dir(self.storage, self.folder, step)
            if directory in self.left:
                continue
            try:
                if not remove_step(self.storage, directory):
                    self.left.add(directory)
                    continue
                logger.info("Deleted checkpoint %s (keep_latest_k=%d)", directory, self.keep)
            except Exception as e:
                logger.warning("Could not delete checkpoint %s: %s", directory, e)
