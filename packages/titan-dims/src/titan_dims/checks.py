"""The config checks of every titan package: ``check_int``, ``check_number``,
``check_choice`` and ``check_bool`` return a valid value or raise the caller's ``error``
with one message of one shape (``"<name>=<value> is not allowed; it must be ..."``).

One source: this file. titan-models and titan-train import it from titan-dims (their
dependency); titan-ckpt and titan-optim depend on torch alone, so each holds a byte-identical
copy as ``_checks.py``, which a repository test keeps identical to this one. Each package's
``errors.py`` binds its own configuration error as the default ``error``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TypeVar

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "message"]

T = TypeVar("T")


def check_int(
    name: str,
    value: object,
    *,
    minimum: int,
    sentinel: tuple[int, str] | None = None,
    hint: str = "",
    error: type[Exception] = ValueError,
) -> int:
    """Return ``value`` if it is a whole number >= ``minimum`` (a ``bool`` is not), or the
    ``sentinel`` value (``(-1, "the whole dataset")``: a special value and its meaning);
    else raise ``error`` naming ``name``, the value and what is allowed."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if whole and (value >= minimum or (sentinel is not None and value == sentinel[0])):
        return value
    allowed = f"a whole number >= {minimum}"
    if sentinel is not None:
        allowed = f"{sentinel[0]} ({sentinel[1]}) or {allowed}"
    raise error(message(name, value, f"it must be {allowed}", hint))


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    hint: str = "",
    error: type[Exception] = ValueError,
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
    raise error(message(name, value, f"it must be a finite number{bounds}", hint))


def check_choice(
    name: str,
    value: object,
    choices: Iterable[T],
    *,
    hint: str = "",
    error: type[Exception] = ValueError,
) -> T:
    """Return ``value`` if it is one of ``choices``; else raise ``error`` listing them."""
    choices = tuple(choices)
    if value in choices:
        return value  # type: ignore[return-value]
    listed = ", ".join(repr(c) for c in choices)
    raise error(message(name, value, f"choose one of {listed}", hint))


def check_bool(
    name: str, value: object, *, hint: str = "", error: type[Exception] = ValueError
) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not a truthy string or number)."""
    if isinstance(value, bool):
        return value
    raise error(message(name, value, "it must be true or false", hint))


def message(name: str, value: object, rule: str, hint: str = "") -> str:
    """The one shape of a refused setting: ``"<name>=<value> is not allowed; <rule> (<hint>)."``"""
    return f"{name}={value!r} is not allowed; {rule}{f' ({hint})' if hint else ''}."


def _range_text(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""
