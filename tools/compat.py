"""The torch range the packages declare, tested: one fresh venv per torch version.

    hatch run compat                      # each declared lowest torch, 2.11 and 2.15
    hatch run compat 2.11.0 2.15.0        # chosen versions

For each version: a venv with that torch (pip, from the configured index) and every titan
package whose ``torch>=`` admits it, installed by path as a user would get them; then, from
the repository root, a few fast unit tests of each installed package, the main job
(``titan-train --training.steps 3``) and a 2-rank FSDP run. One line per check, a table at
the end; exit 1 when anything failed. Several GB of downloads (PyPI's Linux torch is a CUDA
build, which runs on CPU) and 5-15 minutes per version on a 2-core machine: a command for
before a release, not for CI. pip's configuration applies: a constraints file that caps
torch needs lifting (``PIP_CONSTRAINT=/dev/null``). Venvs go under ``$TMPDIR/titan-compat``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ["2.11.0", "2.15.0"]  # with the lowest declared, found below
TESTS = {
    "titan-dims": ["packages/titan-dims/tests/test_parallel_dims.py"],
    "titan-ckpt": ["packages/titan-ckpt/tests/test_manager.py"],
    "titan-optim": ["packages/titan-optim/tests/test_container.py"],
    "titan-models": ["packages/titan-models/tests/llama3/test_model.py"],
    "titan-train": ["packages/titan-train/tests/test_config.py"],
}
TRAIN = ["--training.steps", "3", "--metrics.no_enable_tensorboard", "--checkpoint.no_enable"]
FOLDERS = sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def requirements(folder: Path) -> list[Requirement]:
    """The package's declared dependencies."""
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    return [Requirement(d) for d in project["dependencies"]]


def torch_floor(folder: Path) -> str:
    """The lowest torch the package at ``folder`` declares."""
    (spec,) = [r.specifier for r in requirements(folder) if r.name == "torch"]
    return next(s.version for s in spec if s.operator == ">=")


def siblings(folder: Path) -> set[str]:
    """The titan packages the package at ``folder`` requires."""
    return {r.name for r in requirements(folder) if r.name.startswith("titan-")}


def run(
    name: str,
    command: list[str],
    results: list[tuple[str, str, str, float]],
    torch: str,
    env: dict[str, str],
) -> bool:
    """Run one check from the repository root; record and print its line."""
    start = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    status = "pass" if done.returncode == 0 else f"FAIL ({done.returncode})"
    results.append((torch, name, status, took))
    print(f"torch {torch:8} {name:28} {status:9} {took:6.0f} s", flush=True)
    if done.returncode:
        print((done.stdout + done.stderr)[-3000:], flush=True)
    return done.returncode == 0


def check(torch: str, results: list[tuple[str, str, str, float]], work: Path) -> None:
    """Install torch ``torch`` and the packages that admit it into a new venv; run the checks."""
    admitted = {
        p.name: p
        for p in FOLDERS
        if Requirement(f"torch>={torch_floor(p)}").specifier.contains(torch)
    }
    while dropped := [n for n, p in admitted.items() if not siblings(p) <= admitted.keys()]:
        for name in dropped:  # a package is usable only with its siblings installed
            del admitted[name]
    names = list(admitted)
    venv = work / f"torch-{torch}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    py = str(venv / "bin" / "python")
    # --upgrade-deps: the pip that venv bundles may not resolve a path requirement's extras
    subprocess.run(
        [sys.executable, "-m", "venv", "--clear", "--upgrade-deps", str(venv)], check=True
    )
    wanted = [f"torch=={torch}", *(f"{p}[test]" for p in admitted.values())]
    if not run(
        f"install {len(names)} packages",
        [py, "-m", "pip", "install", "-q", *wanted],
        results,
        torch,
        env,
    ):
        return
    for name in names:
        run(
            f"{name} tests",
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *TESTS[name]],
            results,
            torch,
            env,
        )
    if "titan-train" in names:
        run(
            "titan-train 3 steps",
            ["titan-train", "--job.dump_folder", str(venv / "one"), *TRAIN],
            results,
            torch,
            env,
        )
        run(
            "titan-train 2 ranks FSDP",
            [
                "titan-train",
                "--nproc-per-node",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--job.dump_folder",
                str(venv / "two"),
                *TRAIN,
            ],
            results,
            torch,
            env,
        )


def main(argv: list[str]) -> int:
    """Check each version of torch given (default: the lowest declared, then VERSIONS)."""
    floors = sorted({torch_floor(p) for p in FOLDERS}, key=lambda v: tuple(map(int, v.split("."))))
    versions = argv or [*(f"{v}.0" if v.count(".") == 1 else v for v in floors), *VERSIONS]
    work = Path(tempfile.gettempdir()) / "titan-compat"
    results: list[tuple[str, str, str, float]] = []
    for torch in versions:
        check(torch, results, work)
    print("\ntorch     check                        result    seconds")
    for torch, name, status, took in results:
        print(f"{torch:9} {name:28} {status:9} {took:7.0f}")
    return int(any(status != "pass" for *_, status, _ in results))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
