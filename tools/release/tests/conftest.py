"""Fixtures for the release tools' tests: a scratch copy of the monorepo's packages to break."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

RELEASE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(RELEASE))

from common import ROOT  # noqa: E402


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of packages/ (sources, pyproject, changelogs; no tests) at ``tmp_path``."""
    for pkg in (ROOT / "packages").iterdir():
        if pkg.is_dir():
            shutil.copytree(
                pkg,
                tmp_path / "packages" / pkg.name,
                ignore=shutil.ignore_patterns("tests", "__pycache__", "*.egg-info"),
            )
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {path}"
    path.write_text(text.replace(old, new))


@pytest.fixture
def edit():
    """``edit(path, old, new)``: replace ``old`` (found exactly once) by ``new`` in ``path``."""
    return _edit
