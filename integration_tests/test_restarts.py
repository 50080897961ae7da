"""Restarts you can watch work: a 2-rank ``titan-train`` run under ``--max-restarts 1`` (or
plain ``torchrun --max-restarts 1``) whose worker is killed with SIGKILL mid-step or mid-save
comes back by itself from the newest committed checkpoint and trains the same losses as an
uninterrupted run, and no restart ever loads an uncommitted step.

The kill comes from ``faults/titan_faults.py``, loaded into the workers through Python's
start-up hook (``faults/sitecustomize.py`` on their PYTHONPATH): SIGKILL on one rank of the
first attempt at a planned point (in a training step, inside a save before or after its data
is written, just after a commit, or after a random delay), recording the steps on disk at
that moment; on every attempt it records each checkpoint read before it happens. Losses are
read from the run's ``metrics.jsonl``, which every attempt appends to: a step trained twice
(before the kill and after the restart) is there twice, and both must equal the reference.

The first five trials are fixed (``TITAN_RESTART_TRIALS``, default 1: the one CI runs, ~35 s alone
with the reference run); later ones are drawn from a seeded generator, so
``TITAN_RESTART_TRIALS=8 pytest integration_tests/test_restarts.py`` is the same 8 trials
every time (~20 s each; all but the first are marked ``slow``).

Preemption, the clean stop: SIGTERM to the ``titan-train`` launcher once step 3 is logged;
the run saves the step both ranks stopped after, exits with status 143, and the same command
resumes from it to the reference's losses (two launches, marked ``slow``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from titan_ckpt.layout import scan_steps
from titan_ckpt.storage import LocalStorage
from titan_train.launch import SHARED_STORE_VARIABLE
from titan_train.trainer.preemption import PREEMPTED_EXIT

FAULTS = Path(__file__).parent / "faults"
STEPS = 8
TINY = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "32",
    "--training.local_batch_size", "1",
    "--parallelism.data_parallel_shard_degree", "2",
    "--parallelize.param_dtype", "float32",
    "--metrics.log_freq", "1",
    "--metrics.no-enable-tensorboard",
    "--checkpoint.interval", "2",
    "--checkpoint.keep_latest_k", "2",  # retention runs (and can be killed) too
]  # fmt: skip
POINTS = ("step", "save-start", "save-written", "commit", "delay")
FIXED = [
    # rank 0 has written its share of step 4, nothing is committed: step 2 must be loaded.
    {"launcher": "titan-train", "rank": 0, "point": "save-written", "step": 4},
    # Mid-step on the other rank, through plain torchrun.
    {"launcher": "torchrun", "rank": 1, "point": "step", "step": 5},
    {"launcher": "titan-train", "rank": 1, "point": "save-start", "step": 6},
    {"launcher": "torchrun", "rank": 0, "point": "commit", "step": 2},
    # Saves written in the background (committed by rank 0's thread): killed while step 4's
    # write is in flight.
    {
        "launcher": "titan-train",
        "rank": 1,
        "point": "async-staged",
        "step": 4,
        "args": ["--checkpoint.async_mode", "async"],
    },
]
SEED = 13


def trials(count: int) -> list[dict]:
    """The first ``count`` trials: the fixed ones, then seeded random ones."""
    rng = random.Random(SEED)
    out = list(FIXED[:count])
    while len(out) < count:
        point = rng.choice(POINTS)
        trial = {
            "launcher": rng.choice(["titan-train", "torchrun"]),
            "rank": 0 if point == "commit" else rng.randrange(2),
            "point": point,
            "step": rng.randrange(1, STEPS + 1)
            if point == "step"
            else rng.randrange(2, STEPS + 1, 2),
            "delay": round(rng.uniform(0.0, 2.5), 2),
        }
        out.append(trial)
    return out


TRIALS = [
    pytest.param(trial, marks=[pytest.mark.slow] if i else [])  # the first one runs in CI
    for i, trial in enumerate(trials(int(os.environ.get("TITAN_RESTART_TRIALS", "1"))))
]


def launch(
    launcher: str, folder: Path, restarts: int, env: dict | None = None, extra: tuple = ()
) -> str:
    """Train the tiny 2-rank job in ``folder``; its stderr. Plain torchrun gets the fresh
    rendezvous store per restart that titan-train's launcher asks for by itself."""
    if launcher == "titan-train":
        head = [sys.executable, "-m", "titan_train.cli", "--nproc-per-node", "2"]
        head += ["--max-restarts", str(restarts)] if restarts else []
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        head += ["--nproc-per-node", "2", "--max-restarts", str(restarts)]
        head += ["-m", "titan_train.cli"]
        env = {SHARED_STORE_VARIABLE: "1", **(env or {})}
    command = [*head, "--job.dump_folder", str(folder), *TINY, *extra]
    code, stderr = run_group(command, {**os.environ, **(env or {})})
    if code != 0:
        start = stderr.find("Traceback")
        pytest.fail(f"{command} exited {code}:\n{stderr[max(start, 0) :][-8000:]}")
    return stderr


def run_group(command: list[str], env: dict, timeout: float = 400) -> tuple[int, str]:
    """Run ``command`` in a process group of its own; on a timeout, kill the whole group
    (launcher, agent and workers), so no rank outlives the test."""
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        pytest.fail(f"{command} did not finish in {timeout} s:\n{stderr[-8000:]}")
    return process.returncode, stderr


def loss_records(folder: Path) -> list[tuple[int, float]]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    folder = tmp_path_factory.mktemp("reference") / "out"
    launch("titan-train", folder, restarts=0)
    curve = dict(loss_records(folder))
    assert sorted(curve) == list(range(1, STEPS + 1))
    return curve


def trial_id(trial: dict) -> str:
    where = trial["delay"] if trial["point"] == "delay" else trial["step"]
    extra = "-" + "-".join(a.strip("-") for a in trial["args"][1:]) if "args" in trial else ""
    return f"{trial['launcher']}-rank{trial['rank']}-{trial['point']}-{where}{extra}"


@pytest.mark.parametrize("trial", TRIALS, ids=[trial_id(p.values[0]) for p in TRIALS])
def test_a_killed_worker_restarts_from_the_newest_commit_with_the_same_losses(
    tmp_path, reference, trial
):
    folder = tmp_path / "out"
    log = tmp_path / "faults.jsonl"
    plan = {**trial, "folder": str(folder / "checkpoint"), "log": str(log), "last_step": STEPS}
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH")) if p)
    stderr = launch(
        trial["launcher"],
        folder,
        restarts=1,
        env={"PYTHONPATH": path, "TITAN_FAULT_PLAN": json.dumps(plan)},
        extra=tuple(trial.get("args", ())),
    )
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kills = [e for e in events if e["event"] == "kill"]
    assert len(kills) == 1, (events, stderr[-3000:])
    kill = kills[0]
    assert (kill["rank"], kill["attempt"]) == (trial["rank"], 0)
    assert not kill["foreign"], kill

    # Every read of a checkpoint, on every rank and attempt: a committed step, the newest.
    loads = [e for e in events if e["event"] == "load"]
    assert all(e["attempt"] == 1 for e in loads), loads  # the first attempt starts fresh
    for load in loads:
        assert load["committed"], load
        assert load["step"] == load["newest_committed"], load
    resumed = {e["step"] for e in loads}
    assert len(resumed) <= 1, loads  # every rank of the restart loads the same step
    if kill["committed"]:
        assert resumed, (kill, loads)
        assert min(resumed) >= max(kill["committed"]), (kill, loads)
    if trial["point"] in ("save-start", "save-written") and (trial["rank"], trial["point"]) != (
        1,
        "save-written",
    ):
        # Killed inside the save of step N before rank 0 could commit it: N is on disk,
        # uncommitted, and the restart loads the step before it.
        assert kill["uncommitted"] == [trial["step"]], kill
        assert resumed == ({trial["step"] - 2} if trial["step"] > 2 else set()), (kill, loads)

    # The curve: every step, and every record of a step trained twice, equals the reference.
    records = loss_records(folder)
    assert sorted({s for s, _ in records}) == list(range(1, STEPS + 1))
    assert [(s, loss) for s, loss in records] == [(s, reference[s]) for s, _ in records]
    finals = sorted(p.name for p in (folder / "checkpoint").iterdir())
    assert finals == [f"step-{STEPS - 2}", f"step-{STEPS}"], finals


STOP_LINE = re.compile(r"SIGTERM: stopping after step (\d+), saving it; exit status 143")


@pytest.mark.slow
def test_sigterm_saves_the_agreed_step_exits_143_and_resumes_to_the_same_losses(
    tmp_path, reference
):
    """Preemption as a scheduler does it: SIGTERM to the launcher alone (Kubernetes signals a
    container's first process) once step 3 is logged. One line, the step both ranks stopped
    after saved and committed, status 143; the same command resumes from it."""
    folder = tmp_path / "out"
    command = [sys.executable, "-m", "titan_train.cli", "--nproc-per-node", "2"]
    command += ["--job.dump_folder", str(folder), *TINY]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        metrics = folder / "metrics.jsonl"
        while process.poll() is None and not (metrics.exists() and len(loss_records(folder)) > 2):
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=300)
    finally:
        # A launcher that dies at the signal leaves the agent training: end the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    stops = STOP_LINE.findall(stderr)
    assert process.returncode == PREEMPTED_EXIT == 143, stderr[-8000:]
    assert len(stops) == 1, stderr[-8000:]
    stopped = int(stops[0])
    assert 3 <= stopped < STEPS
    assert loss_records(folder)[-1][0] == stopped  # the last step trained is the one saved
    scan = scan_steps(LocalStorage(), str(folder / "checkpoint"), log=False)
    assert scan.committed[-1] == stopped, scan
    assert not scan.uncommitted, scan

    stderr = launch("titan-train", folder, restarts=0)
    assert f"Loaded {folder / 'checkpoint' / f'step-{stopped}'}" in stderr
    records = loss_records(folder)
    assert [s for s, _ in records] == list(range(1, STEPS + 1))
    assert records == [(s, reference[s]) for s, _ in records]
