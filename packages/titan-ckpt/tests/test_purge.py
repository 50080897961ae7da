"""Retention: keep the newest k committed steps, never touch uncommitted ones, and keep
going when a deletion fails. Deletion stays inside the folder: checked with real symbolic
links on disk (a step that is one, links inside a step), whose targets must come out
byte-identical, and a step without our owner marker, which must stay."""

from __future__ import annotations

import logging
import os
import shutil

from titan_ckpt import CheckpointConfig, CheckpointManager, LocalStorage
from titan_ckpt.layout import OWNER_MARKER


class StubbornStorage(LocalStorage):
    """Local storage on which one step directory cannot be deleted."""

    def __init__(self, undeletable: str) -> None:
        self.undeletable = undeletable

    def remove(self, path: str) -> None:
        if self.undeletable in path:
            raise PermissionError(f"cannot delete {path}")
        super().remove(path)


def names(folder):
    return sorted(p.name for p in folder.iterdir())


def run(common, folder, steps, storage=None, keep=2):
    config = CheckpointConfig(enable=True, folder=str(folder), interval=1, keep_latest_k=keep)
    manager = CheckpointManager(config, model_parts=common.make_model(), storage=storage)
    for step in steps:
        manager.save(step)
    manager.close()  # drains pending deletions
    return manager


def test_keeps_latest_k_committed_and_leaves_uncommitted(common, tmp_path):
    (tmp_path / "step-0").mkdir(parents=True)  # a crashed save: no commit marker
    (tmp_path / "step-0" / "__0_0.distcp").write_bytes(b"partial")
    run(common, tmp_path, range(1, 6), keep=3)
    assert names(tmp_path) == ["step-0", "step-3", "step-4", "step-5"]


def test_keep_zero_keeps_everything(common, tmp_path):
    run(common, tmp_path, range(1, 5), keep=0)
    assert names(tmp_path) == ["step-1", "step-2", "step-3", "step-4"]


def test_failed_deletion_is_logged_and_purging_goes_on(common, tmp_path, caplog):
    run(common, tmp_path, range(1, 6), storage=StubbornStorage("step-2"))
    # step-2 could not be deleted (nor its marker): it stays committed; every later pass ran.
    assert names(tmp_path) == ["step-2", "step-4", "step-5"]
    assert "Could not delete checkpoint" in caplog.text
    assert "step-2" in caplog.text
    run(common, tmp_path, range(6, 8), storage=LocalStorage())
    assert names(tmp_path) == ["step-6", "step-7"]


def snapshot(root) -> dict[str, bytes]:
    """Every file under ``root`` (not following links) by relative path, with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def outside(tmp_path):
    """A folder outside the checkpoint folder with a file and a subfolder: a link's target."""
    target = tmp_path / "outside"
    (target / "sub").mkdir(parents=True)
    (target / "data.bin").write_bytes(os.urandom(64))
    (target / "sub" / "more.bin").write_bytes(os.urandom(64))
    return target


def warnings_about(caplog, path) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and str(path) in r.getMessage()
    ]


def test_a_step_that_is_a_symlink_is_never_deleted_through(common, tmp_path, caplog):
    folder = tmp_path / "ckpt"
    run(common, folder, [1])
    # step-1 archived elsewhere and linked back: a committed step, seen through the link.
    archive = tmp_path / "archive"
    archive.mkdir()
    shutil.move(folder / "step-1", archive / "step-1")
    (archive / "step-1" / "notes.txt").write_text("the archive's own file")
    (folder / "step-1").symlink_to(archive / "step-1", target_is_directory=True)
    before = snapshot(archive)
    run(common, folder, range(2, 6))  # four purge passes, each with step-1 beyond keep=2
    assert snapshot(archive) == before
    assert (folder / "step-1").is_symlink()
    assert names(folder) == ["step-1", "step-4", "step-5"]
    assert len(warnings_about(caplog, folder / "step-1")) == 1, caplog.text
    assert "symbolic link" in warnings_about(caplog, folder / "step-1")[0]


def test_links_inside_a_step_are_left_with_their_targets(common, tmp_path, caplog):
    folder = tmp_path / "ckpt"
    run(common, folder, [1])
    target = outside(tmp_path)
    (folder / "step-1" / "to-file").symlink_to(target / "data.bin")
    (folder / "step-1" / "to-dir").symlink_to(target / "sub", target_is_directory=True)
    before = snapshot(target)
    run(common, folder, range(2, 5))
    assert snapshot(target) == before
    # The step's own files went; the links stay, in a directory that is no longer loadable.
    assert sorted(p.name for p in (folder / "step-1").iterdir()) == [
        OWNER_MARKER,
        "to-dir",
        "to-file",
    ]
    assert names(folder) == ["step-1", "step-3", "step-4"]
    (message,) = warnings_about(caplog, folder / "step-1")
    assert "to-dir" in message
    assert "to-file" in message


def test_a_step_without_our_owner_marker_is_never_deleted(common, tmp_path, caplog):
    run(common, tmp_path, [1])
    (tmp_path / "step-1" / OWNER_MARKER).unlink()
    before = snapshot(tmp_path / "step-1")
    run(common, tmp_path, range(2, 5))
    assert snapshot(tmp_path / "step-1") == before
    assert names(tmp_path) == ["step-1", "step-3", "step-4"]
    (message,) = warnings_about(caplog, tmp_path / "step-1")
    assert OWNER_MARKER in message
