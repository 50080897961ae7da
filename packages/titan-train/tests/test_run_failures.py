"""``titan-train`` when its environment fails: an unusable checkpoint folder is refused
before any work (exit 2), and so is one another run holds (exit 1, nothing written); a disk
that fills up mid-run, or training that diverges, stops the run with one message and exit 1,
no traceback, committed steps intact and resumable.

The disk-full run writes its dump folder onto a real small filesystem (a tmpfs; skipped
where this process may not mount one); the diverging run gets a learning rate of 1e30.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan_ckpt import CheckpointConfig, LocalStorage, lock_checkpoint_folder
from titan_ckpt.commands.cli import main as titan_ckpt_main
from titan_ckpt.layout import scan_steps
from titan_train.cli import main

TINY = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--checkpoint.interval", "1",
]  # fmt: skip


def train(dump, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "titan_train.cli", "--job.dump_folder", str(dump), *TINY, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def mount(where, *options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)]
    return os.geteuid() == 0 and subprocess.run(command, capture_output=True).returncode == 0


@pytest.fixture
def tmpfs(tmp_path):
    """Mounts tmpfs filesystems under tmp_path on request; unmounts them after the test."""
    mounted = []

    def make(name: str, *options: str):
        where = tmp_path / name
        if not mount(where, *options):
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def committed(folder) -> list[int]:
    return scan_steps(LocalStorage(), str(folder)).committed


def run_in_process(args, capsys) -> tuple[int, str]:
    code = main(["train", *TINY, *args])
    return code, capsys.readouterr().err


def test_a_path_through_a_file_exits_2_before_any_work(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    code, err = run_in_process(["--job.dump_folder", str(tmp_path / "taken" / "out")], capsys)
    assert code == 2
    assert "titan-train: error: checkpoint.folder=" in err
    assert f"{tmp_path / 'taken'} is a file" in err


def test_a_url_without_its_filesystem_exits_2(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--job.dump_folder", str(out), "--checkpoint.folder", "nosuchfs://bucket/ckpt"]
    code, err = run_in_process(args, capsys)
    assert code == 2
    assert "nosuchfs:// URL, which this environment cannot open" in err
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "latin1.txt",
            "caf\xe9 au lait\n\nsecond paragraph\n".encode("latin-1"),
            "is not UTF-8 text",
        ),
        ("one.jsonl", b'{"text": "the only document"}\n', "has no document for data shard(s) [1,"),
    ],
    ids=["not-utf8", "fewer-documents-than-shards"],
)
def test_an_unusable_dataset_stops_before_anything_is_written(
    tmp_path, capsys, name, content, message
):
    # Found when the data opens (the first document of each data shard is read), before the
    # model, metrics, TensorBoard or checkpoint folder: the dump folder is never created.
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "out"
    code, err = run_in_process(
        ["--job.dump_folder", str(out), "--training.dataset", str(data)], capsys
    )
    assert code == 2
    errors = [line for line in err.splitlines() if "titan-train: error:" in line]
    assert len(errors) == 1
    assert message in errors[0]
    assert "Traceback" not in err
    assert not out.exists()


def test_a_checkpoint_folder_another_run_holds_stops_the_run_before_any_work(tmp_path, capsys):
    dump = tmp_path / "out"
    # The first run's lock, as it holds it (from this process: flock locks are per open).
    held = lock_checkpoint_folder(CheckpointConfig(enable=True, folder=str(dump / "checkpoint")))
    before = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    try:
        code, err = run_in_process(
            ["--job.dump_folder", str(dump), "--training.steps", "2"], capsys
        )
        after = sorted((str(p), p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    finally:
        held.release()
    assert code == 1
    errors = [line for line in err.splitlines() if "titan-train: error:" in line]
    assert len(errors) == 1, err
    assert f"is in use by another run: process {os.getpid()} on host" in errors[0]
    assert "checkpoint.load_only=true" in errors[0]
    assert "Traceback" not in err
    assert after == before  # nothing written: no metrics, no step, no folder


def test_a_read_only_dump_folder_exits_2(tmpfs, capsys):
    read_only = tmpfs("ro", "ro", "size=64k")
    code, err = run_in_process(["--job.dump_folder", str(read_only / "out")], capsys)
    assert code == 2
    assert "read-only filesystem" in err


def test_a_full_disk_stops_the_run_and_the_rerun_resumes(tmpfs, tmp_path, capsys):
    # One step of the debug model with AdamW state is ~72 MiB: one fits, two do not.
    disk = tmpfs("disk", "size=110m")
    dump = disk / "run"
    first = train(dump, "--training.steps", "3")
    assert first.returncode == 1, first.stderr[-3000:]
    errors = [line for line in first.stderr.splitlines() if "titan-train: error:" in line]
    assert len(errors) == 1
    assert f"Checkpoint of step 2 failed: the disk is full at {dump}/checkpoint/step-2" in errors[0]
    assert "Committed steps [1] are intact; a rerun resumes from step 1" in errors[0]
    assert "Traceback" not in first.stderr
    assert "inline_container" not in first.stderr
    assert first.stderr.count("fewer than two steps fit") == 1  # the first save's warning
    assert committed(dump / "checkpoint") == [1]
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-1"]
    capsys.readouterr()
    assert titan_ckpt_main(["verify", str(dump / "checkpoint" / "step-1")]) == 0

    subprocess.run(["mount", "-o", "remount,size=400m", str(disk)], check=True)
    rerun = train(dump, "--training.steps", "3")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"Loaded {dump}/checkpoint/step-1" in rerun.stderr
    assert committed(dump / "checkpoint") == [1, 2, 3]


def test_a_diverging_run_skips_then_stops_and_saves_nothing_broken(tmp_path):
    dump = tmp_path / "out"
    args = ["--training.steps", "8", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0"]
    done = train(dump, *args, "--training.skip_nonfinite_steps", "2")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "titan-train: error: Step 4: the gradient norm is nan, the 3rd non-finite one" in (
        done.stderr
    )
    assert done.stderr.count("update skipped") == 2  # one warning line per skipped step
    assert "Skipped an optimizer step" not in done.stderr  # (not the container's as well)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 0), (2, 1), (3, 2)]
    # Steps 1-3 committed (2 and 3 left the weights of 1 as they were); step 4 never saved.
    assert committed(dump / "checkpoint") == [1, 2, 3]
    assert not (dump / "checkpoint" / "step-4").exists()
    dcp_to_torch_save(dump / "checkpoint" / "step-3", tmp_path / "step3.pt")
    state = torch.load(tmp_path / "step3.pt", weights_only=False)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    assert tensors
    assert all(torch.isfinite(t).all() for t in tensors)
