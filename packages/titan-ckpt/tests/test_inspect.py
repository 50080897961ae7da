"""``titan-ckpt inspect`` on checkpoints written by CheckpointManager (one process and two
FSDP2 ranks), on a plain DCP directory without a commit marker (as torchtitan writes), and on
safetensors and torch.save files; text and JSON."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt.layout import COMMIT_MARKER

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_folder_lists_steps_committed_or_not(saved_folder, titan_ckpt):
    code, out, _ = titan_ckpt("inspect", saved_folder)
    assert code == 0
    assert "3 step(s)" in out
    assert "step-1" in out
    assert "step-2" in out
    assert "UNCOMMITTED" in out.split("step-3", 1)[1]
    code, out, _ = titan_ckpt("inspect", saved_folder, "--json")
    steps = {s["step"]: s for s in json.loads(out)["steps"]}
    assert steps[2]["committed"]
    assert not steps[3]["committed"]
    assert steps[2]["world_size"] == 1
    assert steps[2]["states"] == ["model", "optimizer", "train_state"]
    assert steps[2]["bytes"] > 0
    assert steps[2]["age_seconds"] >= 0


def test_unreadable_commit_marker_is_not_called_plain_dcp(saved_folder, tmp_path, titan_ckpt):
    # A marker that does not parse makes the step uncommitted; inspect says so, for the step
    # and in the folder's list, instead of taking it for a checkpoint without a marker.
    folder = tmp_path / "ckpt"
    shutil.copytree(saved_folder, folder)
    marker = folder / "step-2" / COMMIT_MARKER
    marker.write_bytes(b"\x00" + marker.read_bytes()[1:])
    code, out, _ = titan_ckpt("inspect", folder / "step-2")
    assert code == 0
    assert "titan commit marker UNREADABLE (" in out
    assert "a run takes this step as an interrupted save" in out
    assert "no titan commit marker" not in out
    code, out, _ = titan_ckpt("inspect", folder / "step-2", "--json")
    report = json.loads(out)
    assert report["manifest"] is None
    assert report["marker_problem"]
    code, out, _ = titan_ckpt("inspect", folder)
    assert "commit marker unreadable" in out.split("step-2", 1)[1].splitlines()[0]
    assert "commit marker unreadable" not in out.split("step-3", 1)[1]  # owner marker only
    steps = {s["step"]: s for s in json.loads(titan_ckpt("inspect", folder, "--json")[1])["steps"]}
    assert steps[2]["marker_problem"]
    assert (steps[1]["marker_problem"], steps[3]["marker_problem"]) == (None, None)


def test_step_text_groups_keys_with_shapes_and_values(saved_folder, titan_ckpt):
    code, out, _ = titan_ckpt("inspect", saved_folder / "step-2")
    assert code == 0
    assert "titan step 2, committed" in out
    assert "model: 6 tensors, 1,732 elements, 6.8 KiB" in out
    assert "0.weight  [32, 16]" in out
    assert "1 shard(s), rank(s) 0" in out
    assert "optimizer.state.4.weight.exp_avg_sq" in out
    assert "optimizer.param_groups.0.weight.lr = 0.01" in out
    assert "train_state.step = 2" in out


def test_step_json_and_stats(saved_folder, titan_ckpt):
    code, out, _ = titan_ckpt("inspect", saved_folder / "step-2", "--json", "--stats")
    assert code == 0
    report = json.loads(out)
    assert report["format"] == "dcp"
    assert report["manifest"]["step"] == 2
    assert list(report["groups"]) == ["model", "optimizer", "train_state"]
    model = {t["key"]: t for t in report["groups"]["model"]["tensors"]}
    w = model["0.weight"]
    assert (w["shape"], w["dtype"], w["bytes"]) == ([32, 16], "float32", 2048)
    assert (w["shards"], w["ranks"], w["files"]) == (1, [0], ["__0_0.distcp"])
    # The statistics are those of the tensor as it was saved.
    saved = dcp_tensor(saved_folder / "step-2", "0.weight", (32, 16))
    assert math.isclose(w["stats"]["std"], float(saved.double().std()), rel_tol=1e-9)
    assert w["stats"]["max"] == float(saved.max())
    assert report["groups"]["train_state"]["objects"] == [{"key": "train_state.step", "value": "2"}]
    assert report["total"]["tensors"] == 6 + 18


def dcp_tensor(path, key, shape):
    out = {key: torch.empty(shape)}
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out[key]


def test_plain_dcp_without_marker_nan_and_inf(tmp_path, titan_ckpt):
    # torchtitan's layout: model FQNs at the top level, states under their names, no marker.
    t = torch.tensor([1.0, float("nan"), float("inf"), -3.0])
    sd = {"tok_embeddings.weight": t, "lr_scheduler": {"last_epoch": 7}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "step-10"), no_dist=True)
    code, out, _ = titan_ckpt("inspect", tmp_path / "step-10", "--stats")
    assert code == 0
    assert "no titan commit marker" in out
    assert "min=-3 max=1 mean=-1 std=2.828 nan=1 inf=1" in out
    assert "lr_scheduler.last_epoch = 7" in out


def test_safetensors_and_torch_files(tmp_path, titan_ckpt):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2, 3, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"))
    code, out, _ = titan_ckpt("inspect", tmp_path / "x.safetensors", "--json")
    assert code == 0
    row = json.loads(out)["groups"]["model"]["tensors"][0]
    assert (row["key"], row["shape"], row["dtype"], row["bytes"]) == ("a", [2, 3], "bfloat16", 12)
    torch.save({"model": {"w": torch.ones(4)}, "step": 3}, tmp_path / "x.pt")
    code, out, _ = titan_ckpt("inspect", tmp_path / "x.pt")
    assert code == 0
    assert "model.w  [4]" in out
    assert "step = 3" in out


@pytest.mark.slow
def test_two_fsdp_ranks_shards_and_ranks(tmp_path, torchrun, results, titan_ckpt):
    folder = tmp_path / "ckpt"
    proc = torchrun("save_sharded.py", 2, str(tmp_path), str(folder))
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = folder / "step-1"
    code, out, _ = titan_ckpt("inspect", step, "--json")
    report = json.loads(out)
    w = {t["key"]: t for t in report["groups"]["model"]["tensors"]}["0.weight"]
    assert (w["shards"], w["ranks"]) == (2, [0, 1])
    assert w["files"] == ["__0_0.distcp", "__1_0.distcp"]
    assert report["manifest"]["world_size"] == 2
    code, out, _ = titan_ckpt("verify", step)
    assert code == 0, out
    # convert reassembles the two ranks' shards into the full tensors.
    code, _, err = titan_ckpt("convert", step, tmp_path / "full.pt", "--to", "torch")
    assert code == 0, err
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    params = results(tmp_path, "sharded", 2)[0]["params"]
    for name, values in params.items():
        assert full[name].flatten().tolist() == values
