"""``titan-ckpt verify`` on intact and damaged copies of a CheckpointManager step: a truncated
data file, a flipped byte, a missing shard file and a missing ``.metadata``, each with and
without the titan markers; the verdict names the file (and keys) and sets the exit code. A step
of ours whose save never committed is not OK."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt.layout import COMMIT_MARKER, OWNER_MARKER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DATA = "__0_0.distcp"


@pytest.fixture(params=["titan", "plain"])
def step(request, saved_folder, tmp_path):
    """A fresh copy of step-2; "plain" drops titan's markers (a torchtitan-style DCP dir)."""
    copy = tmp_path / "step-2"
    shutil.copytree(saved_folder / "step-2", copy)
    if request.param == "plain":
        (copy / COMMIT_MARKER).unlink()
        (copy / OWNER_MARKER).unlink()
    return copy


def test_intact_step_and_folder(step, saved_folder, titan_ckpt):
    code, out, _ = titan_ckpt("verify", step)
    assert code == 0, out
    assert out.startswith("OK: ")
    if not (step / COMMIT_MARKER).exists():
        assert "no titan manifest: checked metadata and readability only" in out
    code, out, _ = titan_ckpt("verify", saved_folder, "--json")
    report = json.loads(out)
    assert code == 0
    assert report["ok"]
    assert [os.path.basename(s["path"]) for s in report["steps"]] == ["step-1", "step-2"]
    assert report["notes"] == ["step-3: uncommitted (interrupted or in progress), not checked"]


def test_truncated_file(step, titan_ckpt):
    data = step / DATA
    os.truncate(data, data.stat().st_size - 100)
    code, out, _ = titan_ckpt("verify", step)
    assert code == 1
    assert "DAMAGED" in out
    assert f"{DATA}: truncated" in out  # the shard bounds check, with or without a marker
    assert "optimizer.state.4.bias.exp_avg_sq" in out or "train_state.step" in out


def test_flipped_byte(step, titan_ckpt):
    # Flip one bit inside the raw bytes of tensor 0.weight (found by its saved value).
    data = step / DATA
    raw = bytearray(data.read_bytes())
    saved = {"0.weight": torch.empty(32, 16)}
    dcp.load(saved, checkpoint_id=str(step), no_dist=True)
    at = raw.find(saved["0.weight"].numpy().tobytes())
    assert at > 0
    raw[at + 100] ^= 0x01
    data.write_bytes(bytes(raw))
    code, out, _ = titan_ckpt("verify", step)
    if (step / COMMIT_MARKER).exists():
        assert code == 1
        assert re.search(f"{DATA}: (sha256|xxh3_128) differs from the manifest", out)
    else:
        # Without a manifest a flipped bit inside raw tensor bytes still loads: verify cannot
        # tell, and says what it checked.
        assert code == 0
        assert "no titan manifest: checked metadata and readability only" in out


def test_flipped_byte_in_metadata_plain(step, titan_ckpt):
    meta = step / ".metadata"
    raw = bytearray(meta.read_bytes())
    raw[len(raw) // 3 : len(raw) // 3 + 8] = b"\xff" * 8
    meta.write_bytes(bytes(raw))
    code, out, _ = titan_ckpt("verify", step)
    assert code == 1
    assert ".metadata" in out


def test_missing_shard_file(step, titan_ckpt):
    (step / DATA).unlink()
    code, out, _ = titan_ckpt("verify", step, "--json")
    report = json.loads(out)
    assert code == 1
    assert not report["ok"]
    assert any(p.startswith(f"{DATA}: missing") for p in report["problems"])
    assert any("0.weight" in p for p in report["problems"])


def test_missing_metadata(step, titan_ckpt):
    (step / ".metadata").unlink()
    code, out, _ = titan_ckpt("verify", step)
    assert code == 1
    assert ".metadata: missing" in out


def test_unparsable_commit_marker_is_reported(saved_folder, tmp_path, titan_ckpt):
    # A marker that does not parse makes the step uncommitted: a run neither loads it nor
    # keeps it. verify must say so, for the step and for its folder, not call it intact.
    folder = tmp_path / "ckpt"
    shutil.copytree(saved_folder, folder)
    marker = folder / "step-2" / COMMIT_MARKER
    marker.write_bytes(marker.read_bytes()[:-40])  # torn
    code, out, _ = titan_ckpt("verify", folder / "step-2")
    assert code == 1
    assert f"{COMMIT_MARKER}: unreadable" in out
    assert "takes this step as an interrupted save" in out
    code, out, _ = titan_ckpt("verify", folder, "--json")
    report = json.loads(out)
    assert code == 1
    assert [os.path.basename(s["path"]) for s in report["steps"]] == ["step-1", "step-2"]
    assert [s["ok"] for s in report["steps"]] == [True, False]
    assert report["problems"][0].startswith(f"step-2: {COMMIT_MARKER}: unreadable")
    # step-3 holds only the owner marker: an interrupted save, a note and not a problem.
    assert report["notes"] == ["step-3: uncommitted (interrupted or in progress), not checked"]


def test_a_step_whose_save_never_committed_is_not_ok(saved_folder, tmp_path, titan_ckpt):
    # Every file of the save written (.metadata included), then killed before the commit.
    step = tmp_path / "step-2"
    shutil.copytree(saved_folder / "step-2", step)
    (step / COMMIT_MARKER).unlink()
    code, out, _ = titan_ckpt("verify", step)
    assert code == 1
    assert out.splitlines()[:2] == [
        f"UNCOMMITTED: {step}",
        f"  not loadable: no commit marker ({COMMIT_MARKER}) beside titan's {OWNER_MARKER}: the "
        "save of this step was interrupted or is still in progress, so a run will not load it",
    ]
    code, out, _ = titan_ckpt("verify", step, "--json")
    report = json.loads(out)
    assert code == 1
    assert (report["ok"], report["uncommitted"]) == (False, True)
    # Only the owner marker (the save killed before DCP wrote anything): the same.
    only_owner = tmp_path / "step-4"
    only_owner.mkdir()
    shutil.copy(step / OWNER_MARKER, only_owner)
    code, out, _ = titan_ckpt("verify", only_owner)
    assert code == 1
    assert out.startswith("UNCOMMITTED: ")


def test_shards_must_cover_each_tensor_once(tmp_path, titan_ckpt):
    # Drop one chunk of a tensor from the metadata, as a lost rank's entries would be.
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path / "s"), no_dist=True)
    meta_path = tmp_path / "s" / ".metadata"
    with open(meta_path, "rb") as f:
        import pickle

        meta = pickle.load(f)
    chunk = meta.state_dict_metadata["w"].chunks[0]
    half = type(chunk)(offsets=torch.Size([0]), sizes=torch.Size([3]))
    meta.state_dict_metadata["w"].chunks = [half]
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)
    code, out, _ = titan_ckpt("verify", tmp_path / "s")
    assert code == 1
    assert "w: shards cover 3 of 6 elements" in out
