"""Every error titan-ckpt raises on purpose, under one root: ``CheckpointError``.

- ``CheckpointConfigError`` (also a ``ValueError``): a setting or argument that cannot work,
  naming the option, the value and what is allowed; also a checkpoint that does not fit the
  model it is loaded into (the fix is the configuration: another path or another model).
- ``CheckpointFormatError`` (also a ``ValueError``): a path that is not a checkpoint a reader
  understands (bad usage: the command exits 2).
- ``CheckpointReadError`` (also a ``RuntimeError``): stored data that cannot be read back (a
  damaged file: exit 1); ``UnsafeCheckpointError``, a pickle asking for something outside the
  allowlist, is one (nothing of it was run).
- ``CheckpointIntegrityError`` (also a ``RuntimeError``): a committed step whose files differ
  from its manifest; ``problems`` lists each damaged file.
- ``CheckpointWriteError`` (also a ``RuntimeError``): a save failed, its partial step removed;
  ``DiskFullError`` when space ran out.
- ``CheckpointLockError`` (also a ``RuntimeError``): another writer holds the checkpoint
  folder (``titan_ckpt.lock``); refused before any work.

The second bases keep ``except ValueError`` / ``except RuntimeError`` callers working.

Every titan package's ``errors.py`` also holds ``check_int``, ``check_number``,
``check_choice`` and ``check_bool`` with the same signatures and messages (``"<name>=<value>
is not allowed; it must be ..."``); here they raise ``CheckpointConfigError``. The packages
share the shape, not the code, so each stays installable alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = [
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "CheckpointLockError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "ConvertError",
    "DiskFullError",
    "UnsafeCheckpointError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
]

T = TypeVar("T")


class CheckpointError(Exception):
    """The root of every error titan-ckpt raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Errors are broadcast between ranks: keep keyword attributes through pickling.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(cls: type, args: tuple, attrs: dict) -> BaseException:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(attrs)
    return error


class CheckpointConfigError(CheckpointError, ValueError):
    """A checkpoint setting that cannot work, naming the key, the value and what is allowed."""


ConvertError = CheckpointConfigError
"""The former name of a conversion asked for that cannot be done (a usage error)."""


class CheckpointFormatError(CheckpointError, ValueError):
    """The path is not a checkpoint this tool reads (a usage error, exit status 2)."""


class CheckpointReadError(CheckpointError, RuntimeError):
    """Stored data that cannot be read back (a damaged checkpoint, exit status 1)."""


class UnsafeCheckpointError(CheckpointReadError):
    """Pickled checkpoint data names a class or function that titan-ckpt does not unpickle.

    Raised before that object is looked up, so nothing the pickle asks for has run. The
    message names the file and the global (``module.qualname``); ``found`` and ``file`` hold
    them. A checkpoint made by oneself with custom objects loads with ``trust_pickles``.
    """

    found: str = ""
    file: str = ""

    @classmethod
    def refused(cls, file: str, found: str) -> UnsafeCheckpointError:
        """The one message for a refused global ``found`` in ``file``."""
        error = cls(
            f"{file} asks to unpickle {found}, which a checkpoint does not need (only DCP's "
            "metadata types, torch sizes, dtypes and tensors, and plain containers are "
            "unpickled): a checkpoint from an unknown source could run code this way, so "
            "nothing of it was run. If you made this checkpoint yourself with custom objects, "
            "pass --trust-pickles to titan-ckpt, or set checkpoint.trust_pickles = true."
        )
        error.found, error.file = found, file
        return error


class CheckpointIntegrityError(CheckpointError, RuntimeError):
    """A committed step whose files do not match its manifest (missing, resized, altered).

    ``problems`` names each damaged file (``"<file>: missing"``, ...); the message joins them.
    """

    def __init__(self, message: str, *, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems or [])
        """One line per damaged file."""


class CheckpointWriteError(CheckpointError, RuntimeError):
    """A checkpoint save failed; its partial step was removed and committed steps are intact."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        """The step directory whose write failed."""


class DiskFullError(CheckpointWriteError):
    """A checkpoint save failed because its filesystem ran out of space."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        needed: int | None = None,
        free: int | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.needed = needed
        """Bytes the step needs (estimated from the state saved), if known."""
        self.free = free
        """Bytes that were free for it (free now plus its removed partial files), if known."""


class CheckpointLockError(CheckpointError, RuntimeError):
    """Another process holds the checkpoint folder for writing (``titan_ckpt.lock``).

    Raised when a saving manager is built, before any work; ``holder`` describes the
    process that holds the folder (host, pid, since when), as the message names it.
    """

    def __init__(self, message: str, *, holder: str = "") -> None:
        super().__init__(message)
        self.holder = holder
        """The holding process, in words ("" when its lock file could not be read)."""


def check_int(
    name: str,
    value: object,
    *,
    minimum: int,
    sentinel: tuple[int, str] | None = None,
    hint: str = "",
    error: type[Exception] = CheckpointConfigError,
) -> int:
    """Return ``value`` if it is a whole number >= ``minimum`` (a ``bool`` is not), or the
    ``sentinel`` value (``(-1, "the newest committed step")``: a special value and its
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
    error: type[Exception] = CheckpointConfigError,
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
    error: type[Exception] = CheckpointConfigError,
) -> T:
    """Return ``value`` if it is one of ``choices``; else raise ``error`` listing them."""
    choices = tuple(choices)
    if value in choices:
        return value  # type: ignore[return-value]
    listed = ", ".join(repr(c) for c in choices)
    raise error(_message(name, value, f"choose one of {listed}", hint))


def check_bool(
    name: str, value: object, *, hint: str = "", error: type[Exception] = CheckpointConfigError
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
