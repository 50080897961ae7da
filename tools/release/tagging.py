"""Git tags for releases: ``titan-<name>-v<version>``, one per package and version."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from common import Package


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def blockers(pkg: Package, root: Path) -> list[str]:
    """Why ``pkg``'s version cannot be tagged now (empty when it can)."""
    found = []
    dated = re.search(
        rf"^## \[{re.escape(str(pkg.version))}\] - \d{{4}}-\d{{2}}-\d{{2}}$",
        pkg.changelog.read_text() if pkg.changelog.is_file() else "",
        re.MULTILINE,
    )
    if not dated:
        found.append(
            f"{pkg.changelog.name} has no `## [{pkg.version}] - YYYY-MM-DD` heading: move the "
            "Unreleased notes under it (RELEASING.md, step 2)"
        )
    if _git(root, "status", "--porcelain", "--", str(pkg.folder)).stdout.strip():
        found.append(f"uncommitted changes under {pkg.folder.relative_to(root)}")
    return found


def tag(pkgs: list[Package], root: Path, *, dry_run: bool) -> int:
    """Tag HEAD for each package; an existing tag must already point at HEAD."""
    head = _git(root, "rev-parse", "HEAD").stdout.strip()
    failed = False
    for pkg in pkgs:
        existing = _git(root, "rev-parse", "--verify", "--quiet", f"{pkg.tag}^{{commit}}")
        if existing.returncode == 0:
            folder = str(pkg.folder.relative_to(root))
            changed = _git(root, "diff", "--quiet", pkg.tag, "HEAD", "--", folder).returncode
            if existing.stdout.strip() == head or changed == 0:
                print(f"{pkg.tag}: released, unchanged since: nothing to tag")
                continue
            message = (
                f"{pkg.name} changed since {pkg.tag} (released): bump its version to release "
                "it (RELEASING.md, step 2)"
            )
            print(f"  before a real release: {message}" if dry_run else f"error: {message}")
            failed |= not dry_run
            continue
        problems = blockers(pkg, root)
        if dry_run:
            print(f"dry run: would tag {pkg.tag} at {head[:12]}")
            for problem in problems:
                print(f"  before a real release: {problem}")
            continue
        for problem in problems:
            print(f"error: {pkg.tag}: {problem}")
        if problems:
            failed = True
            continue
        message = f"{pkg.name} {pkg.version}"
        made = _git(root, "tag", "-a", pkg.tag, "-m", message)
        if made.returncode != 0:
            print(f"error: git tag {pkg.tag}: {made.stderr.strip()}")
            failed = True
        else:
            print(f"tagged {pkg.tag} at {head[:12]}")
    return 1 if failed else 0
