"""Two FSDP2 ranks save into a small disk until it is full, synchronously and then async.

    torchrun --nproc-per-node 2 disk_full.py OUT_DIR DISK QUOTA

DISK is a folder on a small filesystem; QUOTA is 0 when it is a real one (a tmpfs), else
the byte limit of a quota storage over it. Each rank records the error each mode raised.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from common import finish, init, write_result
from small_disk import QuotaStorage
from torch.distributed.fsdp import fully_shard

from titan_ckpt import CheckpointConfig, CheckpointManager, CheckpointWriteError


def attempt(manager: CheckpointManager, steps: range) -> dict:
    for step in steps:
        try:
            manager.save(step)
        except CheckpointWriteError as e:
            return {"step": step, "type": type(e).__name__, "message": str(e), "path": e.path}
    try:
        manager.close()
    except CheckpointWriteError as e:
        return {"step": "close", "type": type(e).__name__, "message": str(e), "path": e.path}
    return {"step": None}


def main() -> None:
    rank = init()
    disk, quota = Path(sys.argv[2]), int(sys.argv[3])
    storage = QuotaStorage(disk, quota) if quota else None
    torch.manual_seed(0)
    model = fully_shard(torch.nn.Linear(256, 256))
    results = {}
    for mode in ("disabled", "async"):
        config = CheckpointConfig(
            enable=True, folder=str(disk / mode), interval=1, keep_latest_k=0, async_mode=mode
        )
        manager = CheckpointManager(config, model_parts=model, storage=storage)
        results[mode] = attempt(manager, range(1, 6))
        manager.close()
        dist.barrier()  # rank 0's close removed the lock file before any rank looks
        results[mode]["committed"] = sorted(p.name for p in (disk / mode).iterdir())
        dist.barrier()
        if rank == 0:  # make room for the next mode
            shutil.rmtree(disk / mode)
        dist.barrier()
    write_result("disk_full", results)


if __name__ == "__main__":
    main()
    finish()
