"""torchft integration against a real ``torchft.Manager`` (torchft 0.2) and a local lighthouse.

The main test runs two replica groups, each a 1-rank group in its own process
(``workers/ft_replica.py``), against one lighthouse with ``min_replicas=2``: a healthy group
that trained 4 steps and a fresh one. In their common quorum torchft heals the fresh group
from its peer over its HTTP checkpoint transport, using the state-dict callbacks that the
CheckpointManager registered; then both take one step (gradients averaged by torchft's
allreduce), commit it and save. That proves, with torchft's own machinery:

- the recovery state is model, optimizer, LR scheduler and train state, not the dataloader
  (the healed group has its peer's weights, AdamW steps, LR and step count, and its own data
  position);
- only the group at participating rank 0 writes the shared ``step-N`` (each group reports the
  directories DCP wrote for it), which here is the healed one;
- each group writes its own dataloader checkpoint under ``ft-replica-<id>/step-N``, and a
  restarted group resumes the shared state plus its own data position.

Skipped where the optional ``torchft`` extra is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from titan_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    FaultToleranceOptions,
    OptimizerState,
    storage_for,
)
from titan_ckpt.formats.dcp import DcpSource
from titan_ckpt.layout import scan_steps

# torchft 0.2.0 logs through the deprecated Logger.warn; that is its business, not ours.
pytestmark = [
    pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

WORKER = Path(__file__).parent / "workers" / "ft_replica.py"


class Position:
    """A dataloader's position, as a Stateful."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


@pytest.fixture(scope="module")
def torchft():
    return pytest.importorskip("torchft")


@pytest.fixture(scope="module")
def two_groups(torchft, tmp_path_factory):
    """Run the healthy and the recovering replica group; returns (folder, results by role)."""
    from torchft._torchft import LighthouseServer

    out = tmp_path_factory.mktemp("ft")
    folder = out / "ckpt"
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    try:
        # Group 0 starts fresh, group 1 is ahead: group 0 heals from group 1, and (ids sort
        # replica_0 < replica_1) is then participating rank 0, the writer.
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    str(out),
                    str(folder),
                    lighthouse.address(),
                    str(index),
                    role,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for index, role in ((0, "recovering"), (1, "healthy"))
        ]
        logs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        lighthouse.shutdown()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    results = {r: json.loads((out / f"ft-{r}.json").read_text()) for r in ("recovering", "healthy")}
    return folder, results


@pytest.fixture
def manager(torchft):
    """A real torchft Manager: one replica group of one rank, its own local lighthouse."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    mgr = torchft.Manager(
        pg=torchft.ProcessGroupGloo(),
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id="titan-ckpt-test",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse.address(),
        use_async_quorum=False,
        timeout=timedelta(seconds=10),
    )
    yield mgr
    mgr.shutdown()
    lighthouse.shutdown()


@pytest.mark.slow
def test_peer_recovery_carries_everything_but_the_dataloader(two_groups):
    _, results = two_groups
    healed = dict(results["recovering"]["healed"])
    # Right after the quorum, before any step: the peer's weights, bit for bit.
    assert healed.pop("weights") == results["healthy"]["healed"]["weights"]
    assert healed == {
        "train_state_step": 4,
        "lr_last": [0.0025],  # StepLR(step_size=2, gamma=0.5) after 4 steps from 0.01
        "opt_steps": [4] * 6,  # AdamW's step count of each of the 6 parameters
        "data_value": 100,  # its own position, not the peer's 101
    }
    for r in results.values():
        assert (r["committed"], r["step"]) == (True, 5)
    # Same weights after healing plus one averaged step: the peer's, exactly.
    assert results["recovering"]["weights"] == results["healthy"]["weights"]


def test_the_recovery_state_is_registered_with_the_manager(manager, common, tmp_path):
    """What torchft would send a recovering peer (its ``_manager_state_dict``, as its
    checkpoint transport does): our callbacks' state, without the dataloader."""
    model = common.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path)),
        model_parts=model,
        states={
            "optimizer": OptimizerState(model, opt),
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2),
            "dataloader": Position(3),
            "train_state": common.TrainState(),
        },
        ft=FaultToleranceOptions(manager, 0),
    )
    sent = manager._manager_state_dict()["user"]
    assert list(sent) == ["titan_ckpt"]
    assert sorted(sent["titan_ckpt"]) == ["lr_scheduler", "model", "optimizer", "train_state"]
    assert sent["titan_ckpt"]["model"].keys() == model.state_dict().keys()


def test_only_participating_rank_zero_writes_the_shared_checkpoint(two_groups):
    folder, results = two_groups
    writer, other = results["recovering"], results["healthy"]
    assert (writer["participating_rank"], other["participating_rank"]) == (0, 1)
    assert writer["dcp_writes"] == ["ft-replica-0/step-5", "step-5"]
    assert other["dcp_writes"] == ["ft-replica-1/step-5"]
    assert scan_steps(storage_for(str(folder)), str(folder)).committed == [5]
    shared = DcpSource(str(folder / "step-5"))
    assert not any(k.startswith("dataloader") for k in shared.entries)
    stored = shared.read([k for k in writer["weights"]])
    for key, values in writer["weights"].items():
        assert stored[key].flatten().tolist() == values


def test_each_group_keeps_its_own_dataloader_and_resumes_it(two_groups, manager, common):
    folder, _ = two_groups
    for index in (0, 1):
        replica = folder / f"ft-replica-{index}"
        assert scan_steps(storage_for(str(replica)), str(replica)).committed == [5]
        assert DcpSource(str(replica / "step-5")).read(["dataloader.value"]) == {
            "dataloader.value": 100 + index
        }
    # A restarted group 1 (a new torchft Manager) resumes the shared state and its data.
    model, data, train_state = common.make_model(seed=9), Position(), common.TrainState()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    restarted = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder)),
        model_parts=model,
        states={
            "optimizer": OptimizerState(model, opt),
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            "dataloader": data,
            "train_state": train_state,
        },
        ft=FaultToleranceOptions(manager, 1),
    )
    assert restarted.load()
    restarted.close()
    assert (data.value, train_state.step) == (101, 5)
    assert opt.state_dict()["state"][0]["step"].item() == 5


def _group(folder, manager, common, replica_id):
    data = Position(-1)
    checkpointer = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder)),
        model_parts=common.make_model(),
        states={"dataloader": data, "train_state": common.TrainState()},
        ft=FaultToleranceOptions(manager, replica_id),
    )
    return checkpointer, data


def test_a_new_group_takes_the_other_groups_dataloader_state_when_they_agree(
    two_groups, manager, common, tmp_path
):
    """More replica groups on resume: a group with no state of its own merges the others'
    (every key they hold alike); where they disagree there is no exact resume."""
    folder, _ = two_groups
    stranger, data = _group(folder, manager, common, 5)
    with pytest.raises(ValueError, match=r"disagree on 'dataloader.value' \(group 0: 100, group 1"):
        stranger.load()
    assert data.value == -1


def test_a_new_group_goes_on_from_the_only_other_groups_state(
    two_groups, manager, common, tmp_path
):
    # Only group 0 saved step 5 (group 1 was down): a new group 5 goes on from its state.
    folder, _ = two_groups
    alone = tmp_path / "alone"
    shutil.copytree(folder, alone)
    shutil.rmtree(alone / "ft-replica-1")
    stranger, data = _group(alone, manager, common, 5)
    assert stranger.load()
    assert data.value == 100


def test_a_group_without_any_dataloader_state_starts_its_data_over(
    two_groups, manager, common, tmp_path
):
    folder, _ = two_groups
    alone = tmp_path / "alone"
    shutil.copytree(folder, alone)
    for replica in alone.glob("ft-replica-*"):
        shutil.rmtree(replica)
    restarted, data = _group(alone, manager, common, 1)
    assert restarted.load()  # the shared state
    assert data.value == -1  # the data as built


def test_ft_manager_needs_a_replica_id_with_a_dataloader(manager, common, tmp_path):
    with pytest.raises(ValueError, match=r"FaultToleranceOptions\.replica_id is needed"):
        CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path)),
            model_parts=common.make_model(),
            states={"dataloader": Position()},
            ft=FaultToleranceOptions(manager),
        )


def test_without_ft_dataloader_checkpoints_the_dataloader_is_shared(manager, common, tmp_path):
    data = Position(42)
    writer = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path)),
        model_parts=common.make_model(),
        states={"dataloader": data},
        ft=FaultToleranceOptions(manager, dataloader_checkpoints=False),
    )
    manager.start_quorum()  # a quorum of this one group: participating rank 0
    assert manager.participating_rank() == 0
    writer.save(500, force=True)
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-500"]
    data.value = 0
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path)),
        model_parts=common.make_model(),
        states={"dataloader": data},
    )
    assert reader.load()
    assert data.value == 42


def test_a_non_manager_is_refused(common, tmp_path):
    # Something the real manager cannot show: what an object that is not one gets.
    with pytest.raises(TypeError, match=r"without participating_rank\(\)"):
        CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path)),
            model_parts=common.make_model(),
            ft=FaultToleranceOptions(object()),
        )


def test_a_heal_waits_for_an_async_saves_background_copy(manager, common, tmp_path):
    """torchft heals a group by loading a peer's state into its tensors in place. An async
    save's background copy (the model's parameters and the optimizer's state) may still be
    reading them: the heal waits for it, so the step saved holds the values at save()."""
    import threading

    model = common.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    common.train_steps(model, opt, range(1, 3), rank=0)
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode="async")
    ckpt = CheckpointManager(
        config,
        model_parts=model,
        states={"optimizer": OptimizerState(model, opt)},
        ft=FaultToleranceOptions(manager, 0),
    )
    manager.start_quorum()  # a quorum of this one group: participating rank 0, the writer
    assert ckpt.save(1)  # the first save copies everything in save()
    ckpt.wait()
    start = threading.Event()
    finish = ckpt._async._stager._finish

    def late(*args, **kwargs):  # the background copy starts 0.3 s late
        assert start.wait(timeout=60)
        return finish(*args, **kwargs)

    ckpt._async._stager._finish = late
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    peer = common.make_model(seed=7)
    peer_state = {"model": peer.state_dict(), "optimizer": ckpt.states["optimizer"].state_dict()}
    assert ckpt.save(2)
    threading.Timer(0.3, start.set).start()
    ckpt.ft.load_state_dict(peer_state)  # the heal, before the copy began
    assert all(torch.equal(v, peer.state_dict()[k]) for k, v in model.state_dict().items())
    ckpt.close()
    fresh = common.make_model(seed=5)
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path), load_step=2), model_parts=fresh
    )
    assert reader.load()
    assert all(torch.equal(v, at_save[k]) for k, v in fresh.state_dict().items())
