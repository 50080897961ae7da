"""Shared helpers: running worker scripts under torchrun (gloo, CPU) and reading their JSON."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKERS = Path(__file__).parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    script: str, nproc: int, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/workers/<script>`` on ``nproc`` local ranks; fail with its output if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(WORKERS / script),
        *args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    return proc


def read_results(out_dir: Path, name: str) -> dict[str, Any]:
    return json.loads((out_dir / f"{name}.json").read_text())


@pytest.fixture(scope="session")
def torchrun():
    """``run_torchrun`` for tests (conftest modules are not importable in importlib mode)."""
    return run_torchrun
