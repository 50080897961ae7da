"""``titan-train --optimizer.name Muon``: a real run trains (its loss falls).

Checked against the run's own metrics file; the optimizer's numerics are titan-optim's tests.
"""

import json

from titan_train.cli import main

ARGS = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.name", "Muon",
    "--optimizer.lr", "3e-3",
    "--optimizer.muon.momentum", "0.9",
]  # fmt: skip


def losses(dump) -> dict[int, float]:
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_a_muon_run_trains(tmp_path):
    dump = tmp_path / "out"
    assert main(["train", "--job.dump_folder", str(dump), *ARGS, "--training.steps", "16"]) == 0
    seen = losses(dump)
    assert max(seen[i] for i in (14, 15, 16)) < seen[1] - 0.3
