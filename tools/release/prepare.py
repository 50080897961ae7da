"""Prepare one package's release: set its version and date its changelog's notes.

``## [Unreleased]``'s notes move under ``## [VERSION] - DATE``, a fresh empty
``## [Unreleased]`` stays on top, and ``__about__.py`` gets VERSION. Nothing is committed.
"""

from __future__ import annotations

import datetime
import re

from common import Package
from packaging.version import Version

PLACEHOLDER = "Nothing has been published yet"


def prepare(pkg: Package, version: Version, date: datetime.date | None = None) -> None:
    """Rewrite ``pkg``'s changelog and version file for the release of ``version``."""
    if version < pkg.version:
        raise SystemExit(f"error: {pkg.name}: {version} is older than its version {pkg.version}")
    text = pkg.changelog.read_text()
    head, sep, rest = text.partition("## [Unreleased]\n")
    if not sep:
        raise SystemExit(f"error: {pkg.changelog} has no `## [Unreleased]` heading")
    if re.search(rf"^## \[{re.escape(str(version))}\]", text, re.MULTILINE):
        raise SystemExit(f"error: {pkg.changelog} already has a {version} section")
    body, nxt, older = rest.partition("\n## [")
    # The placeholder paragraph of a never-released package is not a release note.
    paragraphs = body.strip().split("\n\n")
    notes = "\n\n".join(p for p in paragraphs if not p.startswith(PLACEHOLDER)).strip()
    if not notes:
        raise SystemExit(f"error: {pkg.changelog}: nothing under Unreleased to release")
    day = (date or datetime.datetime.now(datetime.UTC).date()).isoformat()
    new = f"{head}## [Unreleased]\n\n## [{version}] - {day}\n\n{notes}\n"
    if nxt:
        new += f"\n## [{older}"
    pkg.changelog.write_text(new)
    about = pkg.about_file.read_text()
    pkg.about_file.write_text(
        re.sub(r'__version__ = "[^"]+"', f'__version__ = "{version}"', about, count=1)
    )
    print(f"{pkg.name}: version {version}, changelog dated {day}; review, then commit")
