"""What a run tells its user: a summary line at the end (steps, final loss, wall time, where
the outputs are); a finished run started again says so and writes nothing; a resume with
another model leads with the checkpoint's model record. Real runs of the CLI, in one
process, on a tiny model with real DCP files (one 2-step run shared by the tests)."""

from __future__ import annotations

import logging
import os

import pytest

from titan_train.cli import main

TINY = [
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--checkpoint.enable",
    "--lr_scheduler.warmup_steps", "1",
]  # fmt: skip


def _files(folder):
    return sorted(
        os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run: its arguments, folder and the log of its end."""
    out = tmp_path_factory.mktemp("run") / "out"
    args = ["train", *TINY, "--training.steps", "2", "--job.dump_folder", str(out)]
    handler, log = _Collect(), logging.getLogger("titan_train")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        assert main(args) == 0
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return args, out, handler.lines


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_last_line_says_what_was_done(finished):
    _, out, lines = finished
    done = [line for line in lines if line.startswith("Done:")]
    assert len(done) == 1, lines
    assert "steps 1-2 of 2, final loss " in done[0]
    assert f"checkpoints {out / 'checkpoint'}" in done[0]
    assert f"metrics {out / 'metrics.jsonl'}" in done[0]
    assert f"TensorBoard {out / 'tb'}" in done[0]


def test_a_finished_run_says_so_and_writes_nothing(finished, caplog):
    args, out, _ = finished
    files = _files(out)
    jsonl = (out / "metrics.jsonl").read_bytes()
    caplog.set_level(logging.INFO, logger="titan_train")
    assert main(args) == 0
    assert (
        "Already finished at step 2 (training.steps 2): nothing to do; raise "
        "--training.steps to continue." in caplog.text
    )
    assert "Done:" not in caplog.text
    assert _files(out) == files  # no new TensorBoard file, no lock left behind
    assert (out / "metrics.jsonl").read_bytes() == jsonl


def test_another_model_is_named_before_any_work(finished, capsys):
    args, out, _ = finished
    files = _files(out)
    assert main([*args, "--model.name", "qwen3", "--training.steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "was written by llama3 debugmodel; this run is qwen3 debugmodel" in err
    assert len(err) < 400, err  # the record, not a list of missing keys
    assert _files(out) == files
