"""The storage seam: an fsspec URL works end to end like a local path; a removal never
follows a symbolic link."""

from __future__ import annotations

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointManager, FsspecStorage, LocalStorage, storage_for
from titan_ckpt.layout import scan_steps

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


def test_local_remove_unlinks_a_link_and_never_empties_its_target(tmp_path):
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "a.bin").write_bytes(b"kept")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    tree = tmp_path / "tree"  # a real directory holding a link to the target
    tree.mkdir()
    (tree / "inner").symlink_to(target, target_is_directory=True)
    storage = LocalStorage()
    assert storage.is_link(str(link))
    storage.remove(str(link))
    storage.remove(str(tree))
    assert not link.is_symlink()
    assert not tree.exists()
    assert (target / "sub" / "a.bin").read_bytes() == b"kept"
