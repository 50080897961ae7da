"""titan-dims' errors: the root of them all, the one configuration error (also a
``ValueError``), and the shared checks (one source, ``titan_dims.checks``) bound to it."""

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
