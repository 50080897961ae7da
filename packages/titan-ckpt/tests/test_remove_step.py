"""A step directory of ours stays ours through any crash: a deletion (retention, or a save
replacing an interrupted step) stopped after any number of file removals leaves a directory
that is committed or interrupted, never foreign; a save killed while it writes the owner
marker (only our temporary file in the directory) leaves an interrupted step, which the next
save reclaims. A foreign directory would stop the restarted run before any work.

Crashes are simulated by a local storage that stops (raises) after N removals, for every N a
real deletion takes, on a real committed step with a Hugging Face export beside it.
"""

from __future__ import annotations

from titan_ckpt import CheckpointConfig, CheckpointManager, LocalStorage
from titan_ckpt.layout import OWNER_MARKER, classify_step, remove_step, scan_steps


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
        assert manager.load() is False  # nothing committed: a fresh start, not an error
        manager.save(2)
    assert scan_steps(LocalStorage(), str(tmp_path)).committed == [2]


def test_a_file_that_is_not_ours_still_makes_the_directory_foreign(tmp_path):
    directory = tmp_path / "step-3"
    directory.mkdir()
    (directory / ".tmp-x").write_bytes(b"")
    (directory / "notes.txt").write_text("someone else's")
    assert classify_step(LocalStorage(), str(directory)) == "foreign"
