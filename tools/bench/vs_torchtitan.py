"""titan against torchtitan, side by side in one run: the same workload (Llama 3 debug
model, batch 8 x seq 2048 per rank, fp32, no checkpoints, no compile) trained by
``titan-train`` and by torchtitan at its July 2025 commit, interleaved (titan, torchtitan,
titan, torchtitan) per setting, with the fp32 matmul peak measured before each setting;
then the table of tokens/s per rank, peak RSS, final losses and the ratio per setting with
its spread over the repetitions.

It drives the shared CPU harness (``run_side_by_side.sh`` and ``parse_side_by_side.py`` in
``shared/anchors/torchtitan-cpu``), which runs torchtitan on CPU through a runtime shim,
without editing its source; its README says how to extract torchtitan and make its venv.

    python tools/bench/vs_torchtitan.py --torchtitan /work/tt/torchtitan \\
        --torchtitan-venv /work/tt/venv                 # 1p-none 1p-op 2p-fsdp, ~15 min
    python tools/bench/vs_torchtitan.py ... --settings 1p-none --reps 3

Settings: ``1p-none`` one process (all cores) without activation checkpointing, ``1p-op``
with per-op selective checkpointing, ``2p-fsdp`` two FSDP ranks of one thread each. Run it
on a quiet machine: the ratio is of runs minutes apart, and a 2-core machine shared with
anything else moves each run by 5-20%.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_HARNESS = REPO.parent / "shared" / "anchors" / "torchtitan-cpu"
SETTINGS = ("1p-none", "1p-op", "2p-fsdp")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--torchtitan",
        type=Path,
        required=True,
        help="torchtitan checkout at 6204cdff9 (extracted, not a git dir)",
    )
    parser.add_argument(
        "--torchtitan-venv",
        type=Path,
        required=True,
        help="the venv torchtitan runs in (torch 2.13.0 and its requirements)",
    )
    parser.add_argument(
        "--harness",
        type=Path,
        default=DEFAULT_HARNESS,
        help=f"the shared CPU harness folder (default {DEFAULT_HARNESS})",
    )
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument(
        "--reps",
        type=int,
        choices=(1, 2, 3),
        default=2,
        help="titan/torchtitan pairs per setting (the table reads up to 3)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the runs' logs (default: a new one under /tmp)",
    )
    args = parser.parse_args()
    missing = [
        f"{what} {path}"
        for what, path in (
            ("harness script", args.harness / "run_side_by_side.sh"),
            ("torchtitan checkout", args.torchtitan / "torchtitan" / "train.py"),
            ("torchtitan venv python", args.torchtitan_venv / "bin" / "python"),
        )
        if not path.exists()
    ]
    if missing:
        print(f"vs_torchtitan: not found: {'; '.join(missing)}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="vs-torchtitan."))
    if out.exists() and any(out.iterdir()):
        print(f"vs_torchtitan: {out} is not empty; give a new --out folder", file=sys.stderr)
        return 2
    env = dict(
        os.environ,
        TITAN=str(REPO),
        TT=str(args.torchtitan.resolve()),
        TT_VENV=str(args.torchtitan_venv.resolve()),
        REPS=" ".join(str(r) for r in range(1, args.reps + 1)),
    )
    run = subprocess.run(
        ["bash", str(args.harness / "run_side_by_side.sh"), str(out), *args.settings], env=env
    )
    if run.returncode != 0:
        return run.returncode
    print(f"\nlogs: {out}\n")
    return subprocess.run(
        [sys.executable, str(args.harness / "parse_side_by_side.py"), str(out)]
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
