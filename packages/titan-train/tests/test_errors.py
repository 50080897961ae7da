"""titan_train.errors: the root error, the one configuration error and the shared checks;
and which errors of the five packages ``titan-train`` reports as usage errors (status 2).

Every titan package's ``errors.py`` has the same checks with the same messages; the cases
below are the same in each package's ``test_errors.py``, so the shape cannot drift.
"""

import pytest

from titan_train.cli import _run_stops, _usage_errors, main
from titan_train.errors import (
    ConfigError,
    DataError,
    MetricsError,
    NonFiniteStepsError,
    TokenizerError,
    TrainError,
    UnknownModelError,
    check_bool,
    check_choice,
    check_int,
    check_number,
)

CONFIG_ERROR = ConfigError


def test_every_error_has_the_package_root():
    assert issubclass(ConfigError, TrainError)
    assert issubclass(ConfigError, ValueError)
    for error in (DataError, MetricsError, TokenizerError, UnknownModelError):
        assert issubclass(error, ConfigError)
    assert issubclass(NonFiniteStepsError, TrainError)
    assert issubclass(NonFiniteStepsError, RuntimeError)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("titan_train.config", "ConfigError"),
        ("titan_train.config.loader", "ConfigError"),
        ("titan_train.data", "DataError"),
        ("titan_train.metrics", "MetricsError"),
        ("titan_train.trainer.nonfinite", "NonFiniteStepsError"),
        ("titan_train.config.registry", "UnknownModelError"),
        ("titan_train.tokenizer", "TokenizerError"),
    ],
)
def test_the_old_import_paths_still_work(module, name):
    import importlib

    import titan_train.errors

    assert getattr(importlib.import_module(module), name) is getattr(titan_train.errors, name)


def test_usage_errors_are_the_config_errors_of_the_five_packages():
    import titan_ckpt
    import titan_dims
    import titan_models
    import titan_optim

    usage = _usage_errors()
    config_errors = (
        ConfigError,
        titan_dims.ParallelDimsError,
        titan_models.ModelConfigError,
        titan_optim.OptimizerConfigError,
        titan_ckpt.CheckpointConfigError,
    )
    for error in (*config_errors, DataError, MetricsError, TokenizerError, UnknownModelError):
        assert issubclass(error, usage), error
    # Not settings, but the user's to fix before any work: the launcher's environment and a
    # checkpoint whose pickles ask for code.
    for error in (titan_dims.DistributedEnvError, titan_ckpt.UnsafeCheckpointError):
        assert issubclass(error, usage), error
    # A run that started well and stopped is status 1; a bug keeps its traceback.
    for error in (*_run_stops(), titan_optim.OptimizerInBackwardError, RuntimeError):
        assert not issubclass(error, usage), error
    assert set(_run_stops()) >= {NonFiniteStepsError, titan_ckpt.CheckpointWriteError}


def test_an_incomplete_launcher_environment_exits_2_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    assert main(["train", "--job.dump_folder", str(out), "--training.steps", "1"]) == 2
    assert (
        "titan-train: error: Found RANK, WORLD_SIZE but not LOCAL_RANK" in capsys.readouterr().err
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: check_int("a.n", 0, minimum=1),
            "a.n=0 is not allowed; it must be a whole number >= 1.",
        ),
        (
            lambda: check_int("a.n", 2.0, minimum=1),
            "a.n=2.0 is not allowed; it must be a whole number >= 1.",
        ),
        (
            lambda: check_int("a.n", True, minimum=0),
            "a.n=True is not allowed; it must be a whole number >= 0.",
        ),
        (
            lambda: check_int("a.n", -2, minimum=1, sentinel=(-1, "all of them")),
            "a.n=-2 is not allowed; it must be -1 (all of them) or a whole number >= 1.",
        ),
        (
            lambda: check_int("a.n", "3", minimum=0, hint="0 turns it off"),
            "a.n='3' is not allowed; it must be a whole number >= 0 (0 turns it off).",
        ),
        (
            lambda: check_number("a.x", -0.5, low=0),
            "a.x=-0.5 is not allowed; it must be a finite number >= 0.",
        ),
        (
            lambda: check_number("a.x", 0, low=0, low_open=True),
            "a.x=0 is not allowed; it must be a finite number > 0.",
        ),
        (
            lambda: check_number("a.x", 1.0, low=0, high=1, high_open=True),
            "a.x=1.0 is not allowed; it must be a finite number in [0, 1).",
        ),
        (
            lambda: check_number("a.x", float("nan")),
            "a.x=nan is not allowed; it must be a finite number.",
        ),
        (
            lambda: check_number("a.x", "1e-3", high=1),
            "a.x='1e-3' is not allowed; it must be a finite number <= 1.",
        ),
        (
            lambda: check_choice("a.c", "z", ("x", "y")),
            "a.c='z' is not allowed; choose one of 'x', 'y'.",
        ),
        (
            lambda: check_bool("a.b", "false"),
            "a.b='false' is not allowed; it must be true or false.",
        ),
    ],
)
def test_checks_raise_the_config_error_with_one_message_shape(call, message):
    with pytest.raises(CONFIG_ERROR) as error:
        call()
    assert str(error.value) == message


def test_checks_return_good_values():
    assert check_int("n", 3, minimum=1) == 3
    assert check_int("n", -1, minimum=1, sentinel=(-1, "rest")) == -1
    assert check_number("x", 1, low=0, high=1) == 1.0
    assert isinstance(check_number("x", 1, low=0), float)
    assert check_choice("c", "y", ["x", "y"]) == "y"
    assert check_bool("b", False) is False


def test_checks_raise_another_error_when_asked():
    with pytest.raises(KeyError):
        check_int("n", 0, minimum=1, error=KeyError)
    with pytest.raises(ValueError) as error:
        check_number("max_norm", -1.0, low=0, error=ValueError)
    assert type(error.value) is ValueError
