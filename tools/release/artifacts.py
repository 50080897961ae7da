"""Wheels and sdists: build them, check what is inside, publish them to an index."""

from __future__ import annotations

import configparser
import hashlib
import html
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

from common import Package


def dist_folder(pkg: Package, out: Path) -> Path:
    return out / pkg.name


def dists(pkg: Package, out: Path) -> list[Path]:
    """The wheel and sdist of ``pkg``'s current version in ``out`` (built by ``build``)."""
    stem = f"{pkg.module}-{pkg.version}"
    found = [dist_folder(pkg, out) / f"{stem}-py3-none-any.whl"]
    found.append(dist_folder(pkg, out) / f"{stem}.tar.gz")
    missing = [str(f) for f in found if not f.is_file()]
    if missing:
        raise SystemExit(f"error: {pkg.name}: not built: {missing}; run `release.py build` first")
    return found


def build(pkgs: list[Package], out: Path) -> None:
    """A wheel and an sdist per package, in ``out/<name>/`` (emptied first)."""
    for pkg in pkgs:
        folder = dist_folder(pkg, out)
        shutil.rmtree(folder, ignore_errors=True)
        print(f"== build {pkg.name} {pkg.version}", flush=True)
        cmd = [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(folder)]
        done = subprocess.run([*cmd, str(pkg.folder)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: building {pkg.name} failed:\n{done.stdout}{done.stderr}")
        for file in sorted(folder.iterdir()):
            print(f"   {file.name} ({file.stat().st_size // 1024} KiB)")


def _wheel_problems(pkg: Package, wheel: Path) -> list[str]:
    """Our rules for a wheel: typed, licensed, documented, no tests, entry points, ranges."""
    project = pkg.pyproject["project"]
    names = zipfile.ZipFile(wheel).namelist()
    info = f"{pkg.module}-{pkg.version}.dist-info"
    problems = []
    if f"{pkg.module}/py.typed" not in names:
        problems.append(f"no {pkg.module}/py.typed marker")
    if f"{info}/licenses/LICENSE" not in names:
        problems.append(f"no LICENSE in {info}/licenses/")
    tests = [n for n in names if "/tests/" in n or Path(n).name.startswith("test_")]
    if tests:
        problems.append(f"tests in the wheel: {tests[:3]}")
    if any(not n.startswith((f"{pkg.module}/", f"{info}/")) for n in names):
        problems.append("files outside the package and its dist-info")
    meta = Parser().parsestr(zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode())
    readme = (pkg.folder / "README.md").read_text()
    if meta.get("Description-Content-Type") != "text/markdown" or readme not in meta.get_payload():
        problems.append("README.md is not the long description")
    if meta.get("License-Expression") != "BSD-3-Clause":
        problems.append(f"License-Expression is {meta.get('License-Expression')!r}")
    requires = set(meta.get_all("Requires-Dist") or [])
    for req in pkg.sibling_requirements():
        if not any(r.startswith(req.name) and str(req.specifier) in r for r in requires):
            problems.append(f"Requires-Dist lacks {req}")
    problems += _entry_point_problems(project, wheel, info)
    return problems


def _entry_point_problems(project: dict, wheel: Path, info: str) -> list[str]:
    wanted: dict[str, dict[str, str]] = {}
    if project.get("scripts"):
        wanted["console_scripts"] = project["scripts"]
    wanted.update(project.get("entry-points", {}))
    if not wanted:
        return []
    try:
        text = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    except KeyError:
        return ["no entry_points.txt"]
    have = configparser.ConfigParser(delimiters=("=",))
    have.optionxform = str  # entry-point names are case-sensitive
    have.read_string(text)
    return [
        f"entry point {group}:{name} missing or wrong"
        for group, points in wanted.items()
        for name, target in points.items()
        if not have.has_section(group) or have[group].get(name) != target
    ]


def _sdist_problems(pkg: Package, sdist: Path) -> list[str]:
    with tarfile.open(sdist) as tar:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    wanted = ["pyproject.toml", "README.md", "LICENSE", f"src/{pkg.module}/py.typed"]
    return [f"sdist lacks {name}" for name in wanted if name not in names]


def check_dists(pkgs: list[Package], out: Path) -> int:
    """twine check, check-wheel-contents and our rules; 1 when anything is wrong."""
    failed = False
    for pkg in pkgs:
        wheel, sdist = dists(pkg, out)
        print(f"== check {pkg.name} {pkg.version}", flush=True)
        for cmd in (["twine", "check", "--strict"], ["check_wheel_contents"]):
            files = [wheel, sdist] if cmd[0] == "twine" else [wheel]
            run = subprocess.run(
                [sys.executable, "-m", *cmd, *map(str, files)], capture_output=True, text=True
            )
            if run.returncode != 0:
                print(f"error: {pkg.name}: {cmd[0]} failed:\n{run.stdout}{run.stderr}")
                failed = True
        problems = _wheel_problems(pkg, wheel) + _sdist_problems(pkg, sdist)
        for problem in problems:
            print(f"error: {pkg.name}: {problem}")
        failed |= bool(problems)
        if not problems:
            print(f"   ok: {wheel.name}, {sdist.name}")
    return 1 if failed else 0


def publish_files(files: list[Path], index: Path) -> None:
    """Copy wheels/sdists into the PEP 503 folder ``index`` and rewrite its pages; a file
    already there with other contents is never replaced (a version is published once)."""
    for file in files:
        project = file.name.split("-")[0].replace("_", "-")
        page = index / project
        page.mkdir(parents=True, exist_ok=True)
        target = page / file.name
        if target.exists() and target.read_bytes() != file.read_bytes():
            raise SystemExit(f"error: {target} exists with other contents; never republish")
        shutil.copy2(file, target)
    for page in sorted(p for p in index.iterdir() if p.is_dir()):
        links = []
        for file in sorted(page.iterdir()):
            if file.name == "index.html":
                continue
            digest = hashlib.sha256(file.read_bytes()).hexdigest()
            name = html.escape(file.name)
            links.append(f'<a href="{name}#sha256={digest}">{name}</a><br>')
        body = "\n".join(links)
        (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{body}\n</body></html>\n")
    projects = sorted(p.name for p in index.iterdir() if (p / "index.html").is_file())
    anchors = "\n".join(f'<a href="{n}/">{n}</a><br>' for n in projects)
    (index / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{anchors}\n</body></html>\n")


def publish_folder(pkgs: list[Package], out: Path, index: Path) -> None:
    """Publish the built wheel and sdist of each package to the PEP 503 folder ``index``."""
    for pkg in pkgs:
        publish_files(dists(pkg, out), index)
        print(f"published {pkg.name} {pkg.version} to {index / pkg.name}")


def publish_twine(pkgs: list[Package], out: Path, url: str) -> int:
    """Upload with twine (credentials from twine's own environment variables or keyring)."""
    files = [str(f) for pkg in pkgs for f in dists(pkg, out)]
    cmd = [sys.executable, "-m", "twine", "upload", "--repository-url", url, *files]
    return subprocess.run(cmd).returncode
