"""Check that versions, changelogs and the ranges between the titan packages agree.

    python tools/release/check_versions.py [--root DIR]

Fails (exit 1), naming the file and the fix, when:
- a package's ``__about__.py`` version is not a PEP 440 version;
- a requirement on a sibling package has no range, lets in a release that may break it
  (in 0.x the next minor, from 1.0 the next major), or does not admit the sibling's version
  in this tree (then the monorepo's own packages could not be installed together);
- a ``CHANGELOG.md`` is missing, has no ``## [Unreleased]`` section on top, lists its
  releases out of order or with a malformed heading, or names a release newer than the
  package's version.
The policy is in RELEASING.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Package, compatible_range, packages

_HEADING = re.compile(r"^## (.*)$", re.MULTILINE)
_RELEASE = re.compile(r"^\[(?P<version>[^\]]+)\] - (?P<date>\d{4}-\d{2}-\d{2})$")


def next_breaking(version: Version) -> Version:
    """The first release that may break users of ``version`` (0.x: next minor)."""
    if version.major >= 1:
        return Version(f"{version.major + 1}.0.0")
    return Version(f"0.{version.minor + 1}.0")


def check_ranges(pkgs: list[Package]) -> list[str]:
    """Problems with the sibling requirements of each package."""
    versions = {pkg.name: pkg.version for pkg in pkgs}
    problems = []
    for pkg in pkgs:
        for req in pkg.sibling_requirements():
            where = f"{pkg.folder.name}/pyproject.toml: requirement {str(req)!r}"
            sibling = versions[req.name]
            want = f"{req.name}{compatible_range(sibling)}"
            if not req.specifier:
                problems.append(f"{where} has no version range; write {want!r}")
                continue
            if not req.specifier.contains(sibling, prereleases=True):
                problems.append(
                    f"{where} does not admit {req.name} {sibling}, the version in this tree; "
                    f"write {want!r} (and check {pkg.name} works with it)"
                )
            breaking = next_breaking(sibling)
            if req.specifier.contains(breaking, prereleases=True):
                problems.append(
                    f"{where} admits {req.name} {breaking}, which may break it "
                    f"(0.x: a minor bump may break); bound it, e.g. {want!r}"
                )
    return problems


def check_changelog(pkg: Package) -> list[str]:
    """Problems with one package's CHANGELOG.md against its version."""
    path = pkg.changelog
    if not path.is_file():
        return [f"{path}: missing; every package keeps a changelog (see RELEASING.md)"]
    headings = _HEADING.findall(path.read_text())
    if not headings or headings[0].strip() != "[Unreleased]":
        return [f"{path}: the first `## ` heading must be `## [Unreleased]`"]
    problems = []
    released: list[Version] = []
    for heading in headings[1:]:
        match = _RELEASE.match(heading.strip())
        try:
            version = Version(match.group("version")) if match else None
        except InvalidVersion:
            version = None
        if version is None:
            problems.append(
                f"{path}: heading `## {heading}` is not `## [X.Y.Z] - YYYY-MM-DD` "
                "(use ### for sections inside a release)"
            )
            continue
        if released and version >= released[-1]:
            problems.append(f"{path}: release {version} is listed below {released[-1]}")
        released.append(version)
    if released and max(released) > pkg.version:
        problems.append(
            f"{path}: lists release {max(released)}, newer than the package's version "
            f"{pkg.version} in {pkg.about_file.relative_to(pkg.folder)}; bump the version"
        )
    return problems


def check(root: Path) -> list[str]:
    """Every problem in the tree at ``root`` (empty when all agree)."""
    problems = []
    pkgs = []
    for pkg in packages(root):
        try:
            pkg.version  # noqa: B018 - parses the file
        except (OSError, ValueError, InvalidVersion) as exc:
            problems.append(f"{pkg.about_file}: {exc}")
            continue
        pkgs.append(pkg)
    problems += check_ranges(pkgs)
    for pkg in pkgs:
        problems += check_changelog(pkg)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="monorepo root (default: this one)")
    args = parser.parse_args(argv)
    problems = check(args.root)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s); the policy is in RELEASING.md", file=sys.stderr)
        return 1
    for pkg in packages(args.root):
        deps = ", ".join(str(r) for r in pkg.sibling_requirements()) or "no sibling"
        print(f"ok: {pkg.name} {pkg.version} ({deps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
