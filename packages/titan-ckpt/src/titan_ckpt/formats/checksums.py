"""The file checksums of a commit manifest: ``xxh3_128`` (``xxhash``, ~9x sha256's speed, made
to catch damage) or ``sha256`` (stdlib; a cryptographic record). ``checkpoint.checksum="auto"``
takes xxh3_128 where ``xxhash`` imports. Verification uses whatever each entry names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from titan_ckpt.errors import CheckpointConfigError

__all__ = [
    "ALGORITHMS",
    "CHECKSUMS",
    "Hasher",
    "entry_algorithm",
    "new_hasher",
    "require_algorithms",
    "resolve_checksum",
]

ALGORITHMS = ("xxh3_128", "sha256")
"""The algorithms a manifest entry may name, in the order verification prefers them."""
CHECKSUMS = ("auto", *ALGORITHMS)
"""The values of ``checkpoint.checksum``."""

_INSTALL_XXHASH = "pip install 'titan-ckpt[xxhash]' (or pip install xxhash)"


class Hasher(Protocol):
    """What a checksum object offers (``hashlib``'s and ``xxhash``'s both do)."""

    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def _xxhash() -> Any | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash


def resolve_checksum(name: str) -> str:
    """The algorithm that ``checkpoint.checksum = name`` selects here: ``auto`` is
    ``xxh3_128`` when ``xxhash`` imports, else ``sha256``. ``CheckpointConfigError`` for a
    name not in ``CHECKSUMS``, or ``xxh3_128`` without ``xxhash``."""
    if name not in CHECKSUMS:
        raise CheckpointConfigError(
            f"checkpoint.checksum={name!r} is not one of {', '.join(CHECKSUMS)}. Use auto "
            "(the fastest one installed), xxh3_128 (fast, catches damage) or sha256 (a "
            "cryptographic digest)."
        )
    if name == "auto":
        return "xxh3_128" if _xxhash() is not None else "sha256"
    if name == "xxh3_128" and _xxhash() is None:
        raise CheckpointConfigError(
            f"checkpoint.checksum=xxh3_128 needs the xxhash package: {_INSTALL_XXHASH}; or "
            "choose checkpoint.checksum=sha256."
        )
    return name


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hash object of ``algorithm`` (one of ``ALGORITHMS``, available here)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        xxhash = _xxhash()
        if xxhash is None:
            raise CheckpointConfigError(
                f"xxh3_128 checksums need the xxhash package: {_INSTALL_XXHASH}."
            )
        return xxhash.xxh3_128()
    raise CheckpointConfigError(f"unknown checksum algorithm {algorithm!r} (known: {ALGORITHMS})")


def entry_algorithm(entry: Mapping[str, Any]) -> str | None:
    """The algorithm whose digest the manifest ``entry`` holds (the preferred one when it
    holds several); None when it holds none this version knows."""
    for algorithm in ALGORITHMS:
        if isinstance(entry.get(algorithm), str):
            return algorithm
    return None


def require_algorithms(entries: Iterable[Mapping[str, Any]], where: str) -> None:
    """Raise ``CheckpointConfigError`` before any file is read when an entry of ``entries``
    (the manifest of ``where``) has no digest this process can compute: a newer titan-ckpt's
    algorithm, or ``xxh3_128`` without ``xxhash``."""
    needed = set()
    for entry in entries:
        algorithm = entry_algorithm(entry)
        if algorithm is None:
            others = sorted(k for k in entry if k != "size")
            raise CheckpointConfigError(
                f"{where} was written with checksums this titan-ckpt does not know "
                f"({', '.join(others) or 'none'}; known: {', '.join(ALGORITHMS)}). Upgrade "
                "titan-ckpt, or load without checksum verification (sizes are still checked)."
            )
        needed.add(algorithm)
    if "xxh3_128" in needed and _xxhash() is None:
        raise CheckpointConfigError(
            f"{where} was written with xxh3_128 checksums; verifying them needs the xxhash "
            f"package: {_INSTALL_XXHASH}. Or load without checksum verification (sizes are "
            "still checked)."
        )
