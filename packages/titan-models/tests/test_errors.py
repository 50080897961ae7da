"""titan_models.errors: the root error, the one configuration error and the shared checks.

Every titan package's ``errors.py`` has the same checks with the same messages; the cases
below are the same in each package's ``test_errors.py``, so the shape cannot drift.
"""

import warnings

import pytest

import titan_models
from titan_models import ModelConfigError, ModelError
from titan_models.errors import check_bool, check_choice, check_int, check_number

CONFIG_ERROR = ModelConfigError


def test_every_error_has_the_package_root():
    assert issubclass(ModelConfigError, ModelError)
    assert issubclass(ModelConfigError, ValueError)


@pytest.mark.parametrize("module", ["titan_models", "titan_models.errors"])
def test_the_old_name_still_imports_for_one_release_and_warns(module):
    with pytest.warns(DeprecationWarning, match="now titan_models.ModelConfigError"):
        old = __import__(module, fromlist=["ConfigError"]).ConfigError
    assert old is ModelConfigError
    with pytest.warns(DeprecationWarning, match="now titan_models.ModelConfigError"):
        exec(f"from {module} import ConfigError", {})
    caught = None
    try:
        titan_models.llama3.Llama3Args(n_layers=0)
    except old as error:  # what a 0.1.0 caller wrote still catches it
        caught = error
    assert isinstance(caught, ModelConfigError)


def test_the_new_names_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from titan_models import ModelConfigError as New  # noqa: F401
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        titan_models.Nope  # noqa: B018


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
