"""A step directory of ours stays ours through any crash: a deletion (retention, or a save
replacing an interrupted step) stopped after any number of file removals leaves a directory
that is committed or interrupted, never foreign; a save killed while it writes the owner
marker (only our temporary file in the directory) leaves an interrupted step, which the next
save reclaims. A foreign directory would stop the restarted run before any work.

Crashes are simulated by a local storage that stops (raises) after N removals, for every N a
real deletion takes, on a real committed step with a Hugging Face export beside it.

A deletion removes only what titan wrote and never follows a symbolic link, on local
storage and through fsspec's ``file://``: checked with real links to files outside.
"""

from __future__ import annotations

import logging

import pytest

from titan_ckpt import CheckpointConfig, CheckpointManager, LocalStorage, storage_for
from titan_ckpt.layout import (
    OWNER_MARKER,
    classify_step,
    commit_step,
    read_manifest,
    remove_step,
    scan_steps,
)


class Crash(BaseException):
    """The process died here (not an Exception: nothing may catch it)."""


class DyingStorage(LocalStorage):
    """Local storage that crashes on its ``budget + 1``-th removal."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def remove(self, path: str) -> None:
        if self.budget == 0:
            raise Crash(path)
        self.budget -= 1
        super().remove(path)


def committed_step(common, folder):
    config = CheckpointConfig(enable=True, folder=str(folder), interval=1)
    with CheckpointManager(config, model_parts=common.make_model()) as manager:
        manager.save(1)
    directory = folder / "step-1"
    (directory / "hf").mkdir()  # a subfolder, as an HF export leaves one
    (directory / "hf" / "model.safetensors").write_bytes(b"weights")
    storage = LocalStorage()  # committed again: the export is in the manifest, as a save's is
    commit_step(storage, str(directory), read_manifest(storage, str(directory)))
    return directory


def test_a_deletion_stopped_anywhere_leaves_the_step_ours(common, tmp_path):
    seen = []
    for budget in range(50):  # a deletion of this step takes far fewer removals
        folder = tmp_path / f"crash{budget}"
        directory = committed_step(common, folder)
        try:
            remove_step(DyingStorage(budget), str(directory))
        except Crash:
            kind = classify_step(LocalStorage(), str(directory))
            assert kind in ("committed", "interrupted"), (budget, kind)
            assert not scan_steps(LocalStorage(), str(folder)).foreign
            seen.append(kind)
            continue
        assert not directory.exists()
        break
    # The first removal is the commit marker: from then on the step is not loadable; every
    # later stop (data files, HF export, owner marker, directory) is an interrupted step.
    assert seen[0] == "committed", seen
    assert set(seen[1:]) == {"interrupted"}, seen
    assert len(seen) >= 5, seen


def test_a_save_killed_while_marking_its_directory_is_reclaimed(common, tmp_path):
    # What write_owner leaves when killed before its rename: the directory and our temp file.
    directory = tmp_path / "step-2"
    directory.mkdir(parents=True)
    (directory / f".tmp-abc{OWNER_MARKER}").write_bytes(b'{"format": "tit')
    assert classify_step(LocalStorage(), str(directory)) == "interrupted"
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1)
    with CheckpointManager(config, model_parts=common.make_model()) as manager:
        assert not manager.load()  # nothing committed: a fresh start, not an error
        manager.save(2)
    assert scan_steps(LocalStorage(), str(tmp_path)).committed == [2]


def test_a_file_that_is_not_ours_still_makes_the_directory_foreign(tmp_path):
    directory = tmp_path / "step-3"
    directory.mkdir()
    (directory / ".tmp-x").write_bytes(b"")
    (directory / "notes.txt").write_text("someone else's")
    assert classify_step(LocalStorage(), str(directory)) == "foreign"


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_deletion_never_follows_a_link(common, tmp_path, scheme, caplog):
    target = tmp_path / "outside"
    (target / "sub").mkdir(parents=True)
    (target / "a.bin").write_bytes(b"file outside")
    (target / "sub" / "b.bin").write_bytes(b"folder outside")
    directory = committed_step(common, tmp_path / "ckpt")
    (directory / "to-file").symlink_to(target / "a.bin")
    (directory / "hf" / "to-dir").symlink_to(target / "sub", target_is_directory=True)
    linked = tmp_path / "ckpt" / "step-2"  # a step that is itself a link to a committed step
    linked.symlink_to(committed_step(common, tmp_path / "other"), target_is_directory=True)
    storage = storage_for(f"{scheme}{tmp_path}")
    caplog.set_level(logging.WARNING, logger="titan_ckpt")
    assert remove_step(storage, f"{scheme}{directory}") is False
    assert remove_step(storage, f"{scheme}{linked}") is False
    assert (target / "a.bin").read_bytes() == b"file outside"
    assert (target / "sub" / "b.bin").read_bytes() == b"folder outside"
    left = sorted(p.name for p in directory.rglob("*"))
    assert left == ["hf", OWNER_MARKER, "to-dir", "to-file"]
    assert classify_step(LocalStorage(), str(linked)) == "committed"  # untouched
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2, caplog.text
