"""One torchft replica group (a 1-rank group in its own process) for ``test_ft.py``.

Usage: ft_replica.py OUT_DIR FOLDER LIGHTHOUSE_ADDR REPLICA_INDEX ROLE, ROLE being
``healthy`` (trained 4 steps: seed-0 weights, AdamW state, LR schedule, train state at step
4, torchft step 4) or ``recovering`` (a fresh group: other weights, step 0). Both join one
quorum of the shared lighthouse (min_replicas=2), take one step with torchft's should_commit
(gradients averaged over both groups through torchft's allreduce, so the healthy group waits
for the recovering one to heal, as in training) and save with the CheckpointManager; the JSON
result says what each one saw and wrote.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta

import torch
from common import TrainState, batch, make_model, train_steps
from torch import nn
from torch.distributed import TCPStore

from titan_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    FaultToleranceOptions,
    LocalStorage,
    OptimizerState,
)

warnings.filterwarnings("ignore", message="The 'warn' method is deprecated")  # torchft 0.2.0
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class Position:
    """A dataloader's position, as a Stateful."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = int(sd["value"])


class RecordingStorage(LocalStorage):
    """The local filesystem, noting every directory DCP writes into."""

    def __init__(self) -> None:
        self.dcp_writes: list[str] = []

    def dcp_writer(self, path: str):
        self.dcp_writes.append(path)
        return super().dcp_writer(path)


def main() -> None:
    import torchft

    out_dir, folder, lighthouse, index, role = sys.argv[1:6]
    torch.set_num_threads(1)
    healthy = role == "healthy"
    model = make_model(seed=0 if healthy else 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train_state, data = TrainState(), Position(100 + int(index))
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(),
        min_replica_size=2,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"replica_{index}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        # Generous: the other group may still be importing torch on a busy 2-core machine.
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60),
    )
    if healthy:
        train_steps(model, opt, range(1, 5), rank=0)
        for _ in range(4):
            lr.step()
        train_state.step = 4
        manager.load_state_dict({"step": 4, "batches_committed": 8})
    storage = RecordingStorage()
    ckpt = CheckpointManager(
        CheckpointConfig(enable=True, folder=folder, interval=5),
        storage=storage,
        model_parts=model,
        states={
            "optimizer": OptimizerState(model, opt),
            "lr_scheduler": lr,
            "dataloader": data,
            "train_state": train_state,
        },
        ft=FaultToleranceOptions(manager, index),
    )
    # The step: quorum (the recovering group heals from its peer here, through the state-dict
    # callbacks the CheckpointManager registered), then the commit vote.
    manager.start_quorum()
    healed = {
        "train_state_step": train_state.step,
        "lr_last": lr.get_last_lr(),
        "opt_steps": sorted(int(s["step"]) for s in opt.state_dict()["state"].values()),
        "data_value": data.value,
        "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
    }
    x, y = batch(1000 + int(index))
    nn.functional.mse_loss(model(x), y).backward()
    for p in model.parameters():
        manager.allreduce(p.grad).wait()
    committed = manager.should_commit()
    if committed:
        opt.step()
        lr.step()
    opt.zero_grad()
    train_state.step = manager.current_step()
    saved = ckpt.save(train_state.step)
    ckpt.close()
    result = {
        "role": role,
        "participating_rank": manager.participating_rank(),
        "committed": committed,
        "step": manager.current_step(),
        "saved": saved,
        "dcp_writes": [os.path.relpath(p, folder) for p in storage.dcp_writes],
        "healed": healed,
        "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
    }
    with open(os.path.join(out_dir, f"ft-{role}.json"), "w") as f:
        json.dump(result, f)
    manager.shutdown()


if __name__ == "__main__":
    main()
