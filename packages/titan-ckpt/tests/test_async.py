"""Async modes in one process (CPU): save returns after staging, the written step holds the
values at save time even if training changes them at once, saves never overlap, close()
drains. The writer process of async_with_pinned_mem is exercised in test_distributed.py."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointManager, scan_steps, storage_for
from titan_ckpt.asyncmode import check_main_guard

# DCP's background writer warns that it runs without torch.distributed: in one process, it does.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_async_save_keeps_values_at_save_time(common, tmp_path, mode, caplog):
    model = common.make_model()
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode=mode)
    with caplog.at_level(logging.INFO, logger="titan_ckpt"):
        manager = CheckpointManager(config, model_parts=model)
    if mode == "async_with_pinned_mem":
        assert "nothing to pin" in caplog.text
    snapshots = {}
    for step in (1, 2, 3):
        assert manager.save(step)  # the previous save is finished (and committed) first
        snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
        manager.maybe_wait_for_staging()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0)  # training moves on while the write runs
    manager.close()
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == [1, 2, 3]

    for step in (1, 3):
        fresh = common.make_model(seed=5)
        reader = CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path), load_step=step),
            model_parts=fresh,
        )
        assert reader.load()
        assert all(torch.equal(v, snapshots[step][k]) for k, v in fresh.state_dict().items())


def test_last_step_save_is_synchronous(common, tmp_path):
    model = common.make_model()
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=10, async_mode="async")
    manager = CheckpointManager(config, model_parts=model)
    manager.save(7, last_step=True)
    # Committed on return, without close(): the last save does not run in the background.
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == [7]
    manager.close()


def test_main_guard_check_refuses_unguarded_script(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("import torch\nprint('training')\n")
    fake_main = types.ModuleType("__main__")
    fake_main.__file__ = str(script)
    fake_main.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    with pytest.raises(RuntimeError, match=r"train.py; that script has no `if __name__"):
        check_main_guard()
    script.write_text("def main():\n    pass\n\nif __name__ == '__main__':\n    main()\n")
    check_main_guard()


def test_too_little_shared_memory_for_pinned_staging_is_one_clear_error(
    common, tmp_path, monkeypatch
):
    """async_with_pinned_mem stages each rank's state in /dev/shm; a container's 64 MiB
    default used to fail with a bus error mid-copy. The first save checks the space this
    node's ranks need and raises DiskFullError with the fix; nothing is committed."""
    import shutil
    from collections import namedtuple

    from titan_ckpt import DiskFullError, asyncmode

    if not __import__("os").path.isdir(asyncmode.SHARED_MEMORY):
        pytest.skip("no /dev/shm here")
    usage = namedtuple("usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(
        asyncmode.shutil,
        "disk_usage",
        lambda path: (
            usage(64 * 2**20, 64 * 2**20 - 100, 100)
            if path == asyncmode.SHARED_MEMORY
            else real(path)
        ),
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    model = common.make_model()
    config = CheckpointConfig(
        enable=True, folder=str(tmp_path), interval=1, async_mode="async_with_pinned_mem"
    )
    manager = CheckpointManager(config, model_parts=model)
    state_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    with pytest.raises(DiskFullError, match="this node's 4 rank") as error:
        manager.save(1)
    assert error.value.needed == 4 * state_bytes
    assert "docker run --shm-size" in str(error.value)
    manager.close()
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == []
