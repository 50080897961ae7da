"""Two FSDP2 ranks save one checkpoint (step 1) for the ``titan-ckpt`` command's tests.

Usage: save_sharded.py OUT_DIR FOLDER. Rank 0 also writes the full parameters as JSON, so the
test can check what ``convert`` reassembles from the two ranks' shards.
"""

from __future__ import annotations

import sys

import torch
from common import TrainState, finish, full_params, init, make_model, shard, write_result

from titan_ckpt import CheckpointConfig, CheckpointManager, OptimizerState


def main() -> None:
    init()
    model = shard(make_model(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_state = TrainState()
    train_state.step = 1
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=sys.argv[2], interval=1, last_save_model_only=False),
        model_parts=[model],
        states={"optimizer": OptimizerState(model, opt), "train_state": train_state},
    )
    manager.save(1)
    manager.close()
    write_result("sharded", {"params": full_params(model)})


if __name__ == "__main__":
    main()
    finish()
