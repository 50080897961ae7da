"""The storage seam: where checkpoint directories live (a local filesystem, or any fsspec
filesystem for a ``scheme://`` URL). DCP's reader and writer come from the same object, so a
new backend is one subclass.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from typing import IO, Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from titan_ckpt.formats.checksums import new_hasher, resolve_checksum
from titan_ckpt.formats.dcp import SafeFileSystemReader, safe_fsspec_reader
from titan_ckpt.formats.hashing import HashingFileSystemWriter, HashingStream, hashing_fsspec_writer

__all__ = ["FsspecStorage", "LocalStorage", "RecordingStorage", "Storage", "storage_for"]


class Storage(ABC):
    """Files and directories addressed by path strings; ``join`` builds the paths."""

    @abstractmethod
    def list(self, path: str) -> list[str]:
        """Names (not paths) of the entries directly under ``path``; [] if it does not exist."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete the file or the whole directory tree at ``path``; a symbolic link is
        removed itself, never what it points to, and a tree is removed without following
        the links inside it."""

    @abstractmethod
    def open(self, path: str, mode: str = "rb") -> IO:
        """Open a file for reading or writing (binary or text, as ``mode`` says)."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Size of the file at ``path`` in bytes."""

    @abstractmethod
    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory."""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents; fine if it exists."""

    @abstractmethod
    def dcp_writer(self, path: str) -> StorageWriter:
        """A DCP storage writer for the checkpoint directory ``path``. One that reports the
        size and checksum of the files it wrote (``titan_ckpt.formats.hashing``) spares the
        commit a second read of the step; any other is fine, and its files are read back."""

    @abstractmethod
    def dcp_reader(self, path: str, *, trust_pickles: bool = False) -> StorageReader:
        """A DCP storage reader for the checkpoint directory ``path``; unless
        ``trust_pickles``, it unpickles metadata and records through the allowlist of
        ``titan_ckpt.formats.pickles`` (see ``titan_ckpt.formats.dcp``)."""

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (False on storage without links)."""
        return False

    def join(self, *parts: str) -> str:
        """Join path components with ``/``."""
        return "/".join([p.rstrip("/") for p in parts[:-1]] + [parts[-1]])

    def walk_files(self, path: str) -> list[str]:
        """Every file under ``path``, as paths relative to it with ``/`` separators. A
        symbolic link is listed as an entry of its own and never followed."""
        out: list[str] = []
        for name in sorted(self.list(path)):
            full = self.join(path, name)
            if self.is_dir(full) and not self.is_link(full):
                out.extend(f"{name}/{sub}" for sub in self.walk_files(full))
            else:
                out.append(name)
        return out

    def write_atomic(self, path: str, data: bytes) -> None:
        """Write ``data`` so that readers see the old state or all of it, never a part."""
        with self.open(path, "wb") as f:
            f.write(data)


class LocalStorage(Storage):
    """The local (or network-mounted) filesystem."""

    def list(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def remove(self, path: str) -> None:
        # rmtree removes the links inside a tree without following them; a link itself
        # (to a directory too) is unlinked, never its target emptied.
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def open(self, path: str, mode: str = "rb") -> IO:
        return open(path, mode)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def dcp_writer(self, path: str) -> StorageWriter:
        return HashingFileSystemWriter(path)

    def dcp_reader(self, path: str, *, trust_pickles: bool = False) -> StorageReader:
        return SafeFileSystemReader(path, trust_pickles=trust_pickles)

    def write_atomic(self, path: str, data: bytes) -> None:
        # Write beside the target, flush to disk, then rename: a crash leaves either no file
        # or the complete one, and the directory entry is synced so the rename survives too.
        directory = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class FsspecStorage(Storage):
    """Any fsspec filesystem (``s3://``, ``gs://``, ``memory://``, ...); needs ``fsspec``."""

    def __init__(self, url: str) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError:
            raise ImportError(
                f"checkpoint.folder={url!r} is a URL, which needs fsspec: pip install fsspec "
                "(plus the filesystem's package, e.g. s3fs for s3://)."
            ) from None
        self.fs, _ = url_to_fs(url)
        self.protocol = url.split("://", 1)[0]

    def _url(self, path: str) -> str:
        return path if "://" in path else f"{self.protocol}://{path}"

    def list(self, path: str) -> list[str]:
        if not self.fs.exists(path):
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)]

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def remove(self, path: str) -> None:
        # fsspec's local filesystem unlinks a link and rmtrees a real directory; object
        # stores and memory:// have no links.
        self.fs.rm(path, recursive=True)

    def is_link(self, path: str) -> bool:
        islink = getattr(self.fs, "islink", None)  # only filesystems with links have it
        return bool(islink(path)) if callable(islink) else False

    def open(self, path: str, mode: str = "rb") -> IO:
        return self.fs.open(path, mode)

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def is_dir(self, path: str) -> bool:
        return self.fs.isdir(path)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def write_atomic(self, path: str, data: bytes) -> None:
        # Write a temporary file beside the target, then move it into place: a local or
        # mounted filesystem renames, an object store copies a complete object, which
        # readers also see whole or not at all. A filesystem that cannot move files gets a
        # direct write; a torn file there is caught on read (``read_manifest`` treats a
        # marker that does not parse as no marker).
        directory, slash, name = path.rpartition("/")
        tmp = f"{directory}{slash}.tmp-{uuid.uuid4().hex}-{name}"
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
        except NotImplementedError:
            with self.fs.open(path, "wb") as f:
                f.write(data)
        finally:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)

    def dcp_writer(self, path: str) -> StorageWriter:
        return hashing_fsspec_writer(self._url(path))

    def dcp_reader(self, path: str, *, trust_pickles: bool = False) -> StorageReader:
        return safe_fsspec_reader(self._url(path), trust_pickles=trust_pickles)


class RecordingStorage:
    """``inner``, recording the size and checksum of every file written through ``open(path,
    "wb")`` or ``write_atomic`` (``written``: path -> {"size", <algorithm>}) from the bytes on
    their way out, so the Hugging Face export of a step reaches the manifest unread. A file
    written out of order is left out (read later)."""

    def __init__(self, inner: Storage, *, checksum: str = "auto") -> None:
        self.inner = inner
        self.algorithm = resolve_checksum(checksum)
        self.written: dict[str, dict] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def open(self, path: str, mode: str = "rb") -> IO:
        f = self.inner.open(path, mode)
        if mode != "wb":
            return f
        stream = HashingStream(f, self.algorithm)
        close = stream.close

        def close_and_record() -> None:
            close()
            if (digest := stream.digest()) is not None:
                self.written[path] = digest

        stream.close = close_and_record  # type: ignore[method-assign]
        return stream  # type: ignore[return-value]

    def write_atomic(self, path: str, data: bytes) -> None:
        self.inner.write_atomic(path, data)
        digest = new_hasher(self.algorithm)
        digest.update(data)
        self.written[path] = {"size": len(data), self.algorithm: digest.hexdigest()}

    def written_under(self, directory: str) -> dict[str, dict]:
        """``written`` for the files under ``directory``, by path relative to it."""
        base = self.inner.join(directory, "")
        return {p[len(base) :]: d for p, d in self.written.items() if p.startswith(base)}


def storage_for(path: str) -> Storage:
    """``FsspecStorage`` for a ``scheme://`` URL (``file://`` included), else ``LocalStorage``."""
    return FsspecStorage(path) if "://" in path else LocalStorage()
