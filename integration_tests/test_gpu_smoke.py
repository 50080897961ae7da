"""``tools/gpu_smoke.sh`` rehearsed on this CPU machine, as it runs on an offline GPU node:
no install, the carried wheels unpacked with ``pip --no-index``, titan's entry points found
without an installed distribution, a clean stop at the device check with its own exit
status, and the results in ``$OUT``. A GPU node runs the whole script instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_smoke.sh"
NO_DEVICE = 3


def probe_wheel(folder: Path) -> Path:
    """A one-module pure-Python wheel, standing in for the carried ones (tyro...)."""
    wheel = folder / "smokeprobe-1.0-py3-none-any.whl"
    info = "smokeprobe-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("smokeprobe.py", "VALUE = 1\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: smokeprobe\nVersion: 1.0\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return wheel


def smoke(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU node runs the whole script")
def test_without_cuda_it_stops_at_the_device_check_with_its_results_in_out(tmp_path):
    wheels, out, work = tmp_path / "wheels", tmp_path / "out", tmp_path / "work"
    wheels.mkdir()
    probe_wheel(wheels)
    run = smoke(tmp_path, OUT=str(out), WORK=str(work), WHEELS=str(wheels))
    console = run.stdout + run.stderr
    assert run.returncode == NO_DEVICE, console
    assert "no CUDA device" in run.stdout
    assert len(console) < 10_000
    # The environment item passed: titan's models and adapters found through the .dist-info
    # the script wrote (no titan distribution needed), the carried wheel unpacked offline.
    env_log = (work / "env.log").read_text()
    assert "models ['deepseek_v3', 'llama3', 'qwen3']" in env_log
    assert (work / "site" / "smokeprobe.py").is_file()
    assert (work / "site" / "titan_train-0.1.0.dist-info" / "entry_points.txt").is_file()
    log = (out / "smoke.log").read_text()
    pip_lines = [line for line in log.splitlines() if "pip install" in line]
    assert pip_lines, log
    assert all("--no-index" in line for line in pip_lines), pip_lines
    summary = (out / "summary.txt").read_text()
    assert summary.splitlines()[1].split()[:2] == ["env", "ok"]
    assert "plain     not run" in summary
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "./env.log" in tar.getnames()


def test_an_unknown_only_item_is_refused_before_any_work(tmp_path):
    run = smoke(tmp_path, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), ONLY="plain,moee")
    assert run.returncode == 2
    assert "ONLY names an unknown item 'moee'; items: env plain moe" in run.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "work").exists()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_the_gpu_scripts_pass_shellcheck():
    scripts = [str(SCRIPT), str(ROOT / "tools" / "gpu_wheels.sh")]
    run = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
