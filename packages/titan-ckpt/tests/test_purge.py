"""Retention: keep the newest k committed steps, never touch uncommitted ones, and keep
going when a deletion fails."""

from __future__ import annotations

from titan_ckpt import CheckpointConfig, CheckpointManager, LocalStorage


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
