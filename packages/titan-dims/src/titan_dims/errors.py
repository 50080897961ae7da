"""titan-dims' errors: the root of them all, the one configuration error, and the checks
that raise it.

Every titan package has an ``errors.py`` of this shape: a root error, one configuration
error that is also a ``ValueError``, and the checks ``check_int``, ``check_number``,
``check_choice`` and ``check_bool``, which raise that error. The checks have one
source, bound here to this package's error: ``titan_dims.checks``.
"""

from __future__ import annotations

from functools import partial

from titan_dims import checks

__all__ = [
    "DistributedEnvError",
    "ParallelDimsError",
    "TitanDimsError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
]


class TitanDimsError(Exception):
    """The root of titan-dims' errors: ``except TitanDimsError`` catches each of them."""


class ParallelDimsError(TitanDimsError, ValueError):
    """A parallel layout that cannot be built, with what is wrong and a valid alternative:
    titan-dims' configuration error."""


class DistributedEnvError(TitanDimsError, RuntimeError):
    """The launcher's environment is incomplete or inconsistent."""


# The shared checks (one source: titan_dims.checks), raising this package's error.
check_int = partial(checks.check_int, error=ParallelDimsError)
check_number = partial(checks.check_number, error=ParallelDimsError)
check_choice = partial(checks.check_choice, error=ParallelDimsError)
check_bool = partial(checks.check_bool, error=ParallelDimsError)
