"""titan-models' errors: the root of them all, the one configuration error (also a
``ValueError``), and the shared checks (one source, ``titan_dims.checks``) bound to it."""

from __future__ import annotations

import warnings
from functools import partial

from titan_dims import checks

__all__ = [
    "ModelConfigError",
    "ModelError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
]


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


# The shared checks (one source: titan_dims.checks), raising this package's error.
check_int = partial(checks.check_int, error=ModelConfigError)
check_number = partial(checks.check_number, error=ModelConfigError)
check_choice = partial(checks.check_choice, error=ModelConfigError)
check_bool = partial(checks.check_bool, error=ModelConfigError)
