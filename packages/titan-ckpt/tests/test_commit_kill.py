"""Atomic commit on every storage: a writer killed (SIGKILL) between a step's data and its
commit marker, or in the middle of the marker, leaves a step that is not loadable, while
the older steps load and a rerun resumes from the newest committed one.

Runs ``workers/kill_commit.py`` in a subprocess per storage kind (a local path, and fsspec's
``file://`` implementation, whose marker is written to a temporary file and then moved) and
kill point.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_ckpt import CheckpointConfig, CheckpointManager, storage_for
from titan_ckpt.layout import scan_steps

WORKER = Path(__file__).parent / "workers" / "kill_commit.py"

CASES = [
    ("local", "before-marker"),
    ("local", "before-rename"),
    ("fsspec", "before-marker"),
    ("fsspec", "before-rename"),
    ("fsspec", "torn-marker"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "point"), CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_killed_writer_leaves_older_steps_loadable(tmp_path, kind, point):
    if kind == "fsspec":
        pytest.importorskip("fsspec")
    folder = str(tmp_path / "ckpt") if kind == "local" else f"file://{tmp_path}/ckpt"
    done = subprocess.run(
        [sys.executable, str(WORKER), folder, point], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (tmp_path / "ckpt" / "step-3").is_dir()  # the data of step 3 is there

    storage = storage_for(folder)
    scan = scan_steps(storage, folder)
    assert scan.committed == [1, 2]
    assert scan.uncommitted == [3]

    model = torch.nn.Linear(8, 8)
    config = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=0)
    with CheckpointManager(config, model_parts=model) as manager:
        assert manager.load()
        assert manager.last_loaded_step == 2
        assert torch.all(model.weight == 2)
        with pytest.raises(ValueError, match="not a committed checkpoint"):
            manager.load(step=3)
        # The rerun saves step 3 again over the remains of the killed one.
        assert manager.save(3, force=True)
    assert scan_steps(storage, folder).committed == [1, 2, 3]


@pytest.mark.parametrize("keep", [0, 1, 40])
def test_a_torn_marker_reads_as_uncommitted_never_as_damaged(tmp_path, keep):
    folder = str(tmp_path / "ckpt")
    model = torch.nn.Linear(8, 8)
    config = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=0)
    with CheckpointManager(config, model_parts=model) as manager:
        for step in (1, 2):
            with torch.no_grad():
                model.weight.fill_(step)
            manager.save(step)
    marker = tmp_path / "ckpt" / "step-2" / "titan-commit.json"
    marker.write_bytes(marker.read_bytes()[:keep])  # what a crash mid-write could leave
    scan = scan_steps(storage_for(folder), folder)
    assert (scan.committed, scan.uncommitted) == ([1], [2])
    with CheckpointManager(config, model_parts=model) as manager:
        assert manager.load()
        assert manager.last_loaded_step == 1
        assert torch.all(model.weight == 1)
