"""Fuzzing titan-ckpt's readers with damaged copies of a real small checkpoint.

A few hundred seeded cases of random truncations and byte flips of DCP's ``.metadata``, its
``.distcp`` data, the titan commit marker, a safetensors file (whole, and its header alone)
and a torch.save file, each read by every reader of that format (``workers/fuzz_readers.py``:
verify, inspect --stats, CheckpointManager.load, the safetensors and torch.save readers, the
Hugging Face import). Every case must end normally or in one of titan-ckpt's errors: never
another exception, a crash, a hang, or an allocation beyond the address-space cap the worker
sets (its own size plus 256 MiB, against files of a few KiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).parent / "workers"
CASES = 300


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, common) -> Path:
    """step-1/ (model, AdamW state, train state), st/model.safetensors and model.pt."""
    pytest.importorskip("safetensors")
    from titan_ckpt import CheckpointConfig, CheckpointManager, OptimizerState
    from titan_ckpt.commands.cli import main

    root = tmp_path_factory.mktemp("fuzz") / "pristine"
    model = common.make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_state = common.TrainState()
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(root), interval=1, last_save_model_only=False),
        model_parts=[model],
        states={"optimizer": OptimizerState(model, opt), "train_state": train_state},
    )
    common.train_steps(model, opt, range(1, 2), rank=0)
    train_state.step = 1
    manager.save(1)
    manager.close()
    step = str(root / "step-1")
    assert main(["convert", step, str(root / "st" / "model.safetensors"), "--to", "safetensors",
                 "--model-only"]) == 0  # fmt: skip
    assert main(["convert", step, str(root / "model.pt"), "--to", "torch"]) == 0
    return root


@pytest.mark.slow
def test_damaged_checkpoints_end_in_our_errors(pristine, tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(WORKERS / "fuzz_readers.py"), str(pristine), str(tmp_path / "x"),
           str(out), "--seed", "16", "--cases", str(CASES)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    progress = out.with_suffix(".progress")
    last = progress.read_text() if progress.exists() else "none"
    assert proc.returncode == 0, f"worker died (signal?) in case {last}: {proc.stderr[-2000:]}"
    results = json.loads(out.read_text())["results"]
    bad = [r for r in results if r["outcome"] not in ("ok", "reported", "refused")]
    assert bad == [], "\n".join(
        f"{r['kind']} {r['how']} {r['check']}: {r['outcome']} {r['text']}" for r in bad[:5]
    )
    outcomes = Counter((r["kind"], r["outcome"]) for r in results)
    # The damage was noticed: for every kind of file, most damaged copies were refused by
    # our errors or reported (verify's problems; a commit marker too damaged to parse makes
    # the step uncommitted, so the load starts fresh). Not all: a flip inside a tensor's
    # bytes of a file without checksums (safetensors, torch.save) reads normally.
    for kind in {r["kind"] for r in results}:
        cases = {r["case"] for r in results if r["kind"] == kind}
        noticed = {r["case"] for r in results if r["kind"] == kind and r["outcome"] != "ok"}
        assert len(noticed) >= len(cases) // 4, (kind, outcomes)
    assert len({r["case"] for r in results}) == CASES
