"""Save steps 1 and 2, then die by SIGKILL while saving step 3, at a chosen point.

    python kill_commit.py FOLDER POINT

FOLDER is a local path or a ``file://`` URL (fsspec). POINT is where step 3 dies:
``before-marker`` (its data written, no marker yet), ``before-rename`` (the marker's
temporary file written, not moved into place) or ``torn-marker`` (half the marker written
in place, as a storage without atomic writes could leave it).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import titan_ckpt.manager
from titan_ckpt import COMMIT_MARKER, CheckpointConfig, CheckpointManager


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    folder, point = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    config = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=0)
    manager = CheckpointManager(config, model_parts=model)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        manager.save(step)
    with torch.no_grad():
        model.weight.fill_(3)
    storage = manager.storage
    if point == "before-marker":
        titan_ckpt.manager.write_commit = die
    elif point == "before-rename" and hasattr(storage, "fs"):
        move = storage.fs.mv
        storage.fs.mv = lambda a, b, *args, **kw: (  # the commit marker's, not the owner's
            die() if b.endswith(COMMIT_MARKER) else move(a, b, *args, **kw)
        )
    elif point == "before-rename":
        replace = os.replace
        os.replace = lambda a, b, *args, **kw: (
            die() if str(b).endswith(COMMIT_MARKER) else replace(a, b, *args, **kw)
        )
    elif point == "torn-marker":

        def torn(path: str, data: bytes) -> None:
            with storage.open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            die()

        storage.write_atomic = torn
    else:
        raise SystemExit(f"unknown point {point!r}")
    manager.save(3)
    raise SystemExit("step 3 was saved: the kill point was never reached")


if __name__ == "__main__":
    main()
