"""What a run tells its user: a summary line at the end (steps, final loss, wall time, where
the outputs are); a finished run started again says so and writes nothing; a resume with
another model leads with the checkpoint's model record. Real runs of the CLI, in one
process, on a tiny model with real DCP files."""

from __future__ import annotations

import logging
import os

from titan_train.cli import main

TINY = [
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--checkpoint.enable",
    "--lr_scheduler.warmup_steps", "1",
]  # fmt: skip


def _files(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder)
                  for f in fs)  # fmt: skip


def test_a_run_reports_its_end_and_a_finished_run_writes_nothing(tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="titan_train")
    out = tmp_path / "out"
    args = ["train", *TINY, "--training.steps", "2", "--job.dump_folder", str(out)]
    assert main(args) == 0
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Done:")]
    assert len(done) == 1, caplog.text
    assert "steps 1-2 of 2, final loss " in done[0]
    assert f"checkpoints {out / 'checkpoint'}" in done[0]
    assert f"metrics {out / 'metrics.jsonl'}" in done[0]
    assert f"TensorBoard {out / 'tb'}" in done[0]

    files = _files(out)
    jsonl = (out / "metrics.jsonl").read_bytes()
    caplog.clear()
    assert main(args) == 0
    assert "Already finished at step 2 (training.steps 2): nothing to do; raise " \
        "--training.steps to continue." in caplog.text  # fmt: skip
    assert "Done:" not in caplog.text
    assert _files(out) == files  # no new TensorBoard file, no lock left behind
    assert (out / "metrics.jsonl").read_bytes() == jsonl

    # Another model on the same folder: the checkpoint's record first, no key list.
    qwen = [*args, "--model.name", "qwen3", "--training.steps", "3"]
    assert main(qwen) == 2
    err = capsys.readouterr().err
    assert "was written by llama3 debugmodel; this run is qwen3 debugmodel" in err
    assert len(err) < 400, err
    assert _files(out) == files
