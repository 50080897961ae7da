"""titan_dims.testing.run_torchrun: output, failures and timeouts (no orphaned workers)."""

import os

import pytest

from titan_dims.testing import run_torchrun


def test_runs_a_script_on_every_rank(tmp_path):
    script = tmp_path / "hello.py"
    # One write(2) per rank: both ranks share the pipe, and under PYTHONUNBUFFERED (as in CI)
    # print() issues a write per argument, which interleaves the two ranks' lines.
    script.write_text(
        "import os\n"
        "os.write(1, f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n\".encode())\n"
    )
    out = run_torchrun(script, 2, timeout=120).stdout
    assert sorted(line for line in out.splitlines() if line.startswith("rank")) == [
        "rank 0 of 2",
        "rank 1 of 2",
    ]


def test_a_failing_rank_raises_with_its_output(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise SystemExit('this rank gave up')\n")
    with pytest.raises(RuntimeError, match="this rank gave up"):
        run_torchrun(script, 1, timeout=120)


def test_timeout_kills_the_workers(tmp_path):
    pid_file = tmp_path / "pid"
    script = tmp_path / "hang.py"
    script.write_text(
        f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n"
    )
    with pytest.raises(RuntimeError, match="did not finish within 8 s and was killed"):
        run_torchrun(script, 1, timeout=8)
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker is gone, not orphaned
