"""What the release tools know about the five packages: names, folders, versions, ranges.

Each package lives in ``packages/<dist>/`` with its version in ``src/<module>/__about__.py``
(read by hatchling), its sibling requirements in ``[project] dependencies`` and its notes in
``CHANGELOG.md``. The tools read those files as text; they never import the packages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]

# Lowest layer first: the order to build, publish and install in.
PACKAGES = ("titan-dims", "titan-ckpt", "titan-optim", "titan-models", "titan-train")

_VERSION_LINE = re.compile(r'^__version__\s*=\s*"([^"]+)"\s*$', re.MULTILINE)


@dataclass(frozen=True)
class Package:
    """One distribution of the monorepo, as its files describe it."""

    name: str  # the distribution name, e.g. "titan-ckpt"
    folder: Path

    @property
    def module(self) -> str:
        """The import name: ``titan-ckpt`` imports as ``titan_ckpt``."""
        return self.name.replace("-", "_")

    @property
    def about_file(self) -> Path:
        return self.folder / "src" / self.module / "__about__.py"

    @property
    def changelog(self) -> Path:
        return self.folder / "CHANGELOG.md"

    @property
    def version(self) -> Version:
        """The version in ``__about__.py`` (the one hatchling builds)."""
        text = self.about_file.read_text()
        match = _VERSION_LINE.search(text)
        if match is None:
            raise ValueError(f'{self.about_file}: no line `__version__ = "X.Y.Z"`')
        return Version(match.group(1))

    @property
    def pyproject(self) -> dict:
        return tomllib.loads((self.folder / "pyproject.toml").read_text())

    def requirements(self) -> list[Requirement]:
        """``[project] dependencies`` parsed (extras not included)."""
        return [Requirement(line) for line in self.pyproject["project"].get("dependencies", [])]

    def sibling_requirements(self) -> list[Requirement]:
        """The requirements on other titan packages."""
        return [req for req in self.requirements() if req.name in PACKAGES]

    @property
    def tag(self) -> str:
        """The git tag of this version's release: ``titan-ckpt-v0.1.0``."""
        return f"{self.name}-v{self.version}"


def packages(root: Path = ROOT) -> list[Package]:
    """The five packages of the tree at ``root``, lowest layer first."""
    return [Package(name, root / "packages" / name) for name in PACKAGES]


def breaking_bump(old: Version, new: Version) -> bool:
    """Whether ``new`` may break ``old``'s users under SemVer with the 0.x rule.

    From 1.0 a major bump may break; in 0.x a minor bump may (0.1 -> 0.2), a patch never.
    """
    if old.major >= 1:
        return new.major > old.major
    return (new.major, new.minor) > (old.major, old.minor)


def compatible_range(version: Version) -> str:
    """The range our policy writes for a sibling at ``version``: the releases that keep its API.

    ``0.1.3`` -> ``>=0.1,<0.2``; ``1.4.0`` -> ``>=1.4,<2``.
    """
    if version.major >= 1:
        return f">={version.major}.{version.minor},<{version.major + 1}"
    return f">={version.major}.{version.minor},<{version.major}.{version.minor + 1}"
