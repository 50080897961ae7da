"""The titan-dims command: text and JSON plans, and exit status 2 on bad degrees."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from titan_dims.cli import format_ranks, main


def test_plan_text(capsys):
    assert main(["plan", "--world-size", "4096", "--tp", "8", "--pp", "4", "--rank", "1234"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("world_size 4096: dp_shard=128, tp=8, pp=4\n")
    assert "rank 1234: pp=1 dp_shard=26 tp=2; loads data shard 26 of 128" in out
    assert "  pp                     4   210, 1234, 2258, 3282" in out
    assert "  tp                     8   1232-1239" in out
    assert "  dp_shard_cp          128   1026, 1034, ..., 2042 (every 8)" in out


def test_plan_json_lists_every_group_in_full(capsys):
    argv = [
        "plan",
        "--world-size",
        "16",
        "--dp-replicate",
        "2",
        "--cp",
        "2",
        "--ep",
        "4",
        "--rank",
        "5",
        "--json",
    ]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["degrees"] == {"dp_replicate": 2, "dp_shard": 4, "cp": 2, "tp": 1, "pp": 1, "ep": 4}
    assert [d["name"] for d in plan["dims"]] == [
        "dp_replicate",
        "dp_shard_mod_ep",
        "dp_shard_in_ep",
        "cp",
    ]
    assert {f["name"]: f["size"] for f in plan["flattened"]} == {
        "dp": 8,
        "dp_shard_cp": 8,
        "dp_cp": 16,
        "ep": 4,
    }
    assert plan["rank"]["coordinates"] == {
        "dp_replicate": 0,
        "dp_shard_mod_ep": 1,
        "dp_shard_in_ep": 0,
        "cp": 1,
    }
    assert plan["rank"]["groups"]["ep"] == [4, 5, 6, 7]
    assert plan["rank"]["groups"]["dp"] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert plan["rank"]["dp_rank"] == 2


def test_plan_without_rank_describes_the_world(capsys):
    assert main(["plan", "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "world_size 1: a single rank" in out
    assert "loads data shard" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "8", "--tp", "3"], "Cannot infer dp_shard"),
        (["--world-size", "8", "--dp-shard", "3"], "= 3, but world_size is 8"),
        (["--world-size", "16", "--ep", "32"], "ep(32) must divide"),
        (["--world-size", "8", "--rank", "8"], "--rank 8 is outside the world of 8 ranks"),
        (["--world-size", "0"], "world_size=0 is not allowed"),
    ],
)
def test_bad_degrees_exit_2_with_one_message(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("titan-dims: error: ")
    assert message in captured.err
    assert captured.err.count("\n") == 1


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--tp", "2"])
    assert exit_info.value.code == 2
    assert "--world-size" in capsys.readouterr().err


def test_plan_help_shows_its_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert len(examples) == 3
    assert all(line.startswith("  titan-dims plan --world-size ") for line in examples)


def test_no_numpy_warning_without_numpy():
    """In a torch-only environment torch warns at import that NumPy failed to load: a line
    the command must not print (NumPy is made unimportable here, as if not installed)."""
    code = "import sys; sys.modules['numpy'] = None; from titan_dims.cli import main"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "NumPy" not in result.stderr


def test_installed_command_runs():
    # The console script sits beside the interpreter of the environment under test.
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    command = shutil.which("titan-dims", path=search)
    assert command, "the titan-dims console script is not installed"
    result = subprocess.run([command, "plan", "--help"], capture_output=True, text=True, check=True)
    assert "--world-size" in result.stdout
    assert "--json" in result.stdout


def test_format_ranks():
    assert format_ranks([4, 5, 6, 7]) == "4-7"
    assert format_ranks([1, 5]) == "1, 5"
    assert format_ranks(list(range(0, 64, 4)), max_ranks=8) == "0, 4, ..., 60 (every 4)"
    assert format_ranks([0, 1, 5, 9, 10, 20], max_ranks=4) == "0, 1, ..., 10, 20"
