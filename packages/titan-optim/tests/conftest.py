"""Shared helpers: running worker scripts under torchrun (gloo, CPU) and reading their JSON."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from titan_dims import testing

WORKERS = Path(__file__).parent / "workers"


def run_torchrun(
    script: str, nproc: int, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``tests/workers/<script>`` on ``nproc`` local ranks; fail with its output if it fails."""
    return testing.run_torchrun(
        WORKERS / script, nproc, args, timeout=timeout, env={"PYTHONWARNINGS": "ignore"}
    )


def read_results(out_dir: Path, name: str) -> dict[str, Any]:
    return json.loads((out_dir / f"{name}.json").read_text())


@pytest.fixture(scope="session")
def torchrun():
    """``run_torchrun`` for tests (conftest modules are not importable in importlib mode)."""
    return run_torchrun
