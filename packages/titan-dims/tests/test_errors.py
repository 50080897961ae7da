"""titan_dims.errors: the root error, the one configuration error and the shared checks.

Every titan package's ``errors.py`` has the same checks with the same messages; the cases
below are the same in each package's ``test_errors.py``, so the shape cannot drift.
"""

import ast
from pathlib import Path

import pytest

import titan_dims
from titan_dims import DistributedEnvError, ParallelDimsError, TitanDimsError
from titan_dims.errors import check_bool, check_choice, check_int, check_number

CONFIG_ERROR = ParallelDimsError


def test_every_error_has_the_package_root():
    assert issubclass(ParallelDimsError, TitanDimsError)
    assert issubclass(ParallelDimsError, ValueError)
    assert issubclass(DistributedEnvError, TitanDimsError)
    assert issubclass(DistributedEnvError, RuntimeError)


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


def test_config_no_longer_imports_the_object_it_configures():
    # The old circle: config.py imported parallel_dims.py (for its degree check), which
    # names ParallelismConfig back. Now both import errors.py, which imports only checks.py.
    def titan_imports(module: str) -> set[str]:
        tree = ast.parse(Path(titan_dims.__file__).with_name(f"{module}.py").read_text())
        return {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("titan_dims")
        }

    assert titan_imports("config") == {"titan_dims.errors"}
    # errors.py takes its checks from checks.py, a leaf that imports nothing here.
    assert titan_imports("errors") == {"titan_dims"}
    assert titan_imports("checks") == set()
