"""Every error titan-ckpt raises on purpose, under one root: ``CheckpointError``.

The second bases (``ValueError`` for usage, ``RuntimeError`` for data and writes) keep
``except ValueError`` / ``except RuntimeError`` callers working. ``check_int``,
``check_number``, ``check_choice`` and ``check_bool`` are every titan package's config checks
(one source, ``titan_dims.checks``; ``_checks.py`` is its byte-identical copy, as titan-ckpt
depends on torch alone), raising ``CheckpointConfigError`` here.
"""

from __future__ import annotations

from functools import partial

from titan_ckpt import _checks as checks

__all__ = [
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "CheckpointLockError",
    "CheckpointReadError",
    "CheckpointWriteError",
    "DiskFullError",
    "UnsafeCheckpointError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
]


class CheckpointError(Exception):
    """The root of every error titan-ckpt raises on purpose.

    Errors are broadcast between ranks by pickle; ``Exception``'s own pickling keeps the
    keyword attributes (``path``, ``problems``, ...), as every ``__init__`` here takes the
    message alone positionally."""


class CheckpointConfigError(CheckpointError, ValueError):
    """A checkpoint setting that cannot work, naming the key, the value and what is allowed."""


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


# The shared checks (one source: titan_dims.checks), raising this package's error.
check_int = partial(checks.check_int, error=CheckpointConfigError)
check_number = partial(checks.check_number, error=CheckpointConfigError)
check_choice = partial(checks.check_choice, error=CheckpointConfigError)
check_bool = partial(checks.check_bool, error=CheckpointConfigError)
