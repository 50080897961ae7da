"""A small disk for disk-full tests: a real tmpfs where this process may mount one (root),
else a local folder behind a ``Storage`` that fails writes with ENOSPC beyond a quota.

Imported by path (``load_small_disk`` in the tests), like ``common.py``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from titan_ckpt import LocalStorage


def _used(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _check(root: Path, quota: int, adding: int) -> None:
    if _used(root) + adding > quota:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _QuotaStream:
    def __init__(self, stream, root: Path, quota: int) -> None:
        self._stream, self._root, self._quota = stream, root, quota

    def write(self, data) -> int:
        _check(self._root, self._quota, len(memoryview(data).cast("B")))
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class _QuotaFileSystem(FileSystem):
    def __init__(self, root: Path, quota: int) -> None:
        self.root, self.quota = root, quota

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            yield _QuotaStream(stream, self.root, self.quota) if "w" in mode else stream


class QuotaStorage(LocalStorage):
    """Local storage under ``root`` that holds at most ``quota`` bytes of files."""

    def __init__(self, root: Path, quota: int) -> None:
        self.root, self.quota = root, quota

    def free_bytes(self, path: str) -> int:
        return max(0, self.quota - _used(self.root))

    def dcp_writer(self, path: str):
        writer = FileSystemWriter(path)
        writer.fs = _QuotaFileSystem(self.root, self.quota)
        return writer

    def write_atomic(self, path: str, data: bytes) -> None:
        _check(self.root, self.quota, len(data))
        super().write_atomic(path, data)


class SmallDisk:
    """A folder on a filesystem of ``size`` bytes (``path``); ``storage`` is None on a real
    tmpfs, else the ``QuotaStorage`` to hand the manager."""

    def __init__(self, path: Path, size: int, mounted: bool) -> None:
        self.path, self.mounted = path, mounted
        self.storage = None if mounted else QuotaStorage(path, size)

    def grow(self, size: int) -> None:
        """Make the filesystem ``size`` bytes (the files stay)."""
        if self.mounted:
            subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)
        else:
            self.storage.quota = size


@contextlib.contextmanager
def small_disk(where: Path, size: int) -> Iterator[SmallDisk]:
    """A ``SmallDisk`` at ``where``: a mounted tmpfs where permitted, else a quota storage."""
    where.mkdir(parents=True, exist_ok=True)
    # TITAN_TEST_NO_MOUNT=1 takes the fallback even where mounting works (to test it).
    mounted = (
        shutil.which("mount") is not None
        and not os.environ.get("TITAN_TEST_NO_MOUNT")
        and (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                capture_output=True,
            ).returncode
            == 0
        )
    )
    try:
        yield SmallDisk(where, size, mounted)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)
