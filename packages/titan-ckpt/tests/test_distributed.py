"""Real gloo ranks under torchrun with FSDP2: round trips at world 4, 2 and 1, resharding
4 -> 2 -> 1 with bit-identical eval loss, the process-based async writer, and a rank killed
in the middle of a save. Worker scripts live in workers/ and report JSON."""

from __future__ import annotations

import json

import pytest
import torch

from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointManager,
    OptimizerState,
    storage_for,
)
from titan_ckpt.layout import COMMIT_MARKER, scan_steps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def check(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def load_at_world_1(common, folder, data=None):
    """Load a checkpoint into a plain (unsharded) model in this process."""
    model = common.make_model(seed=11)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_state = common.TrainState()
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder)),
        model_parts=[model],
        states={
            "optimizer": OptimizerState(model, opt),
            "train_state": train_state,
            "dataloader": data or common.DataPosition(),
        },
    )
    assert manager.load()
    manager.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran with one thread each; same arithmetic here
    try:
        loss = common.eval_loss(model)
    finally:
        torch.set_num_threads(threads)
    return model, train_state, loss


@pytest.mark.slow
def test_fsdp2_round_trips_crash_and_reshard_4_2_1(common, torchrun, results, tmp_path, entry_of):
    folder = tmp_path / "ckpt"
    proc = torchrun("reshard.py", 4, str(tmp_path), "save", str(folder))
    assert proc.returncode != 0, "rank 1 should have been killed in the save of step 4"
    assert "Signal 9 (SIGKILL)" in proc.stdout + proc.stderr
    saved = results(tmp_path, "save", 4)
    # Round trip at world 4: training moved the weights on, load() brought step 2 back.
    for r in saved:
        assert r["loaded"]
        assert r["loss_after_more_training"] != r["loss"]
        assert r["loss_after_load"] == r["loss"]
        assert r["params_after_load"] == r["params"]
    marker = json.loads((folder / "step-2" / COMMIT_MARKER).read_text())
    assert marker["world_size"] == 4
    assert sorted(marker["files"]) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    for name, info in marker["files"].items():  # each rank hashed its own file
        assert info == entry_of((folder / "step-2" / name).read_bytes())
    # The killed save of step 4: rank 1's data file is there, the step was never committed.
    assert not list(tmp_path.glob("unexpected-*.json"))
    assert (folder / "step-4" / "__1_0.distcp").is_file()
    assert not (folder / "step-4" / COMMIT_MARKER).exists()
    scan = scan_steps(storage_for(str(folder)), str(folder))
    assert (scan.committed, scan.uncommitted) == ([2], [4])

    # World 2 resumes from step 2 (not the half-written step 4), resharded 4 -> 2.
    # (Its dataloader declares supports_resharding.)
    check(torchrun("reshard.py", 2, str(tmp_path), "load", str(folder), str(tmp_path / "async")))
    loaded = results(tmp_path, "load", 2)
    for r in loaded:
        assert r["loaded"]
        assert r["step"] == 2
        assert r["fresh_loss"] != saved[0]["loss"]
        assert r["loss"] == saved[0]["loss"]  # bit-identical
        assert r["params"] == saved[0]["params"]
        assert r["opt"] == saved[0]["opt"]
        # Both async modes wrote what the model held at save time, while training went on.
        for mode in ("async", "async_with_pinned_mem"):
            assert r[mode]["loaded"] == r[mode]["expected"]
            assert r[mode]["loaded_opt"] == r[mode]["expected_opt"]
            assert r[mode]["same_as_torch"]  # the FQN keys reused from the first save
    for mode in ("async", "async_with_pinned_mem"):
        async_folder = str(tmp_path / "async" / mode)
        assert scan_steps(storage_for(async_folder), async_folder).committed == [2, 4]

    # A dataloader that cannot reshard is refused (written by 4 ranks, read by 1).
    with pytest.raises(CheckpointConfigError, match=r"data-parallel degree 4, this run has 1"):
        load_at_world_1(common, folder, common.DataPosition(supports_resharding=False))

    # World 1, no process group, a plain model: 4 -> 1.
    data = common.DataPosition()
    model, train_state, loss = load_at_world_1(common, folder, data)
    assert data.position == 2
    assert train_state.step == 2
    assert loss == saved[0]["loss"]
    assert {k: v.flatten().tolist() for k, v in model.named_parameters()} == saved[0]["params"]
