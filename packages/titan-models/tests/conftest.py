"""Shared helpers: the tiny training setup from workers/tiny.py, and a torchrun launcher for
the worker scripts (pytest runs in importlib mode, so workers are scripts run by path)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from titan_dims import testing

WORKERS = Path(__file__).parent / "workers"


def _load_tiny() -> ModuleType:
    spec = importlib.util.spec_from_file_location("titan_models_tests_tiny", WORKERS / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny() -> ModuleType:
    """workers/tiny.py: the tiny model args, weights, data and single-process training."""
    return _load_tiny()


def _run_torchrun(script: str, nproc: int, out_dir: Path, *args: str, timeout: float = 300) -> dict:
    """Run ``workers/<script>`` on ``nproc`` gloo ranks with ``out_dir`` and ``args``; return
    the JSON the script wrote to ``out_dir/losses.json``."""
    testing.run_torchrun(WORKERS / script, nproc, [str(out_dir), *args], timeout=timeout)
    return json.loads((out_dir / "losses.json").read_text())


@pytest.fixture(scope="session")
def run_torchrun():
    """``run_torchrun(script, nproc, out_dir, *args)``: launch a worker script under torchrun
    and return the JSON it wrote (a fixture: importlib mode cannot import conftest)."""
    return _run_torchrun
