"""The errors titan-ckpt's readers raise for a checkpoint they cannot (or will not) read.

``CheckpointFormatError``: the path is not a checkpoint the reader understands (bad usage,
exit status 2 from the command). ``CheckpointReadError``: stored data that cannot be read back
(a damaged file, exit status 1). ``UnsafeCheckpointError``: a checkpoint whose pickled data
asks for a class or function outside the allowlist (see ``titan_ckpt.safe_pickle``); nothing
of it was run (exit status 1).
"""

from __future__ import annotations

__all__ = ["CheckpointFormatError", "CheckpointReadError", "UnsafeCheckpointError"]


class CheckpointFormatError(ValueError):
    """The path is not a checkpoint this tool reads (a usage error, exit status 2)."""


class CheckpointReadError(RuntimeError):
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
