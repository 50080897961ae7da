"""A checkpoint folder no save could write is refused when the manager is built, with one
``CheckpointConfigError``: a path through a file, a read-only filesystem (a real read-only
tmpfs where this process may mount one), a URL whose fsspec filesystem is not installed."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
import torch

from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointManager,
    check_folder_writable,
)


def build(folder: str, **config) -> CheckpointManager:
    cfg = CheckpointConfig(enable=True, folder=folder, **config)
    return CheckpointManager(cfg, model_parts=torch.nn.Linear(2, 2))


def test_a_path_through_a_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("not a folder")
    folder = str(tmp_path / "notes.txt" / "ckpt")
    with pytest.raises(CheckpointConfigError, match=r"notes.txt is a file, not a directory"):
        build(folder)
    with pytest.raises(CheckpointConfigError, match="cannot be used as a folder"):
        build(str(tmp_path / "notes.txt"))


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only folder: a read-only tmpfs as root, else a folder without write permission."""
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() == 0:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)],
            capture_output=True,
        )
        if mounted.returncode != 0:
            pytest.skip("root, but cannot mount a read-only tmpfs here")
        yield where, "read-only filesystem"
        subprocess.run(["umount", "-l", str(where)], check=False)
    else:
        where.chmod(0o555)
        yield where, "not writable by this user"
        where.chmod(0o755)


def test_a_read_only_folder_is_refused_before_any_work(read_only_dir):
    where, why = read_only_dir
    with pytest.raises(CheckpointConfigError, match=f"its parent {where} is .*{why}"):
        build(str(where / "ckpt"))
    with pytest.raises(CheckpointConfigError, match=why):
        build(str(where))
    # Reading needs no write access.
    assert not build(str(where), load_only=True).load()


def test_a_url_without_its_filesystem_package_is_refused():
    pytest.importorskip("fsspec")
    with pytest.raises(CheckpointConfigError, match=r"nosuchfs:// URL.*Install fsspec"):
        build("nosuchfs://bucket/ckpt")
    if importlib.util.find_spec("s3fs") is None:
        with pytest.raises(CheckpointConfigError, match=r"s3:// URL.*s3fs"):
            check_folder_writable(CheckpointConfig(enable=True, folder="s3://bucket/ckpt"))


def test_a_writable_folder_passes_and_is_not_created(tmp_path):
    folder = tmp_path / "new" / "ckpt"
    check_folder_writable(CheckpointConfig(enable=True, folder=str(folder)))
    check_folder_writable(CheckpointConfig(enable=True, folder=f"file://{folder}"))
    assert not (tmp_path / "new").exists()


def test_a_start_point_that_does_not_exist_is_refused_before_any_work(tmp_path):
    # The same decision the load takes, without a model: a trainer runs it first.
    from titan_ckpt import check_folder_contents

    folder = tmp_path / "ckpt"
    missing = tmp_path / "no-such-checkpoint"
    with pytest.raises(CheckpointConfigError, match=r"initial_load_path=.*does not exist"):
        check_folder_contents(
            CheckpointConfig(enable=True, folder=str(folder), initial_load_path=str(missing))
        )
    with pytest.raises(CheckpointConfigError, match=r"load_step=3, but .* holds no committed"):
        check_folder_contents(CheckpointConfig(enable=True, folder=str(folder), load_step=3))
    manager = build(str(folder))
    manager.save(2, force=True)
    manager.close()
    with pytest.raises(CheckpointConfigError, match=r"load_step=3 is not a committed .*\[2\]"):
        check_folder_contents(CheckpointConfig(enable=True, folder=str(folder), load_step=3))
    # A folder with a committed step resumes from it: initial_load_path is not consulted.
    check_folder_contents(
        CheckpointConfig(enable=True, folder=str(folder), initial_load_path=str(missing))
    )
    assert not missing.exists()
