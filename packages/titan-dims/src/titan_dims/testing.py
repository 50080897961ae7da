"""Helpers for testing distributed code on one machine: launch a script under torchrun.

Scripts run by path (not pickled functions), so they work with any pytest import mode, and
each launch gets a free port so tests can run back to back.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["free_port", "run_torchrun"]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(
    script: str | os.PathLike[str],
    nproc: int,
    args: Sequence[str] = (),
    *,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torch.distributed.run`` with ``nproc`` local processes.

    Output is captured; with ``check`` a non-zero exit raises ``RuntimeError`` carrying the
    command's output, so a failing rank's traceback shows up in the test report. Past
    ``timeout`` seconds the launcher and every worker are killed and ``RuntimeError`` raised.
    """
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(Path(script)),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    # On timeout the workers must die with the launcher, not live on as orphans holding a core.
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM lets torchrun stop its workers (each runs in a session of its own, out of
            # reach of a process-group kill); SIGKILL the launcher's group if it does not.
            process.terminate()
            try:
                stdout, stderr = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
            raise RuntimeError(
                f"{' '.join(command)} did not finish within {timeout} s and was killed\n"
                f"--- stdout ---\n{stdout[-6000:]}\n--- stderr ---\n{stderr[-6000:]}"
            ) from None
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited with {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result
