"""A save into a full filesystem: one ``DiskFullError`` naming path, bytes needed and free;
the partial step removed, committed steps verified intact, and a rerun resumes from them.

Checked against a real small filesystem (a tmpfs, mounted where this process may, as root
on CI machines), where torch reports the full disk as ``unexpected pos`` from its zip
writer; elsewhere against a quota storage that raises ENOSPC.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointWriteError,
    DiskFullError,
    LocalStorage,
)
from titan_ckpt.layout import COMMIT_MARKER, OWNER_MARKER, read_manifest, scan_steps, verify_step
from titan_ckpt.space import state_bytes

_spec = importlib.util.spec_from_file_location(
    "titan_ckpt_test_small_disk", Path(__file__).parent / "workers" / "small_disk.py"
)
small_disk_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(small_disk_module)

STEP = 256 * 256 * 4 + 256 * 4
"""Bytes of the model's tensors: one Linear(256, 256) in fp32."""
DISK = 700 * 1024
"""Room for two steps (data plus DCP metadata and the commit marker), not three."""


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(256, 256)


@pytest.fixture
def disk(tmp_path):
    with small_disk_module.small_disk(tmp_path / "disk", DISK) as d:
        yield d


def manager(disk, model, **config) -> CheckpointManager:
    settings = {"interval": 1, "keep_latest_k": 0, **config}
    cfg = CheckpointConfig(enable=True, folder=str(disk.path / "ckpt"), **settings)
    return CheckpointManager(cfg, model_parts=model, storage=disk.storage)


def check_intact(disk, committed: list[int]) -> None:
    storage = disk.storage or LocalStorage()
    folder = str(disk.path / "ckpt")
    assert scan_steps(storage, folder).committed == committed
    assert sorted(p.name for p in (disk.path / "ckpt").iterdir()) == [
        f"step-{s}" for s in committed
    ]
    for step in committed:
        directory = f"{folder}/step-{step}"
        verify_step(storage, directory, read_manifest(storage, directory), checksums=True)


def test_sync_save_fails_with_one_message_and_a_rerun_resumes(disk):
    model = make_model()
    with manager(disk, model) as m:
        assert m.save(1)
        assert m.save(2)
        with torch.no_grad():
            model.weight.add_(1.0)
        with pytest.raises(DiskFullError) as caught:
            m.save(3)
    error = caught.value
    step3 = str(disk.path / "ckpt" / "step-3")
    assert error.path == step3
    assert error.needed == STEP == state_bytes(make_model().state_dict())
    assert 0 < error.free < STEP
    text = str(error)
    assert f"the disk is full at {step3}" in text
    assert f"{STEP:,} bytes" in text
    assert f"{error.free:,} bytes" in text
    assert "Committed steps [1, 2] are intact; a rerun resumes from step 2" in text
    assert "inline_container" not in text
    check_intact(disk, [1, 2])

    # The rerun, with room again, resumes from step 2 and saves on.
    disk.grow(4 << 20)
    fresh = make_model(seed=5)
    with manager(disk, fresh) as m:
        assert m.load()
        assert m.last_loaded_step == 2
        assert torch.equal(fresh.weight, make_model().weight)
        assert m.save(3)
    check_intact(disk, [1, 2, 3])


def test_async_failure_surfaces_at_the_next_save_with_the_same_message(disk):
    model = make_model()
    with manager(disk, model, async_mode="async") as m:
        m.save(1)
        m.save(2)
        m.save(3)  # written in the background: it fails there
        with pytest.raises(DiskFullError) as caught:
            m.save(4)  # waits for step 3 first
        assert caught.value.path == str(disk.path / "ckpt" / "step-3")
        assert caught.value.needed == STEP
        assert "Committed steps [1, 2] are intact" in str(caught.value)
        m.close()  # nothing in flight any more: closes cleanly
    check_intact(disk, [1, 2])


def test_async_failure_surfaces_at_close(disk):
    m = manager(disk, make_model(), async_mode="async")
    m.save(1)
    m.save(2)
    m.save(3)
    with pytest.raises(DiskFullError, match="step 3 failed: the disk is full"):
        m.close()
    check_intact(disk, [1, 2])


def test_first_save_warns_once_when_two_steps_do_not_fit(tmp_path, caplog):
    with small_disk_module.small_disk(tmp_path / "disk", 400 * 1024) as d:
        with caplog.at_level(logging.WARNING, logger="titan_ckpt"), manager(d, make_model()) as m:
            m.save(1)
        warnings = [r.getMessage() for r in caplog.records if "fewer than two steps" in r.message]
        assert len(warnings) == 1
        assert f"{STEP:,} bytes" in warnings[0]
        check_intact(d, [1])


def test_no_warning_when_two_steps_fit(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="titan_ckpt"):
        cfg = CheckpointConfig(enable=True, folder=str(tmp_path / "ckpt"), interval=1)
        with CheckpointManager(cfg, model_parts=make_model()) as m:
            m.save(1)
    assert not [r for r in caplog.records if "fewer than two steps" in r.message]


class FailingStorage(LocalStorage):
    """Local storage whose write of ``marker`` (by default the commit marker, written after
    DCP's files) fails with ``code``."""

    def __init__(self, code: int, marker: str = COMMIT_MARKER) -> None:
        self.code, self.marker = code, marker

    def write_atomic(self, path: str, data: bytes) -> None:
        if path.endswith(self.marker):
            raise OSError(self.code, "injected")
        super().write_atomic(path, data)


def test_a_full_disk_at_the_commit_marker_is_reported_the_same(tmp_path):
    cfg = CheckpointConfig(enable=True, folder=str(tmp_path / "ckpt"), interval=1)
    storage = FailingStorage(errno.ENOSPC)
    with CheckpointManager(cfg, model_parts=make_model(), storage=storage) as m:  # noqa: SIM117
        with pytest.raises(DiskFullError, match="No step of this run is committed yet"):
            m.save(1)
    assert not (tmp_path / "ckpt" / "step-1").exists()


def test_a_full_disk_at_the_first_file_of_a_step_is_reported_the_same(tmp_path):
    # The owner marker is the first file of a step: a disk already full fails there.
    storage = FailingStorage(errno.ENOSPC, OWNER_MARKER)
    for mode in ("disabled", "async"):
        cfg = CheckpointConfig(
            enable=True, folder=str(tmp_path / "ckpt"), interval=1, async_mode=mode
        )
        with CheckpointManager(cfg, model_parts=make_model(), storage=storage) as m:  # noqa: SIM117
            with pytest.raises(DiskFullError, match=r"the disk is full at .*step-1") as caught:
                m.save(1)
        assert caught.value.needed == STEP
        assert not (tmp_path / "ckpt" / "step-1").exists()


def test_other_write_errors_name_the_path_and_cause(tmp_path):
    cfg = CheckpointConfig(enable=True, folder=str(tmp_path / "ckpt"), interval=1)
    storage = FailingStorage(errno.EIO)
    with CheckpointManager(cfg, model_parts=make_model(), storage=storage) as m:  # noqa: SIM117
        with pytest.raises(CheckpointWriteError) as caught:
            m.save(1)
    assert not isinstance(caught.value, DiskFullError)
    assert str(tmp_path / "ckpt" / "step-1") in str(caught.value)
    assert "OSError: [Errno 5] injected" in str(caught.value)
    assert not (tmp_path / "ckpt" / "step-1").exists()


def test_vanished_folder_is_recreated_by_the_next_save(tmp_path, caplog):
    import shutil

    folder = tmp_path / "ckpt"
    cfg = CheckpointConfig(enable=True, folder=str(folder), interval=1, keep_latest_k=0)
    with CheckpointManager(cfg, model_parts=make_model()) as m:
        m.save(1)
        shutil.rmtree(folder)
        with caplog.at_level(logging.WARNING, logger="titan_ckpt"):
            m.save(2)
    assert any("vanished since the last save" in r.message for r in caplog.records)
    assert scan_steps(LocalStorage(), str(folder)).committed == [2]


@pytest.mark.slow
def test_two_ranks_raise_the_same_error_in_both_modes(torchrun, results, tmp_path):
    with small_disk_module.small_disk(tmp_path / "disk", DISK) as d:
        quota = 0 if d.storage is None else DISK
        proc = torchrun("disk_full.py", 2, str(tmp_path), str(d.path), str(quota))
        assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = results(tmp_path, "disk_full", 2)
    for mode, failed_at in (("disabled", 3), ("async", 4)):
        first, second = ranks[0][mode], ranks[1][mode]
        assert first == second  # every rank raises rank 0's one error
        assert first["type"] == "DiskFullError"
        assert first["step"] == failed_at  # async: raised by the save after the failed one
        assert first["path"] == str(d.path / mode / "step-3")
        assert f"about {STEP // 1024}.0 KiB ({STEP:,} bytes)" in first["message"]
        assert first["committed"] == ["step-1", "step-2"]
