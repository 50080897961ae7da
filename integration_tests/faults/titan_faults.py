"""Kill a torchrun worker with SIGKILL at a chosen point of a real ``titan-train`` run, and
record what every restart loads; for ``integration_tests/test_restarts.py`` only.

``TITAN_FAULT_PLAN`` (JSON) says where: ``{"rank": R, "point": P, "step": N, "delay": S,
"folder": checkpoint folder, "log": JSONL file}``. Only rank R of the first attempt
(``TORCHELASTIC_RESTART_COUNT=0``) is killed, once; the points:

- ``step``: in training step N, after its forward and backward, before the optimizer step;
- ``save-start``: in the save of step N, its directory claimed, no data written;
- ``save-written``: in the save of step N, this rank's data written, not committed;
- ``async-staged``: (``checkpoint.async_mode``) right after step N's state is staged, its
  background write in flight;
- ``commit``: (rank 0) just after step N's commit marker is in place, the save not finished;
- ``delay``: S seconds after the first optimizer step, wherever the run is then (or at the
  last step's optimizer step, if the run gets there first).

Before the kill, one ``{"event": "kill", ...}`` line records the point and the committed and
uncommitted steps on disk. On every attempt, each checkpoint read records ``{"event":
"load", "step": ..., "committed": marker present, "newest_committed": ...}`` first.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import torch.distributed.checkpoint as dcp
from torch.optim.optimizer import register_optimizer_step_pre_hook

from titan_ckpt import manager as manager_module
from titan_ckpt.layout import read_manifest, scan_steps, step_of
from titan_ckpt.storage import LocalStorage

PLAN = json.loads(os.environ.get("TITAN_FAULT_PLAN", "{}"))
RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def record(event: dict) -> None:
    line = json.dumps({**event, "rank": RANK, "attempt": ATTEMPT}) + "\n"
    fd = os.open(PLAN["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def kill(point: str, step: int | None) -> None:
    scan = scan_steps(LocalStorage(), PLAN["folder"], log=False)
    record(
        {
            "event": "kill",
            "point": point,
            "step": step,
            "committed": scan.committed,
            "uncommitted": scan.uncommitted,
            "foreign": scan.foreign,
        }
    )
    os.kill(os.getpid(), signal.SIGKILL)


def _step_of_writer(writer: object) -> int | None:
    return step_of(os.path.basename(str(getattr(writer, "path", "")).rstrip("/")))


def _spy_on_loads() -> None:
    read = manager_module.CheckpointManager._read

    def spied(self, directory: str, state: dict) -> None:
        committed = [s for s in scan_steps(self.storage, self.folder, log=False).committed]
        record(
            {
                "event": "load",
                "step": step_of(os.path.basename(directory.rstrip("/"))),
                "committed": read_manifest(self.storage, directory) is not None,
                "newest_committed": max(committed, default=None),
            }
        )
        return read(self, directory, state)

    manager_module.CheckpointManager._read = spied


def _arm() -> None:
    point, target = PLAN["point"], PLAN.get("step")
    if point in ("save-start", "save-written"):
        save = dcp.save

        def dying_save(state, *args, **kwargs):
            step = _step_of_writer(kwargs.get("storage_writer"))
            if step == target and point == "save-start":
                kill(point, step)
            result = save(state, *args, **kwargs)
            if step == target:
                kill(point, step)
            return result

        dcp.save = dying_save
    elif point == "async-staged":
        async_save = dcp.async_save

        def dying_async_save(state, *args, **kwargs):
            result = async_save(state, *args, **kwargs)
            step = _step_of_writer(kwargs.get("storage_writer"))
            if step == target:
                kill(point, step)  # staged; its upload runs in the background
            return result

        dcp.async_save = dying_async_save
    elif point == "commit":
        commit = manager_module.commit_step

        def dying_commit(storage, directory, manifest, written=None):
            result = commit(storage, directory, manifest, written)
            if manifest.step == target:
                kill(point, manifest.step)
            return result

        manager_module.commit_step = dying_commit
    elif point in ("step", "delay"):
        calls = [0]

        def before_optimizer_step(optimizer, args, kwargs) -> None:
            calls[0] += 1  # one optimizer, a fresh first attempt: the call count is the step
            if point == "step" and calls[0] == target:
                kill(point, target)
            if point == "delay" and calls[0] == 1:
                timer = threading.Timer(PLAN["delay"], kill, args=(point, None))
                timer.daemon = True
                timer.start()
            if point == "delay" and calls[0] == PLAN["last_step"]:
                kill(point, calls[0])

        register_optimizer_step_pre_hook(before_optimizer_step)
    else:
        raise ValueError(f"unknown fault point {point!r}")


def install() -> None:
    """Spy on loads on every attempt; arm the kill on the chosen rank of the first one."""
    _spy_on_loads()
    if ATTEMPT == 0 and PLAN["rank"] == RANK:
        _arm()
