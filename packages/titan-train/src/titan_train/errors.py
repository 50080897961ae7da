"""titan-train's errors: the root of them all, the one configuration error (and the kinds
of it the trainer's parts raise), and the checks that raise it.

Every titan package has an ``errors.py`` of this shape: a root error, one configuration
error that is also a ``ValueError``, and ``check_int``, ``check_number``, ``check_choice``
and ``check_bool`` with the same signatures and messages (``"<name>=<value> is not allowed;
it must be ..."``). The packages share the shape, not the code, so each stays installable
alone (titan-train adds ``check_duration`` for its timeouts). A module of its own, imported
by every other module here and importing none of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta
from typing import TypeVar

__all__ = [
    "ConfigError",
    "DataError",
    "MetricsError",
    "NonFiniteStepsError",
    "TokenizerError",
    "TrainError",
    "UnknownModelError",
    "check_bool",
    "check_choice",
    "check_duration",
    "check_int",
    "check_number",
]

T = TypeVar("T")


class TrainError(Exception):
    """The root of titan-train's errors: ``except TrainError`` catches each of them."""


class ConfigError(TrainError, ValueError):
    """A configuration that cannot be used, with where it came from and how to fix it:
    titan-train's configuration error. ``titan-train`` prints it and exits with status 2
    before any work, as it does for the other packages' configuration errors."""


class DataError(ConfigError):
    """A dataset cannot be found or read, or a data setting is impossible."""


class MetricsError(ConfigError):
    """A metrics setting is impossible, or an optional backend it asks for is missing."""


class TokenizerError(ConfigError):
    """A tokenizer file is missing, malformed or lacks a token the trainer needs."""


class UnknownModelError(ConfigError):
    """No installed distribution registers a model by that name."""


class NonFiniteStepsError(TrainError, RuntimeError):
    """More consecutive steps had an inf/nan gradient norm than the run allows: a run that
    started well stops (``titan-train`` exits with status 1)."""


def check_int(
    name: str,
    value: object,
    *,
    minimum: int,
    sentinel: tuple[int, str] | None = None,
    hint: str = "",
    error: type[Exception] = ConfigError,
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


def check_duration(
    name: str, value: object, *, unit_s: float, hint: str = "", error: type[Exception] = ConfigError
) -> int:
    """``check_int(minimum=1)``, and at most the longest ``datetime.timedelta`` in units of
    ``unit_s`` seconds: torch takes its timeouts as one, and a longer one overflows there.
    titan-train's own check (a timeout is a setting of the run, not of the other packages)."""
    check_int(name, value, minimum=1, hint=hint, error=error)
    longest = int(timedelta.max.days * 86400 / unit_s)
    if value > longest:  # type: ignore[operator]
        raise error(_message(name, value, f"it must be a whole number in [1, {longest}]", hint))
    return value  # type: ignore[return-value]


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
    error: type[Exception] = ConfigError,
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
    error: type[Exception] = ConfigError,
) -> T:
    """Return ``value`` if it is one of ``choices``; else raise ``error`` listing them."""
    choices = tuple(choices)
    if value in choices:
        return value  # type: ignore[return-value]
    listed = ", ".join(repr(c) for c in choices)
    raise error(_message(name, value, f"choose one of {listed}", hint))


def check_bool(
    name: str, value: object, *, hint: str = "", error: type[Exception] = ConfigError
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
