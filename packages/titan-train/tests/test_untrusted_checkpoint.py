"""titan-train resuming from a checkpoint whose ``.metadata`` was poisoned (a pickle that would
create a marker file when unpickled): the run stops before any work with one message naming
the class, exit status 2, and the marker never appears. Checked against the real CLI in one
process and real DCP files written by an earlier run."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

import torch.distributed as dist

from titan_train.cli import main

TINY = [
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--metrics.no_enable_tensorboard",
    "--checkpoint.enable",
    "--checkpoint.interval", "2",
    "--checkpoint.no_last_save_model_only",
    "--lr_scheduler.warmup_steps", "1",
]  # fmt: skip


class Poison:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_resume_from_a_poisoned_checkpoint_exits_2_and_runs_nothing(tmp_path, capsys):
    dump = tmp_path / "run"
    assert main(["train", *TINY, "--training.steps", "2", "--job.dump_folder", str(dump)]) == 0
    # A clean resume goes through the same allowlist: titan-train's own states (dataloader,
    # LR scheduler, train state, optimizer) need nothing beyond it.
    assert main(["train", *TINY, "--training.steps", "3", "--job.dump_folder", str(dump)]) == 0
    logged = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").open()]
    assert logged == [1, 2, 3]  # the second run resumed at step 2: it trained step 3 alone
    step = dump / "checkpoint" / "step-3"
    marker = tmp_path / "pwned"
    metadata = pickle.loads((step / ".metadata").read_bytes())  # our own file: trusted here
    metadata.planner_data = {"note": Poison(str(marker))}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    # The attacker also fixes the commit marker's manifest, so only the pickle check remains.
    commit = json.loads((step / "titan-commit.json").read_text())
    data = (step / ".metadata").read_bytes()
    commit["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "titan-commit.json").write_text(json.dumps(commit))
    capsys.readouterr()

    code = main(["train", *TINY, "--training.steps", "4", "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert not marker.exists()
    assert f"{os.system.__module__}.system" in err
    assert str(step / ".metadata") in err
    assert "checkpoint.trust_pickles" in err
    assert "Traceback" not in err
    assert not (dump / "checkpoint" / "step-4").exists()  # no training happened
    assert not dist.is_initialized()
