"""titan-optim's errors: the root of them all, the one configuration error, and the checks
that raise it.

Every titan package has an ``errors.py`` of this shape: a root error, one configuration
error that is also a ``ValueError``, and the checks ``check_int``, ``check_number``,
``check_choice`` and ``check_bool``, which raise that error. The checks have one source,
``titan_dims.checks``, bound here to this package's error; ``_checks.py`` is a byte-identical
copy of it, as titan-optim depends on torch alone.
"""

from __future__ import annotations

from functools import partial

from titan_optim import _checks as checks

__all__ = [
    "NonFiniteGradError",
    "OptimError",
    "OptimizerConfigError",
    "OptimizerInBackwardError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
]


class OptimError(Exception):
    """The root of titan-optim's errors: ``except OptimError`` catches each of them."""


class OptimizerConfigError(OptimError, ValueError):
    """An optimizer or LR-schedule setting that cannot be used, naming the field and the fix:
    titan-optim's configuration error."""


class NonFiniteGradError(OptimError, RuntimeError):
    """The global gradient norm is inf or nan and the policy is ``raise``."""


class OptimizerInBackwardError(OptimError, RuntimeError):
    """A feature that cannot work when parameters step during backward."""


# The shared checks (one source: titan_dims.checks), raising this package's error.
check_int = partial(checks.check_int, error=OptimizerConfigError)
check_number = partial(checks.check_number, error=OptimizerConfigError)
check_choice = partial(checks.check_choice, error=OptimizerConfigError)
check_bool = partial(checks.check_bool, error=OptimizerConfigError)
