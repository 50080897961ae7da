"""The one error type of this package's configs, and the checks that raise it."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ConfigError", "check_choice", "check_positive_int"]


class ConfigError(ValueError):
    """A model or parallelize setting that cannot work, naming the field, its value and what
    is allowed instead."""


def check_positive_int(name: str, value: object) -> None:
    """Raise unless ``value`` is a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} is not allowed; it must be a whole number >= 1.")


def check_choice(name: str, value: object, allowed: Iterable[str]) -> None:
    """Raise unless ``value`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(
            f"{name}={value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}."
        )
