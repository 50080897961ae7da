"""``titan-ckpt convert`` streams: its peak memory is about one tensor, not the checkpoint.

The input is a 256 MiB DCP checkpoint of 64 tensors of 4 MiB (plus small vectors and a train
state). Each conversion runs as the real command in a fresh interpreter, which reports its
peak resident memory (``VmHWM``) at three points:

- after importing torch and titan_ckpt: the interpreter's baseline, reported;
- after converting a tiny checkpoint of the same formats: the baseline the bound is taken
  from, which adds the modules and one-time setup each path loads (FakeTensorMode for
  torch.save output, DCP's planner) but no data;
- after converting the 256 MiB checkpoint.

The growth in the last step must stay under 2x the largest tensor plus ``SLACK``. SLACK
covers what is not tensor data: DCP's metadata and plan for ~130 keys, the safetensors
header, the pickle of a torch.save file, and the 1 MiB hashing buffer of the commit. A
conversion that held the state would grow by the checkpoint's 256 MiB. Measured on the
development machine: 3-4.5 MiB of growth for every path (about one 4 MiB tensor).

The chain covers every reader and writer that streams: DCP -> torch.save -> DCP and
DCP -> safetensors -> DCP, two conversions at a time, and both ends are bit-exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

MIB = 1 << 20
LARGEST = 4 * MIB
SLACK = 8 * MIB

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/status"), reason="reads VmHWM from /proc"
)

CHILD = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from titan_ckpt.cli import main

def peak():
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith("VmHWM:")).split()[1]) * 1024

tiny, big = json.loads(sys.argv[1])
imported = peak()
assert main(tiny) == 0, tiny
warm = peak()
assert main(big) == 0, big
print("PEAKS", json.dumps([imported, warm, peak()]))
"""


def make_dcp(path, layers: int, numel: int) -> None:
    import torch.distributed.checkpoint as dcp

    state: dict[str, object] = {}
    for i in range(layers):
        state[f"layers.{i}.w"] = torch.arange(numel, dtype=torch.float32) + i
        state[f"layers.{i}.b"] = torch.full((64,), float(i))
    state["train_state"] = {"step": 3}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def start(tiny: list, big: list) -> subprocess.Popen:
    argv = [sys.executable, "-c", CHILD, json.dumps([list(map(str, tiny)), list(map(str, big))])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(proc: subprocess.Popen) -> tuple[int, int, int]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return tuple(json.loads(out.split("PEAKS ", 1)[1]))


def test_convert_peak_memory_is_about_one_tensor(tmp_path, titan_ckpt):
    big, tiny = tmp_path / "big", tmp_path / "tiny"
    make_dcp(big, layers=64, numel=LARGEST // 4)
    make_dcp(tiny, layers=2, numel=16)
    # Tiny inputs in the other formats, for the warm-up runs.
    assert titan_ckpt("convert", tiny, tmp_path / "tiny.pt", "--to", "torch")[0] == 0
    assert titan_ckpt("convert", tiny, tmp_path / "tiny-st", "--to", "safetensors")[0] == 0

    phases = [  # (source, tiny source of its format, output, --to); a phase runs at once
        [(big, tiny, "big.pt", "torch"), (big, tiny, "st", "safetensors")],
        [
            (tmp_path / "big.pt", tmp_path / "tiny.pt", "from-torch", "dcp"),
            (tmp_path / "st", tmp_path / "tiny-st", "from-st", "dcp"),
        ],
    ]
    peaks = {}
    for phase in phases:
        running = [
            (f"{src.name} -> {to}", start(
                ["convert", tiny_src, tmp_path / f"warm-{dst}", "--to", to],
                ["convert", src, tmp_path / dst, "--to", to],
            ))
            for src, tiny_src, dst, to in phase
        ]  # fmt: skip
        for name, proc in running:
            peaks[name] = finish(proc)

    report = {
        name: {
            "import_baseline_mib": round(imported / MIB, 1),
            "warm_baseline_mib": round(warm / MIB, 1),
            "growth_mib": round((peak - warm) / MIB, 1),
        }
        for name, (imported, warm, peak) in peaks.items()
    }
    print("peak memory of titan-ckpt convert:", json.dumps(report, indent=1))  # pytest -s
    for name, (_, warm, peak) in peaks.items():
        assert peak - warm <= 2 * LARGEST + SLACK, (name, report)

    for out in ("from-torch", "from-st"):
        code, stdout, _ = titan_ckpt("diff", big, tmp_path / out)
        assert code == 0, stdout
        assert "compared 128 tensors and 1 other values" in stdout
