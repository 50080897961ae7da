"""Stopping a run on SIGTERM, which SLURM and Kubernetes send some seconds before SIGKILL.

Inside ``stop_on_sigterm`` a rank that gets SIGTERM notes it and trains on; after each step
the ranks agree whether any got it (a MAX all-reduce of one int on a gloo group of their
own: ~0.3 ms on 2 CPU ranks), so all stop after the same step. Rank 0 logs one line; with
``checkpoint.save_on_sigterm`` every rank saves that step and waits for the commit; ``train``
raises ``PreemptedError`` and ``titan-train`` exits 143 (128 + 15: stopped, not finished, so
no 0 that says done nor 1 that a retry would not fix; Kubeflow's ``restartPolicy: ExitCode``
restarts on 143). Before the loop SIGTERM keeps its default: no step would be saved.

A SIGTERM ``REPEAT_WINDOW_S`` or more after the first ends the process at once (one sooner is
the same request delivered twice, by SLURM and torchrun's agent). A thread watches for it:
Python runs a handler only when the main thread is back in the interpreter, which a hung
collective may not be for minutes, while the wakeup fd (``signal.set_wakeup_fd``) is written
at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from titan_train.errors import TrainError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["PREEMPTED_EXIT", "REPEAT_WINDOW_S", "PreemptedError", "StopSignal", "stop_on_sigterm"]

PREEMPTED_EXIT = 128 + signal.SIGTERM
"""The exit status of a run stopped by SIGTERM: 143 (see the module's docstring)."""

REPEAT_WINDOW_S = 2.0
"""SIGTERMs this soon after the first are the same request, delivered more than once."""


class PreemptedError(TrainError):
    """The run stopped after ``step`` on SIGTERM, having saved it when ``saved``;
    ``titan-train`` exits with status ``PREEMPTED_EXIT``."""

    def __init__(self, step: int, *, saved: bool) -> None:
        kept = f"saved step {step}" if saved else f"step {step} not saved"
        super().__init__(f"stopped on SIGTERM after step {step} ({kept})")
        self.step = step
        self.saved = saved


class StopSignal:
    """Whether SIGTERM asked this run to stop: ``received`` on this rank, ``agreed`` by all."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        """The gloo group the ranks agree over (``None``: one rank); its collective timeout
        is the caller's to change with the others'."""
        self._first: float | None = None

    @property
    def received(self) -> bool:
        """Whether this process got SIGTERM."""
        return self._first is not None

    def agreed(self) -> bool:
        """Whether any rank got SIGTERM; a collective that every rank calls once per step."""
        if self.group is None:
            return self.received
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self.received)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def note(self) -> None:
        """Count one SIGTERM: the first asks to stop; one after ``REPEAT_WINDOW_S`` ends the
        process now (no save, no cleanup: the operator insists)."""
        now = time.monotonic()
        if self._first is None:
            self._first = now
        elif now - self._first >= REPEAT_WINDOW_S:
            # Raw write: the main thread may hold the logging or stderr lock.
            os.write(2, b"titan-train: a second SIGTERM: exiting now, without a save\n")
            os._exit(PREEMPTED_EXIT)

    def _watch(self, fd: int) -> None:
        """Read signal numbers from the wakeup fd until its write end closes."""
        while chunk := os.read(fd, 64):
            for number in chunk:
                if number == signal.SIGTERM:
                    self.note()


def _noted(signum: int, frame: Any) -> None:
    """SIGTERM's Python handler: there only so that SIGTERM no longer kills the process and
    its number reaches the wakeup fd; the watching thread does the rest."""


@contextlib.contextmanager
def stop_on_sigterm(world_size: int = 1) -> Iterator[StopSignal]:
    """Catch SIGTERM while inside (not outside the main thread); the ``StopSignal`` says when
    to stop. A collective with ``world_size`` > 1 (it makes the ranks' gloo group)."""
    group = None
    if world_size > 1:
        import torch.distributed as dist

        group = dist.new_group(backend="gloo")
    stop = StopSignal(group)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement; the reader blocks
    previous_handler = signal.signal(signal.SIGTERM, _noted)
    previous_fd = signal.set_wakeup_fd(write_fd)
    watcher = threading.Thread(
        target=stop._watch, args=(read_fd,), name="titan-sigterm", daemon=True
    )
    watcher.start()
    try:
        yield stop
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(
            signal.SIGTERM, signal.SIG_DFL if previous_handler is None else previous_handler
        )
        os.close(write_fd)  # the watcher reads the end of the pipe and returns
        watcher.join()
        os.close(read_fd)
