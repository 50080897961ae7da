"""End-to-end runs of the real ``titan-train`` command (gloo, CPU), as one table of runs.

Each run is launched the way a user launches it (``titan-train --nproc-per-node N ...``)
and checked through what it leaves on disk: the metrics JSONL, TensorBoard event files and
committed checkpoints. Runs that resume start from a copy of another run's folder with its
last checkpoint removed, so they continue from step 10.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEPS = 20
TINY = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "0.003",
    "--checkpoint.interval", "10",
    # fp32 everywhere, so that sharded runs can match the single process closely.
    "--parallelize.param_dtype", "float32",
]  # fmt: skip


@dataclass(frozen=True)
class Run:
    nproc: int
    args: tuple[str, ...]
    resume_from: str | None = None
    """Name of a run whose folder (without its step-20 checkpoint) this run continues."""


RUNS = {
    "single": Run(1, ("--training.local_batch_size", "4")),
    "resume": Run(1, ("--training.local_batch_size", "4"), resume_from="single"),
    "fsdp": Run(
        2, ("--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2")
    ),
    "fsdp_to_single": Run(1, ("--training.local_batch_size", "4"), resume_from="fsdp"),
    "tp": Run(
        2,
        (
            "--training.local_batch_size",
            "4",
            "--parallelism.data_parallel_shard_degree",
            "1",
            "--parallelism.tensor_parallel_degree",
            "2",
        ),
    ),
}


def titan_train(*args: str) -> None:
    command = [sys.executable, "-m", "titan_train.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        start = result.stderr.find("Traceback")
        pytest.fail(f"{args} failed:\n{result.stderr[max(start, 0) :][:12000]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Launch every run of the table once, all from one seed checkpoint (sharded random
    init differs between layouts); name -> its dump folder."""
    seed = tmp_path_factory.mktemp("seed") / "out"
    titan_train("--job.dump_folder", str(seed), "--checkpoint.create_seed_checkpoint")
    assert (seed / "checkpoint" / "step-0" / ".metadata").is_file()
    folders: dict[str, Path] = {}
    for name, run in RUNS.items():
        folder = tmp_path_factory.mktemp(name) / "out"
        if run.resume_from:
            shutil.copytree(folders[run.resume_from], folder)
            shutil.rmtree(folder / "checkpoint" / f"step-{STEPS}")
            (folder / "metrics.jsonl").unlink()
        titan_train(
            "--nproc-per-node", str(run.nproc),
            "--job.dump_folder", str(folder),
            "--checkpoint.initial_load_path", str(seed / "checkpoint"),
            *TINY, *run.args,
        )  # fmt: skip
        folders[name] = folder
    return folders


def losses(folder: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


def test_single_process_trains_and_checkpoints(runs):
    folder = runs["single"]
    curve = losses(folder)
    assert sorted(curve) == list(range(1, STEPS + 1))
    assert curve[STEPS] < curve[1] - 1.0, curve
    for step in (10, 20):
        assert (folder / "checkpoint" / f"step-{step}" / ".metadata").is_file()
    events = EventAccumulator(str(folder / "tb"))
    events.Reload()
    scalars = events.Scalars("loss")
    assert [s.step for s in scalars] == list(range(1, STEPS + 1))
    assert scalars[-1].value == pytest.approx(curve[STEPS], rel=1e-6)


def test_resume_from_step_10_reproduces_steps_11_to_20_bit_for_bit(runs):
    original, resumed = losses(runs["single"]), losses(runs["resume"])
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert [resumed[s] for s in resumed] == [original[s] for s in resumed]


def test_fsdp_on_two_ranks_matches_one_process(runs):
    single, fsdp = losses(runs["single"]), losses(runs["fsdp"])
    assert [fsdp[s] for s in range(1, 4)] == pytest.approx(
        [single[s] for s in range(1, 4)], rel=1e-5
    )
    assert [fsdp[s] for s in single] == pytest.approx(list(single.values()), rel=2e-3)


def test_two_rank_checkpoint_resumes_on_one_rank(runs):
    # Model, optimizer, schedule and data position all reshard from 2 ranks to 1: the
    # continuation follows the 2-rank run's own curve.
    fsdp, resumed = losses(runs["fsdp"]), losses(runs["fsdp_to_single"])
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert [resumed[s] for s in resumed] == pytest.approx([fsdp[s] for s in resumed], rel=1e-4)


def test_tensor_parallel_matches_one_process(runs):
    single, tp = losses(runs["single"]), losses(runs["tp"])
    assert [tp[s] for s in range(1, 4)] == pytest.approx([single[s] for s in range(1, 4)], rel=1e-5)
