"""An extended run trains on its new schedule: ``titan-train`` for 10 steps, then the same
command with ``--training.steps 20``, reproduces a 20-step run's steps 11-20 bit for bit
when the schedule is constant after warmup (one process, gloo, CPU).

Before, step 11 trained at the lr the finished 10-step schedule had left in the optimizer's
saved state (its end-of-decay value, 0), so every later step differed. Read from each run's
``metrics.jsonl``: the loss of every step and the lr it trained with.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

LR = 0.003
TINY = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--optimizer.lr", str(LR),
    "--lr_scheduler.warmup_steps", "2",
    "--lr_scheduler.decay_ratio", "0",  # constant after warmup
    "--checkpoint.interval", "10",
    "--parallelize.param_dtype", "float32",
]  # fmt: skip


def titan_train(folder: Path, steps: int) -> dict[int, dict]:
    """Run (or continue) the tiny job in ``folder`` up to ``steps``; its records by step."""
    command = [sys.executable, "-m", "titan_train.cli", "--job.dump_folder", str(folder)]
    command += [*TINY, "--training.steps", str(steps)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        start = result.stderr.find("Traceback")
        pytest.fail(f"{command} failed:\n{result.stderr[max(start, 0) :][:12000]}")
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.full  # resume = uninterrupted is CI's in test_train_runs.py and test_restarts.py
def test_ten_steps_extended_to_twenty_reproduce_a_twenty_step_run(tmp_path):
    reference = titan_train(tmp_path / "twenty", 20)
    first = titan_train(tmp_path / "extended", 10)
    assert sorted(first) == list(range(1, 11))
    extended = titan_train(tmp_path / "extended", 20)  # resumes from step-10
    assert sorted(extended) == list(range(1, 21))  # the same JSONL, appended
    assert (tmp_path / "extended" / "checkpoint" / "step-20" / ".metadata").is_file()

    # The lr each step trained with: warmup, then the peak, including the last step and
    # the first step after the resume.
    assert [reference[s]["lr"] for s in range(1, 21)] == [LR / 2] + [LR] * 19
    assert [extended[s]["lr"] for s in range(1, 21)] == [LR / 2] + [LR] * 19
    assert [extended[s]["loss"] for s in range(1, 21)] == [
        reference[s]["loss"] for s in range(1, 21)
    ]
