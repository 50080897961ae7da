"""titan-train resuming from a checkpoint whose ``.metadata`` was poisoned (a pickle that would
create a marker file when unpickled): the run stops before any work with one message naming
the class, exit status 2, and the marker never appears; the same for a gadget that changes
an allowlisted function (a BUILD on ``torch.serialization._get_layout``), which stays
unchanged. Checked against the real CLI in one process and real DCP files written by an
earlier run."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct

import torch
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
    clean = (step / ".metadata").read_bytes()
    metadata = pickle.loads(clean)  # our own file: trusted here
    metadata.planner_data = {"note": Poison(str(marker))}
    _replace_metadata(step, pickle.dumps(metadata))
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

    # A gadget that runs no global of its own: a BUILD on the allowlisted function
    # torch.serialization._get_layout, which a second unpickling of the same bytes would
    # have used to resolve os.system (titan-ckpt's test_pickle_gadgets has the whole pair).
    gadget = _global("torch.serialization", "_get_layout") + pickle.EMPTY_DICT + pickle.MARK
    gadget += _str("cache") + pickle.EMPTY_DICT + pickle.MARK + _str("m") + _str("posix")
    gadget += pickle.SETITEMS + pickle.SETITEMS + pickle.BUILD + pickle.POP
    _replace_metadata(step, clean[:2] + gadget + clean[2:])
    code = main(["train", *TINY, "--training.steps", "4", "--job.dump_folder", str(dump)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "a change to the state of function _get_layout" in err
    assert "m" not in torch.serialization._get_layout.cache
    assert not (dump / "checkpoint" / "step-4").exists()


def _replace_metadata(step, data: bytes) -> None:
    """Write ``data`` as the step's .metadata and fix the commit marker's manifest, as an
    attacker would, so that only the pickle check remains."""
    (step / ".metadata").write_bytes(data)
    commit = json.loads((step / "titan-commit.json").read_text())
    commit["files"][".metadata"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "titan-commit.json").write_text(json.dumps(commit))


def _str(text: str) -> bytes:
    return pickle.BINUNICODE + struct.pack("<I", len(text)) + text.encode()


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()
