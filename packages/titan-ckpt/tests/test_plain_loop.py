"""titan-ckpt in a plain training loop: the states a torch user passes as they are (a bare
optimizer, an LR scheduler, a bare module, a Stateful of their own) survive a SIGKILL, and
what cannot be saved is refused when the manager is built."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointManager,
    Loaded,
    OptimizerState,
)

LOOP = Path(__file__).parent / "workers" / "plain_loop.py"


def _loop():
    """The worker's module, imported by path (tests run in importlib mode)."""
    spec = importlib.util.spec_from_file_location("titan_ckpt_plain_loop", LOOP)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_identical(a: object, b: object, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype, where
        assert torch.equal(a, b), where  # bit for bit: no tolerance
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)), where
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_killed_and_resumed_loop_ends_bit_identical_to_an_uninterrupted_one(tmp_path):
    # A process killed after step 7, when step 4 is its last committed step; meanwhile the
    # uninterrupted run, here. Then this process, which never ran the killed one, resumes.
    args = [sys.executable, str(LOOP), str(tmp_path / "killed"), "10", str(tmp_path / "x"), "7"]
    killed = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    loop = _loop()
    loop.main(str(tmp_path / "whole"), 10, str(tmp_path / "whole.pt"), None)
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    assert [p.name for p in (tmp_path / "killed").glob("step-*")] == ["step-4"]
    loop.main(str(tmp_path / "killed"), 10, str(tmp_path / "resumed.pt"), None)

    expected = torch.load(tmp_path / "whole.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert (expected.pop("start"), resumed.pop("start")) == (0, 4)
    assert expected["optimizer"]["state"]  # the moments are there to compare
    for name in expected:  # model, ema (a bare module), optimizer, lr_scheduler, rng
        _assert_identical(expected[name], resumed[name], name)


def test_load_returns_what_it_loaded(tmp_path):
    model = nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    config = CheckpointConfig(folder=str(tmp_path))  # the defaults save
    with CheckpointManager(config, model_parts=model, states={"optimizer": optimizer}) as m:
        nothing = m.load()
        assert not nothing
        assert nothing == Loaded()
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        assert m.save(3, force=True)
    with CheckpointManager(config, model_parts=model, states={"optimizer": optimizer}) as m:
        loaded = m.load()
    assert loaded
    assert (loaded.step, loaded.kind) == (3, "resume")
    assert loaded.path is not None
    assert loaded.path.endswith("step-3")
    assert loaded.states == ("model", "optimizer")


def test_an_optimizer_of_parameters_outside_the_model_is_refused(tmp_path):
    other = torch.optim.AdamW(nn.Linear(2, 2).parameters())
    with pytest.raises(CheckpointConfigError, match=r"OptimizerState\(model_parts, optimizers\)"):
        CheckpointManager(
            CheckpointConfig(folder=str(tmp_path)),
            model_parts=nn.Linear(2, 2),
            states={"optimizer": other},
        )
    assert not tmp_path.joinpath(".titan-ckpt.lock").exists()


def test_a_state_without_state_dict_is_refused_in_one_line(tmp_path):
    with pytest.raises(TypeError, match=r"states\['step'\] is a int without state_dict\(\)") as e:
        CheckpointManager(
            CheckpointConfig(folder=str(tmp_path)), model_parts=nn.Linear(2, 2), states={"step": 3}
        )
    assert "\n" not in str(e.value)


def test_an_optimizer_already_wrapped_is_kept(tmp_path):
    model = nn.Linear(2, 2)
    wrapped = OptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with CheckpointManager(
        CheckpointConfig(folder=str(tmp_path)), model_parts=model, states={"optimizer": wrapped}
    ) as manager:
        assert manager.states["optimizer"] is wrapped
