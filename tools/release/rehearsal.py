"""The release rehearsal: build, check, tag (dry run), publish to a local index, then install
each package by name into a fresh venv holding only torch and run its smoke script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from artifacts import build, check_dists, publish_files, publish_folder
from common import PACKAGES, ROOT, Package
from matrix import run_matrix
from packaging.version import Version
from tagging import tag

SMOKE = Path(__file__).resolve().parent / "smoke"
TORCH = "torch==2.13.0"  # what the dev environment pins; the packages declare ranges


def _env() -> dict[str, str]:
    """The environment of commands in the fresh venv: nothing of this tree leaks in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy")
    return env


def _run(cmd: list[str | Path], cwd: Path, log: Path) -> None:
    """Run ``cmd``, its output into ``log``; on failure show the log's end and stop."""
    with log.open("w") as out:
        done = subprocess.run(
            [str(c) for c in cmd], cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise SystemExit(f"error: `{' '.join(map(str, cmd))}` exited {done.returncode}:\n{tail}")


def _fresh_venv(work: Path) -> tuple[Path, Path]:
    """A venv with torch only, and a constraints file that keeps that torch in place."""
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    _run([venv / "bin/python", "-m", "pip", "install", TORCH], work, work / "torch.log")
    got = subprocess.run(
        [venv / "bin/python", "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        env=_env(),
        check=True,
    ).stdout.strip()
    constraints = work / "constraints.txt"
    constraints.write_text(f"torch=={got}\n")  # no install may swap torch for another build
    print(f"   fresh venv {venv} with torch {got} only")
    return venv, constraints


def _pip_install(wanted: list[str], venv: Path, index: Path, constraints: Path, log: Path) -> None:
    """``pip install`` by name from the local index; every titan-* must come from it."""
    report = log.with_suffix(".json")
    cmd = [venv / "bin/python", "-m", "pip", "install", "--report", report]
    cmd += ["--extra-index-url", index.as_uri(), "-c", constraints, *wanted]
    _run(cmd, log.parent, log)
    for item in json.loads(report.read_text())["install"]:
        name, url = item["metadata"]["name"], item["download_info"]["url"]
        if name.startswith("titan-") and not url.startswith(index.as_uri()):
            raise SystemExit(f"error: {name} was installed from {url}, not the local index")
        if name == "torch":
            raise SystemExit(f"error: installing {wanted} replaced torch ({url})")


def _install(pkg: Package, venv: Path, index: Path, constraints: Path, work: Path) -> None:
    """``pip install <name>``: the way a user gets the package."""
    _pip_install([pkg.name], venv, index, constraints, work / f"install-{pkg.name}.log")
    print(f"   pip install {pkg.name}: ok ({pkg.name} {pkg.version} from {index})")


def _smoke(pkg: Package, venv: Path, work: Path) -> None:
    """The smoke script of one package, run in the fresh venv from outside the tree."""
    bin_ = venv / "bin"
    log = work / f"smoke-{pkg.name}.log"
    if pkg.name == "titan-dims":
        _run([bin_ / "torchrun", "--nproc-per-node", "2", SMOKE / "dims_torchrun.py"], work, log)
    elif pkg.name == "titan-ckpt":
        ckpt = work / "ckpt"
        _run([bin_ / "python", SMOKE / "ckpt_make.py", ckpt], work, log)
        _run([bin_ / "titan-ckpt", "verify", ckpt / "step-1"], work, work / "verify.log")
        _run([bin_ / "titan-ckpt", "inspect", "--json", ckpt / "step-1"], work, log)
        states = json.loads(log.read_text())["manifest"]["states"]
        assert states == ["model", "optimizer"], states
        log.write_text(f"ckpt smoke ok: titan-ckpt verify OK, inspect shows states {states}\n")
    elif pkg.name == "titan-models":
        _run([bin_ / "python", SMOKE / "models_optim.py"], work, log)
    elif pkg.name == "titan-train":
        out = work / "train"
        cmd = [bin_ / "titan-train", "--training.steps", "2", "--job.dump_folder", out]
        _run(cmd, work, log)
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert any(row.get("step") == 2 for row in steps), steps[-1:]
    else:
        return  # titan-optim: exercised by the titan-models smoke
    print(f"   smoke {pkg.name}: ok ({log.name}: {log.read_text().splitlines()[-1][:80]})")


def rehearse(pkgs: list[Package], out: Path | None, *, quick: bool) -> int:
    """The whole rehearsal; ``quick`` runs only the titan-dims and titan-ckpt smokes."""
    work = Path(out or tempfile.mkdtemp(prefix="titan-release-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"== release rehearsal in {work}")
    build(pkgs, work / "dist")
    if check_dists(pkgs, work / "dist") != 0:
        return 1
    if tag(pkgs, ROOT, dry_run=True) != 0:
        return 1
    index = work / "index"
    publish_folder(pkgs, work / "dist", index)
    print(f"   built, checked and published in {time.monotonic() - started:.0f} s")
    venv, constraints = _fresh_venv(work)
    for pkg in pkgs:
        began = time.monotonic()
        _install(pkg, venv, index, constraints, work)
        if not quick or pkg.name in ("titan-dims", "titan-ckpt"):
            _smoke(pkg, venv, work)
        print(f"   {pkg.name}: {time.monotonic() - began:.0f} s")
    print("== mixed versions: last releases with this tree, where the ranges admit them")

    def mix(pins: dict[str, Version], higher: Package) -> None:
        _run([venv / "bin/python", "-m", "pip", "uninstall", "-y", *PACKAGES], work, work / "u.log")
        wanted = [f"{name}=={version}" for name, version in pins.items()]
        if higher.name == "titan-models":
            wanted.append("titan-optim")  # its smoke trains with titan-optim too
        log = work / f"mix-{'-'.join(w.replace('==', '-') for w in wanted)}.log"
        _pip_install(wanted, venv, index, constraints, log)
        _smoke(higher, venv, work)

    def publish(folder: Path) -> None:
        publish_files(sorted(folder.glob("*/*.whl")), index)

    if run_matrix(pkgs, ROOT, work, publish, mix) != 0:
        return 1
    print(f"== release rehearsal ok in {time.monotonic() - started:.0f} s")
    return 0
