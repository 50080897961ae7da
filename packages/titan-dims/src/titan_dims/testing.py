"""Helpers for testing distributed code on one machine: launch a script under torchrun.

Scripts run by path (not pickled functions), so they work with any pytest import mode, and
each launch gets a free port so tests can run back to back.
"""

from __future__ import annotations

import os
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
    command's output, so a failing rank's traceback shows up in the test report.
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
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=full_env, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited with {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
        )
    return result
