"""titan-train continues torchtitan's own step-10 checkpoint to the step-11 loss torchtitan
itself gets, data restarted on both sides (``tools/torchtitan_reference/step11.py``).

The comparison runs torchtitan, so it needs a checkout of its July 2025 commit and a venv
that runs it: set ``TORCHTITAN_REPO`` and ``TORCHTITAN_VENV`` (``record.py``'s README says
how to make them); without them it is skipped. About 30 s on two cores.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

TOOL = Path(__file__).parents[4] / "tools" / "torchtitan_reference" / "step11.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("step11", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


step11 = _load_tool()


def test_a_folder_that_is_no_checkout_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        step11.main(["--torchtitan", str(tmp_path), "--venv", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path / step11.TOML) in err
    assert "torchtitan checkout" in err


# full: CI has no torchtitan; test_resume_from_torchtitan.py keeps the recorded resume proof.
@pytest.mark.slow
@pytest.mark.full
@pytest.mark.skipif(
    not (os.environ.get("TORCHTITAN_REPO") and os.environ.get("TORCHTITAN_VENV")),
    reason="set TORCHTITAN_REPO (torchtitan 6204cdff9 checkout) and TORCHTITAN_VENV",
)
def test_step_11_loss_equals_torchtitans(tmp_path, capsys):
    code = step11.main(
        [
            "--torchtitan", os.environ["TORCHTITAN_REPO"],
            "--venv", os.environ["TORCHTITAN_VENV"],
            "--work", str(tmp_path / "runs"),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    losses = dict(re.findall(r"^(torchtitan|titan) +step 11 loss: ([0-9.]+)$", out, re.M))
    assert set(losses) == {"torchtitan", "titan"}, out
    assert abs(float(losses["titan"]) - float(losses["torchtitan"])) <= 1e-4, out
    assert code == 0
    # Both continued the same step-10 checkpoint, which torchtitan wrote and nobody changed.
    runs = tmp_path / "runs"
    assert (runs / "titan_step_11" / "checkpoint" / "step-11").is_dir()
    assert (runs / "torchtitan_step_11" / "checkpoint" / "step-11").is_dir()
