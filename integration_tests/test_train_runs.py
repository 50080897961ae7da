"""End-to-end runs of the real ``titan-train`` command (gloo, CPU), as one table of runs.

Each run is launched the way a user launches it (``titan-train --nproc-per-node N ...``)
and checked through what it leaves on disk: the metrics JSONL, TensorBoard event files and
committed checkpoints. Runs that resume start from a copy of another run's folder with its
last checkpoint removed, so they continue from step 10. Every layout validates on the same
4 x 64-token sequences at steps 10 and 20, so validation losses compare across layouts.
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
    "--validation.enable",
    "--validation.freq", "10",
    "--validation.steps", "1",
    "--validation.seq_len", "64",
]  # fmt: skip
VALIDATE_4 = ("--validation.local_batch_size", "4")
"""Validation batch of the layouts with one data-parallel rank (4 sequences per step)."""


@dataclass(frozen=True)
class Run:
    nproc: int
    args: tuple[str, ...]
    resume_from: str | None = None
    """Name of a run whose folder (without its step-20 checkpoint) this run continues."""


RUNS = {
    "single": Run(1, ("--training.local_batch_size", "4", *VALIDATE_4)),
    "resume": Run(1, ("--training.local_batch_size", "4", *VALIDATE_4), resume_from="single"),
    "fsdp": Run(
        2,
        (
            "--training.local_batch_size", "2",
            "--parallelism.data_parallel_shard_degree", "2",
            "--validation.local_batch_size", "2",
        ),
    ),
    "fsdp_to_single": Run(1, ("--training.local_batch_size", "4", *VALIDATE_4), resume_from="fsdp"),
    "tp": Run(
        2,
        (
            "--training.local_batch_size", "4",
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.tensor_parallel_degree", "2",
            *VALIDATE_4,
        ),
    ),
    # Each rank feeds its load-balanced half of every sequence (training and validation).
    "cp": Run(
        2,
        (
            "--training.local_batch_size", "4",
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.context_parallel_degree", "2",
            *VALIDATE_4,
        ),
    ),
    # The same with the ring attention: K/V blocks pass around the cp ranks.
    "cp_ring": Run(
        2,
        (
            "--training.local_batch_size", "4",
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.context_parallel_degree", "2",
            "--parallelize.cp_attention", "titan_ring",
            *VALIDATE_4,
        ),
    ),
    # Pipeline stages 0-2 | 3-5 of the 6 blocks, one microbatch per sequence.
    "pp": Run(
        2,
        (
            "--training.local_batch_size", "4",
            "--parallelism.data_parallel_shard_degree", "1",
            "--parallelism.pipeline_parallel_degree", "2",
            "--pipeline.schedule", "1F1B",
            *VALIDATE_4,
        ),
    ),
    # pp 2 x FSDP 2, and the batch of 4 as 2 accumulation steps of 1 sequence per rank:
    # accumulation runs as more microbatches of one schedule step. Also records traces.
    "pp_fsdp": Run(
        4,
        (
            "--training.local_batch_size", "1",
            "--training.global_batch_size", "4",
            "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.pipeline_parallel_degree", "2",
            "--validation.local_batch_size", "2",
            "--profiling.enable_profiling",
            "--profiling.profile_freq", "10",
            "--profiling.profiler_warmup", "1",
        ),
    ),
    # Checkpoints of the TP and PP layouts resume in one process: tensor-parallel shards and
    # pipeline-stage parts all come back as one model, with optimizer, schedule and data.
    "tp_to_single": Run(1, ("--training.local_batch_size", "4"), resume_from="tp"),
    "pp_to_single": Run(1, ("--training.local_batch_size", "4"), resume_from="pp"),
}  # fmt: skip


def titan_train(*args: str) -> None:
    command = [sys.executable, "-m", "titan_train.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        start = result.stderr.find("Traceback")
        pytest.fail(f"{args} failed:\n{result.stderr[max(start, 0) :][:12000]}")


class Runs:
    """The table's runs, each launched the first time a test asks for it (a resuming run
    launches its source first), all from one seed checkpoint (the seed path's test; a fresh
    init is the same in every layout too): name -> its dump folder. Launching on demand keeps
    the runs of the tests marked ``full`` out of CI."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp = tmp_path_factory
        self._folders: dict[str, Path] = {}
        self._seed: Path | None = None

    def _seed_checkpoint(self) -> Path:
        if self._seed is None:
            seed = self._tmp.mktemp("seed") / "out"
            titan_train("--job.dump_folder", str(seed), "--checkpoint.create_seed_checkpoint")
            assert (seed / "checkpoint" / "step-0" / ".metadata").is_file()
            self._seed = seed / "checkpoint"
        return self._seed

    def __getitem__(self, name: str) -> Path:
        if name in self._folders:
            return self._folders[name]
        run = RUNS[name]
        seed = self._seed_checkpoint()
        folder = self._tmp.mktemp(name) / "out"
        if run.resume_from:
            shutil.copytree(self[run.resume_from], folder)
            shutil.rmtree(folder / "checkpoint" / f"step-{STEPS}")
            (folder / "metrics.jsonl").unlink()
        titan_train(
            "--nproc-per-node", str(run.nproc),
            "--job.dump_folder", str(folder),
            "--checkpoint.initial_load_path", str(seed),
            *TINY, *run.args,
        )  # fmt: skip
        self._folders[name] = folder
        return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory)


# What CI keeps at this level is what the model level (titan-models' layout tests) cannot
# show: the real command's files, resume, a checkpoint resharding to another layout (FSDP
# ranks into one process), validation and the profiler across layouts (pp_fsdp). That each
# layout trains like one process is CI's in titan-models; here it is `full` (the plain
# pipeline's runs too: the root conftest.py lists them with the tests that keep their proof).
FULL = pytest.mark.full  # the layout's model-level proof: tests/<family>/test_parallelize.py


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def losses(folder: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in records(folder) if key in r}


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


@pytest.mark.parametrize("layout", ["fsdp", pytest.param("tp", marks=FULL), "pp"])
def test_two_rank_checkpoint_resumes_on_one_rank(runs, layout):
    # Model, optimizer, schedule and data position all reshard from 2 ranks to 1: the
    # continuation follows the 2-rank run's own curve.
    source, resumed = losses(runs[layout]), losses(runs[f"{layout}_to_single"])
    assert sorted(resumed) == list(range(11, STEPS + 1))
    assert [resumed[s] for s in resumed] == pytest.approx([source[s] for s in resumed], rel=1e-4)


@FULL
def test_tensor_parallel_matches_one_process(runs):
    single, tp = losses(runs["single"]), losses(runs["tp"])
    assert [tp[s] for s in range(1, 4)] == pytest.approx([single[s] for s in range(1, 4)], rel=1e-5)


@FULL
@pytest.mark.parametrize("name", ["cp", "cp_ring"])
def test_context_parallel_matches_one_process(runs, name):
    single, cp = losses(runs["single"]), losses(runs[name])
    assert [cp[s] for s in range(1, 4)] == pytest.approx([single[s] for s in range(1, 4)], rel=1e-5)


def test_pipeline_parallel_matches_one_process(runs):
    single = losses(runs["single"])
    for name in ("pp", "pp_fsdp"):
        curve = losses(runs[name])
        assert sorted(curve) == list(range(1, STEPS + 1)), name
        assert [curve[s] for s in range(1, 4)] == pytest.approx(
            [single[s] for s in range(1, 4)], rel=1e-5
        ), name
        assert [curve[s] for s in single] == pytest.approx(list(single.values()), rel=2e-3), name
        # One checkpoint over every stage of every rank.
        assert (runs[name] / "checkpoint" / f"step-{STEPS}" / ".metadata").is_file(), name


@pytest.mark.parametrize(
    "name",
    ["fsdp", *(pytest.param(n, marks=FULL) for n in ("tp", "cp", "cp_ring")), "pp", "pp_fsdp"],
)
def test_validation_loss_at_steps_10_and_20_equal_across_layouts(runs, name):
    reference = losses(runs["single"], "validation/loss")
    assert sorted(reference) == [10, 20]
    other = losses(runs[name], "validation/loss")
    assert sorted(other) == [10, 20], name
    assert [other[s] for s in (10, 20)] == pytest.approx(
        [reference[s] for s in (10, 20)], rel=1e-4
    ), name
    # The resumed run validates at step 20 on the very same weights.
    assert losses(runs["resume"], "validation/loss") == {20: reference[20]}
    if name == "pp":
        events = EventAccumulator(str(runs["pp"] / "tb"))
        events.Reload()
        scalars = events.Scalars("validation/loss")
        assert [s.step for s in scalars] == [10, 20]
        assert scalars[0].value == pytest.approx(other[10], rel=1e-6)


def test_profiler_writes_a_chrome_trace_per_rank(runs):
    # profile_freq 10, warmup 1, active 1: steps 10 and 20 are recorded.
    traces = runs["pp_fsdp"] / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_10", "iteration_20"]
    for rank in range(4):
        trace = json.loads((traces / "iteration_10" / f"rank{rank}_trace.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert "aten::mm" in names, rank  # the recorded step's matmuls


@pytest.mark.parametrize(
    "name",
    ["single", "fsdp", *(pytest.param(n, marks=FULL) for n in ("tp", "cp")), "pp", "pp_fsdp"],
)
def test_tokens_per_second_is_per_device(runs, name):
    # Every layout trains a global batch of 4 x 64 tokens per step. tps is per device: TP,
    # CP and PP ranks share their data-parallel rank's tokens, so they are counted once.
    # Exact arithmetic on the logged numbers, no timing assumption.
    flops_per_token = set()
    for record in records(runs[name]):
        if "tps" not in record:
            continue
        assert record["global_tokens"] == 4 * 64, record
        assert record["devices"] == RUNS[name].nproc, record
        assert record["tps"] * record["devices"] == pytest.approx(
            record["global_tokens"] / record["step_s"], rel=1e-12
        ), record
        # TFLOPs and MFU follow from tps per device with the whole model's FLOPs per token.
        flops_per_token.add(round(record["tflops"] * 1e12 / record["tps"]))
    assert len(flops_per_token) == 1, flops_per_token
