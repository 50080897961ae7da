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
from titan_ckpt import CheckpointConfig, CheckpointManager
from titan_ckpt.layout import COMMIT_MARKER


def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def die_at_marker(original):
    """``original`` for every file but the commit marker (the owner marker, written first
    through the same calls, must go through); death when the marker moves into place."""

    def move(src, dst, *args, **kwargs):
        if str(dst).endswith(COMMIT_MARKER):
            die()
        return original(src, dst, *args, **kwargs)

    return move


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
        titan_ckpt.manager.commit_step = die
    elif point == "before-rename" and hasattr(storage, "fs"):
        storage.fs.mv = die_at_marker(storage.fs.mv)
    elif point == "before-rename":
        os.replace = die_at_marker(os.replace)
    elif point == "torn-marker":
        write_atomic = storage.write_atomic

        def torn(path: str, data: bytes) -> None:
            if not path.endswith(COMMIT_MARKER):
                return write_atomic(path, data)
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
