"""titan-train's errors: the root of them all, the one configuration error (and the kinds
of it the trainer's parts raise), and the checks that raise it.

Every titan package has an ``errors.py`` of this shape: a root error, one configuration
error that is also a ``ValueError``, and the checks ``check_int``, ``check_number``,
``check_choice`` and ``check_bool`` (and ``check_duration`` for its timeouts), which raise
that error. The checks have one source, ``titan_dims.checks``, bound here to this
package's error.
"""

from __future__ import annotations

from datetime import timedelta
from functools import partial

from titan_dims import checks

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


class TrainError(Exception):
    """The root of titan-train's errors: ``except TrainError`` catches each of them."""


class ConfigError(TrainError, ValueError):
    """titan-train's configuration error, saying where the value came from and the fix;
    ``titan-train`` prints it and exits 2 before any work."""


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


# The shared checks (one source: titan_dims.checks), raising this package's error.
check_int = partial(checks.check_int, error=ConfigError)
check_number = partial(checks.check_number, error=ConfigError)
check_choice = partial(checks.check_choice, error=ConfigError)
check_bool = partial(checks.check_bool, error=ConfigError)


def check_duration(
    name: str, value: object, *, unit_s: float, hint: str = "", error: type[Exception] = ConfigError
) -> int:
    """``check_int(minimum=1)`` and at most the longest ``datetime.timedelta`` in ``unit_s``
    seconds: torch takes timeouts as one, and a longer one overflows there."""
    check_int(name, value, minimum=1, hint=hint, error=error)
    longest = int(timedelta.max.days * 86400 / unit_s)
    if value > longest:  # type: ignore[operator]
        raise error(
            checks.message(name, value, f"it must be a whole number in [1, {longest}]", hint)
        )
    return value  # type: ignore[return-value]
