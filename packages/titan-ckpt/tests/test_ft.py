"""torchft hooks, with a stand-in for torchft's Manager (its two methods the manager calls):
one replica group writes the shared checkpoint, every group its own dataloader state, and
the registered state-dict callbacks carry a live recovery between groups."""

from __future__ import annotations

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointManager, scan_steps, storage_for


class ReplicaGroupManager:
    """The part of ``torchft.Manager`` the CheckpointManager uses."""

    def __init__(self, participating_rank: int | None) -> None:
        self.rank = participating_rank
        self.load_fn = self.save_fn = None

    def participating_rank(self) -> int | None:
        return self.rank

    def set_state_dict_fns(self, load_state_dict, state_dict) -> None:
        self.load_fn, self.save_fn = load_state_dict, state_dict


class Position:
    """A dataloader's position, as a Stateful."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


def replica(common, folder, replica_id, participating_rank, seed=0):
    model = common.make_model(seed)
    data, train_state = Position(), common.TrainState()
    ft = ReplicaGroupManager(participating_rank)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=2),
        model_parts=model,
        states={"dataloader": data, "train_state": train_state},
        ft_manager=ft,
        ft_replica_id=replica_id,
    )
    return model, data, train_state, ft, manager


def test_one_writer_and_per_replica_dataloaders(common, tmp_path):
    groups = [replica(common, tmp_path, i, participating_rank=i) for i in (0, 1)]
    for i, (_, data, train_state, _, manager) in enumerate(groups):
        data.value, train_state.step = 100 + i, 2
        assert manager.save(2)
        manager.close()
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == [2]
    for i in (0, 1):
        folder = str(tmp_path / f"ft-replica-{i}")
        assert scan_steps(storage_for(folder), folder).committed == [2]

    # A restarted replica group 1 resumes the shared state and its own data position.
    model, data, train_state, _, manager = replica(common, tmp_path, 1, 1, seed=3)
    assert manager.load()
    assert (data.value, train_state.step) == (101, 2)
    writer = groups[0][0]
    assert all(torch.equal(v, writer.state_dict()[k]) for k, v in model.state_dict().items())


def test_state_dict_callbacks_heal_a_peer_without_its_dataloader(common, tmp_path):
    healthy_model, healthy_data, healthy_state, healthy_ft, _ = replica(common, tmp_path, 0, 0)
    healthy_state.step, healthy_data.value = 7, 70
    sick_model, sick_data, sick_state, sick_ft, _ = replica(common, tmp_path, 1, 1, seed=5)
    sick_ft.load_fn(healthy_ft.save_fn())  # what torchft does over the network
    assert sick_state.step == 7
    assert sick_data.value == 0  # each group keeps its own data position
    assert all(
        torch.equal(v, healthy_model.state_dict()[k]) for k, v in sick_model.state_dict().items()
    )


def test_missing_replica_dataloader_checkpoint_is_refused(common, tmp_path):
    *_, manager = replica(common, tmp_path, 0, 0)
    manager.save(2)
    manager.close()
    *_, stranger = replica(common, tmp_path, 5, 1)
    with pytest.raises(ValueError, match=r"Replica group 5 has no committed dataloader"):
        stranger.load()


def test_ft_manager_needs_a_replica_id_with_a_dataloader(common, tmp_path):
    with pytest.raises(ValueError, match="ft_replica_id is needed"):
        CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path)),
            model_parts=common.make_model(),
            states={"dataloader": Position()},
            ft_manager=ReplicaGroupManager(0),
        )


def test_without_ft_dataloader_checkpoints_the_dataloader_is_shared(common, tmp_path):
    data = Position(42)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path), enable_ft_dataloader_checkpoints=False),
        model_parts=common.make_model(),
        states={"dataloader": data},
        ft_manager=ReplicaGroupManager(0),
    )
    manager.save(500)
    manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-500"]
    data.value = 0
    reader = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path)),
        model_parts=common.make_model(),
        states={"dataloader": data},
    )
    assert reader.load()
    assert data.value == 42
