"""Mixed versions: the last release of a package with this tree's siblings, where ranges allow.

For each package with a release tag older than its tree version (``titan-<name>-v<X>``),
the wheel of that release is built from git and published beside the tree's wheels. Then,
for each pair (higher package, lower sibling it requires):
- this tree's higher package with the lower one's last release, when the tree's range
  admits it;
- the higher package's last release with this tree's lower one, when that release's range
  admits it;
each installed by name into the rehearsal venv and checked with the higher package's smoke.
No tag yet means nothing to mix: the step says so and passes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import tomllib
from common import Package
from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version


def last_release(pkg: Package, root: Path) -> Version | None:
    """The newest tagged release of ``pkg`` older than its tree version."""
    prefix = f"{pkg.name}-v"
    tags = subprocess.run(
        ["git", "-C", str(root), "tag", "--list", f"{prefix}*"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    versions = []
    for name in tags:
        try:
            versions.append(Version(name.removeprefix(prefix)))
        except InvalidVersion:
            continue
    older = [v for v in versions if v < pkg.version]
    return max(older) if older else None


def _checkout(pkg: Package, version: Version, root: Path, into: Path) -> Path:
    """The package's folder as tagged at ``version``, extracted under ``into``."""
    folder = pkg.folder.relative_to(root).as_posix()
    archive = into / f"{pkg.name}-{version}.tar"
    tag = f"{pkg.name}-v{version}"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(root), "archive", tag, folder], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / folder


def build_release(pkg: Package, version: Version, root: Path, out: Path) -> list[str]:
    """Build the wheel of ``pkg``'s tagged ``version`` into ``out/<name>/``; return that
    release's requirement ranges on siblings (by name) for the reverse mix."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = _checkout(pkg, version, root, Path(tmp))
        target = out / pkg.name
        cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(target), str(folder)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(
                f"error: building {pkg.name} {version} from git failed:\n{done.stderr}"
            )
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    print(f"   built {pkg.name} {version} from tag {pkg.name}-v{version}")
    return project.get("dependencies", [])


def mixes(pkgs: list[Package], previous: dict[str, Version], old_deps: dict[str, list[str]]):
    """(higher name, higher version, lower name, lower version) pairs the ranges admit."""
    tree = {pkg.name: pkg.version for pkg in pkgs}
    for higher in pkgs:
        for req in higher.sibling_requirements():
            old = previous.get(req.name)
            if old is not None and req.specifier.contains(old, prereleases=True):
                yield higher.name, tree[higher.name], req.name, old
        if higher.name in previous:
            for line in old_deps.get(higher.name, []):
                req = Requirement(line)
                if req.name in tree and req.specifier.contains(tree[req.name], prereleases=True):
                    yield higher.name, previous[higher.name], req.name, tree[req.name]


def run_matrix(
    pkgs: list[Package],
    root: Path,
    work: Path,
    publish: Callable[[Path], None],
    install_and_smoke: Callable[[dict[str, Version], Package], None],
) -> int:
    """Build the last releases, publish them, install and smoke every admitted mix."""
    previous = {p.name: v for p in pkgs if (v := last_release(p, root)) is not None}
    if not previous:
        print("   no earlier release tag (titan-<name>-v*): no mixed versions to check yet")
        return 0
    old_dists = work / "previous"
    shutil.rmtree(old_dists, ignore_errors=True)
    old_deps = {
        p.name: build_release(p, previous[p.name], root, old_dists)
        for p in pkgs
        if p.name in previous
    }
    publish(old_dists)
    by_name = {p.name: p for p in pkgs}
    count = 0
    for higher, hv, lower, lv in mixes(pkgs, previous, old_deps):
        print(f"   mix: {higher} {hv} with {lower} {lv}")
        install_and_smoke({higher: hv, lower: lv}, by_name[higher])
        count += 1
    print(f"   {count} mixed-version install(s) passed")
    return 0
