"""The manifest in the commit marker: damaged files are found by name before any tensor is
read, sizes always and checksums on request; the model is left as it was."""

from __future__ import annotations

import json

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointIntegrityError, CheckpointManager
from titan_ckpt.layout import COMMIT_MARKER


def saved_run(common, folder, **config):
    model = common.make_model()
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=1, **config), model_parts=model
    )
    manager.save(1)
    manager.close()
    fresh = common.make_model(seed=3)
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), **config), model_parts=fresh
    )
    return fresh, reader


def test_manifest_lists_sizes_and_checksums(common, tmp_path, entry_of):
    saved_run(common, tmp_path)
    marker = json.loads((tmp_path / "step-1" / COMMIT_MARKER).read_text())
    for name, info in marker["files"].items():
        assert info == entry_of((tmp_path / "step-1" / name).read_bytes())


def test_truncated_file_is_reported_by_name(common, tmp_path):
    fresh, reader = saved_run(common, tmp_path)
    data = tmp_path / "step-1" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:-10])
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointIntegrityError, match=r"__0_0.distcp: \d+ bytes, the manifest"):
        reader.load()
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_flipped_byte_is_found_by_checksum(common, tmp_path):
    _fresh, reader = saved_run(common, tmp_path)
    data = tmp_path / "step-1" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointIntegrityError, match=r"__0_0.distcp: (sha256|xxh3_128) differs"):
        reader.load(verify_checksums=True)
    _, strict_reader = saved_run(common, tmp_path / "again", verify_checksums=True)
    again = tmp_path / "again" / "step-1" / ".metadata"
    raw = bytearray(again.read_bytes())
    raw[-1] ^= 0x01
    again.write_bytes(bytes(raw))
    with pytest.raises(CheckpointIntegrityError, match=r"\.metadata: (sha256|xxh3_128) differs"):
        strict_reader.load()


def test_missing_file_is_reported(common, tmp_path):
    _, reader = saved_run(common, tmp_path)
    (tmp_path / "step-1" / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"__0_0.distcp: missing"):
        reader.load()
