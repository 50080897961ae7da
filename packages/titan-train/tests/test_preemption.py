"""SIGTERM handling (``titan_train.trainer.preemption``), against real signals: the first one is
noted and the process trains on, repeats within the window change nothing, and one after it
ends the process at once with status 143, even while its main thread waits in C++ where no
Python signal handler runs. The whole 2-rank stop, save and resume is
``integration_tests/test_restarts.py``."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection

import pytest
import torch

from titan_train.trainer.preemption import PREEMPTED_EXIT, REPEAT_WINDOW_S, stop_on_sigterm


def blocked(ready: Connection) -> None:
    """Note SIGTERM, then block the main thread in a C++ wait that never ends, as a rank
    stuck in a collective: no Python signal handler runs until it returns (measured: one that
    exits does not), so only the watching thread can end the process."""
    with stop_on_sigterm():
        ready.send("ready")
        torch.futures.Future().wait()


def test_the_first_sigterm_is_noted_and_the_handler_restored_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_sigterm() as stop:
        assert not stop.agreed()
        # Never signal the test runner without a handler: SIGTERM's default would end it.
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, before)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.received
        assert stop.agreed()  # one process: its own flag
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup fd left behind


def test_a_second_sigterm_ends_the_process_at_once(capfd: pytest.CaptureFixture) -> None:
    # Forked: the child has titan_train imported already and starts in milliseconds.
    context = multiprocessing.get_context("fork")
    ready, child_end = context.Pipe()
    process = context.Process(target=blocked, args=(child_end,))
    process.start()
    try:
        assert ready.poll(30)
        assert ready.recv() == "ready"
        first = time.monotonic()
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(0.2)
        os.kill(process.pid, signal.SIGTERM)  # the same request, delivered twice
        time.sleep(REPEAT_WINDOW_S - (time.monotonic() - first) + 0.1)
        assert process.is_alive()
        os.kill(process.pid, signal.SIGTERM)
        sent = time.monotonic()
        process.join(timeout=5)
        assert time.monotonic() - sent < 1.0
        assert process.exitcode == PREEMPTED_EXIT == 143
        assert "a second SIGTERM: exiting now" in capfd.readouterr().err
    finally:
        if process.is_alive():
            process.kill()
            process.join()
            pytest.fail("the process outlived its second SIGTERM")
