"""titan-models' errors: the root of them all, the one configuration error, and the checks
that raise it.

Every titan package has an ``errors.py`` of this shape: a root error, one configuration
error that is also a ``ValueError``, and ``check_int``, ``check_number``, ``check_choice``
and ``check_bool`` with the same signatures and messages (``"<name>=<value> is not allowed;
it must be ..."``). The packages share the shape, not the code, so each stays installable
alone. A module of its own, imported by every other module here and importing none of them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import TypeVar

__all__ = [
    "ModelConfigError",
    "ModelError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
]

T = TypeVar("T")


class ModelError(Exception):
    """The root of titan-models' errors: ``except ModelError`` catches each of them."""


class ModelConfigError(ModelError, ValueError):
    """A model or parallelize setting that cannot work, naming the field, its value and what
    is allowed instead: titan-models' configuration error."""


def __getattr__(name: str) -> type[ModelConfigError]:
    # ``ConfigError``, this class's name in 0.1.0, stays importable for one release.
    if name == "ConfigError":
        warnings.warn(DEPRECATED_CONFIG_ERROR, DeprecationWarning, stacklevel=2)
        return ModelConfigError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DEPRECATED_CONFIG_ERROR = (
    "titan_models.ConfigError is now titan_models.ModelConfigError (the same class); the old "
    "name goes away in the next release."
)


def check_int(
    name: str,
    value: object,
    *,
    minimum: int,
    sentinel: tuple[int, str] | None = None,
    hint: str = "",
    error: type[Exception] = ModelConfigError,
) -> int:
    """Return ``value`` if it is a whole number >= ``minimum`` (a ``bool`` is not), or the
    ``sentinel`` value (``(-1, "the whole dataset")``: a special value and its
    meaning); else raise ``error`` naming ``name``, the value and what is allowed."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if whole and (value >= minimum or (sentinel is not None and value == sentinel[0])):
        return value
    allowed = f"a whole number >= {minimum}"
    if sentinel is not None:
        allowed = f"{sentinel[0]} ({sentinel[1]}) or {allowed}"
    raise error(_message(name, value, f"it must be {allowed}", hint))


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
    error: type[Exception] = ModelConfigError,
) -> float:
    """Return ``value`` as a float if it is a finite number (int or float, not ``bool``)
    within ``low``..``high`` (inclusive unless ``low_open`` / ``high_open``); else raise
    ``error`` naming ``name``, the value and the range."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        above = low is None or (value > low if low_open else value >= low)
        below = high is None or (value < high if high_open else value <= high)
        if above and below:
            return float(value)
    bounds = _range_text(low, high, low_open, high_open)
    raise error(_message(name, value, f"it must be a finite number{bounds}", hint))


def check_choice(
    name: str,
    value: object,
    choices: Iterable[T],
    *,
    hint: str = "",
    error: type[Exception] = ModelConfigError,
) -> T:
    """Return ``value`` if it is one of ``choices``; else raise ``error`` listing them."""
    choices = tuple(choices)
    if value in choices:
        return value  # type: ignore[return-value]
    listed = ", ".join(repr(c) for c in choices)
    raise error(_message(name, value, f"choose one of {listed}", hint))


def check_bool(
    name: str, value: object, *, hint: str = "", error: type[Exception] = ModelConfigError
) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not a truthy string or number)."""
    if isinstance(value, bool):
        return value
    raise error(_message(name, value, "it must be true or false", hint))


def _message(name: str, value: object, rule: str, hint: str) -> str:
    return f"{name}={value!r} is not allowed; {rule}{f' ({hint})' if hint else ''}."


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""
