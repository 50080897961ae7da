"""The storage seam: an fsspec URL works end to end like a local path."""

from __future__ import annotations

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointManager, FsspecStorage, scan_steps, storage_for

pytest.importorskip("fsspec")


def test_fsspec_url_round_trip_with_retention(common, tmp_path):
    url = f"file://{tmp_path}/ckpt"
    assert isinstance(storage_for(url), FsspecStorage)
    model = common.make_model()
    config = CheckpointConfig(enable=True, folder=url, interval=1, keep_latest_k=2)
    manager = CheckpointManager(config, model_parts=model)
    for step in (1, 2, 3):
        manager.save(step)
    manager.close()
    assert scan_steps(storage_for(url), url).committed == [2, 3]
    assert (tmp_path / "ckpt" / "step-3" / "titan-commit.json").is_file()

    fresh = common.make_model(seed=8)
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=url, verify_checksums=True), model_parts=fresh
    )
    assert reader.load()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())
