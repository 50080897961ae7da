"""Two FSDP2 ranks save one step per async mode while every read is counted.

Usage: no_readback.py OUT_DIR FOLDER. For each of ``disabled``, ``async`` and
``async_with_pinned_mem`` (DCP's writer in a spawned process), the ranks save step 1 into
``FOLDER/<mode>``. Two independent counters run during ``save`` + ``wait`` (the commit
included): a ``LocalStorage`` subclass counting the bytes read through every file it opens,
and a ``sys.addaudithook`` recording every file of the folder opened for reading by any code
in this process (DCP's, titan's, torch's). Each rank reports both per mode.
"""

from __future__ import annotations

import io
import os
import shutil
import sys

import torch
import torch.distributed as dist
from common import TrainState, finish, init, make_model, shard, write_result

from titan_ckpt import (
    CheckpointConfig,
    CheckpointIntegrityError,
    CheckpointManager,
    LocalStorage,
    OptimizerState,
)

COUNTING = False
OPENED: list[str] = []


class _CountedReader(io.BufferedReader):
    """A file opened for reading whose bytes read add to ``CountingStorage.bytes_read``."""

    def __init__(self, raw: io.FileIO, storage: CountingStorage) -> None:
        super().__init__(raw)
        self._storage = storage

    def _count(self, path: str, n: int) -> None:
        if COUNTING:
            self._storage.bytes_read[path] = self._storage.bytes_read.get(path, 0) + n

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self._count(self.raw.name, len(data))
        return data

    def read1(self, size: int = -1) -> bytes:
        data = super().read1(size)
        self._count(self.raw.name, len(data))
        return data

    def readinto(self, buffer) -> int:
        n = super().readinto(buffer)
        self._count(self.raw.name, n or 0)
        return n


class CountingStorage(LocalStorage):
    """The local filesystem, counting the bytes read through ``open`` per file."""

    def __init__(self) -> None:
        self.bytes_read: dict[str, int] = {}

    def open(self, path: str, mode: str = "rb"):
        if mode == "rb":
            return _CountedReader(io.FileIO(path, "r"), self)
        return super().open(path, mode)


def _audit(event: str, args: tuple) -> None:
    # "open" is raised by open(), io.open, os.open and pathlib alike: (path, mode, flags).
    if not COUNTING or event != "open":
        return
    path, mode, flags = args
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    reading = (
        ("r" in mode and "+" not in mode)
        if isinstance(mode, str)
        else (isinstance(flags, int) and flags & os.O_ACCMODE == os.O_RDONLY)
    )
    path = os.fsdecode(path)
    if reading and path.startswith(sys.argv[2]) and not os.path.isdir(path):
        OPENED.append(os.path.relpath(path, sys.argv[2]))


def main() -> None:
    global COUNTING
    rank = init()
    sys.addaudithook(_audit)
    model = shard(make_model(seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    report = {}
    for mode in ("disabled", "async", "async_with_pinned_mem"):
        storage = CountingStorage()
        folder = os.path.join(sys.argv[2], mode)
        config = CheckpointConfig(enable=True, folder=folder, interval=1, async_mode=mode)
        manager = CheckpointManager(
            config,
            model_parts=[model],
            states={"optimizer": OptimizerState(model, opt), "train_state": TrainState()},
            storage=storage,
        )
        OPENED.clear()
        COUNTING = True
        manager.save(1)
        manager.wait()  # the commit of an async save happens on rank 0 before this returns
        COUNTING = False
        manager.close()
        report[mode] = {"bytes_read": storage.bytes_read, "opened_for_reading": list(OPENED)}
    report["load"] = load_checks(model, opt, rank)
    write_result("no_readback", {"rank": rank, **report})


def _snapshot(model, opt) -> list[torch.Tensor]:
    tensors = [
        p.detach().to_local() if hasattr(p, "to_local") else p.detach() for p in model.parameters()
    ]
    for state in opt.state.values():
        tensors += [
            v.to_local() if hasattr(v, "to_local") else v
            for v in state.values()
            if torch.is_tensor(v)
        ]
    return [t.clone() for t in tensors]


def load_checks(model, opt, rank: int) -> dict:
    """Load step 1 with checksums (the ranks hash their shares of the files before any
    tensor is read), intact and with one byte of rank 1's data file flipped: every rank must
    raise the same error, with its model's and optimizer's tensors left as they were."""
    intact = os.path.join(sys.argv[2], "async")
    damaged = os.path.join(sys.argv[2], "damaged")
    if rank == 0:
        shutil.copytree(intact, damaged)
        path = os.path.join(damaged, "step-1", "__1_0.distcp")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    out = {}
    for name, folder in (("intact", intact), ("damaged", damaged)):
        manager = CheckpointManager(
            CheckpointConfig(enable=True, folder=folder),
            model_parts=[model],
            states={"optimizer": OptimizerState(model, opt), "train_state": TrainState()},
        )
        before = _snapshot(model, opt)
        try:
            out[name] = {"loaded": bool(manager.load(verify_checksums=True))}
        except CheckpointIntegrityError as error:
            after = _snapshot(model, opt)
            unchanged = len(before) == len(after) and all(
                torch.equal(a, b) for a, b in zip(before, after, strict=True)
            )
            out[name] = {"problems": error.problems, "states_unchanged": unchanged}
        manager.close()
    return out


if __name__ == "__main__":
    main()
    finish()
