"""SIGTERM handling (``titan_train.preemption``), against real signals: the first one is
noted and the process trains on, repeats within the window change nothing, and one after it
ends the process at once with status 143, even while its main thread is blocked in a call
that no Python signal handler can interrupt. The whole 2-rank stop, save and resume is
``integration_tests/test_preemption.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from titan_train.preemption import PREEMPTED_EXIT, REPEAT_WINDOW_S, stop_on_sigterm

# Notes SIGTERM, then blocks its main thread in a read that never returns: a Python-level
# handler would run, return and the read resume (PEP 475), so only the watching thread can
# end the process.
BLOCKED = """
import os, sys
from titan_train.preemption import stop_on_sigterm
read_fd, _ = os.pipe()
with stop_on_sigterm():
    print("ready", flush=True)
    os.read(read_fd, 1)
"""


def test_the_first_sigterm_is_noted_and_the_handler_restored_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_sigterm() as stop:
        assert not stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.received and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stop.received and stop.agreed()  # one process: its own flag
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.set_wakeup_fd(-1) == -1  # no wakeup fd left behind


def test_a_second_sigterm_ends_the_process_at_once() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", BLOCKED], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline() == "ready\n"
        first = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        process.send_signal(signal.SIGTERM)  # the same request, delivered twice
        time.sleep(REPEAT_WINDOW_S - (time.monotonic() - first) + 0.1)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = process.wait(timeout=5)
        assert time.monotonic() - sent < 1.0
        assert code == PREEMPTED_EXIT == 143
        assert "a second SIGTERM: exiting now" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
            pytest.fail("the process outlived its second SIGTERM")
