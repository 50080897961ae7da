"""Bad usage of ``titan-ckpt`` prints one ``titan-ckpt: error:`` line and exits with status 2;
every subcommand has --help."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("command", ["inspect", "verify", "diff", "convert"])
def test_help(command, titan_ckpt):
    code, out, _ = titan_ckpt(command, "--help")
    assert code == 0
    assert out.startswith(f"usage: titan-ckpt {command}")
    # At least one example of the command itself, as a line of its own.
    examples = out.split("examples:\n", 1)[1].splitlines()
    assert examples
    assert all(line.startswith(f"  titan-ckpt {command} ") for line in examples)


def test_bad_usage_exits_2(saved_folder, tmp_path, titan_ckpt):
    (tmp_path / "empty").mkdir()
    step = saved_folder / "step-2"
    cases = [
        (("inspect", tmp_path / "nope"), f"{tmp_path / 'nope'} does not exist"),
        (("verify", tmp_path / "empty"), "is not a checkpoint"),
        (("convert", step, tmp_path / "o"), "the following arguments are required: --to"),
        (("convert", step, tmp_path / "o", "--to", "hf"), "--to hf needs --model"),
        (("convert", step, tmp_path / "o", "--to", "hf", "--model", "nosuch", "--flavor", "x"),
         "No state-dict adapter named 'nosuch'"),
        (("convert", step, tmp_path / "o", "--to", "dcp", "--max-shard-size", "big"),
         "--max-shard-size 'big'"),
        (("convert", saved_folder, tmp_path / "o", "--to", "dcp"), "pass one step"),
        (("diff", step, step, "--atol", "-1"), "--atol and --rtol must be >= 0"),
        (("frobnicate",), "invalid choice"),
    ]  # fmt: skip
    for args, message in cases:
        code, _, err = titan_ckpt(*args)
        assert code == 2, args
        assert err.strip().splitlines()[-1].startswith("titan-ckpt: error: "), err
        assert message in err, (args, err)
    assert not (tmp_path / "o").exists()
