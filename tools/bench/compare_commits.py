"""Training throughput of two commits side by side: the same ``train_throughput.py``
settings, run from two source trees in one run, interleaved old, new, new, old (so a linear
drift of the machine's speed cancels), tokens/s per rank and the ratio new / old.

    git worktree add /tmp/old a68eee3        # the commit to compare with
    python tools/bench/compare_commits.py /tmp/old --only 2p-fsdp-fp32 1p-op
    python tools/bench/compare_commits.py /tmp/old --new /tmp/other --rounds 2

Each tree's ``packages/*/src`` goes first on ``PYTHONPATH`` of its runs, so both run on this
environment's torch and dependencies with their own titan code. Each run's loss is printed
too: a change that should not touch the math shows the same losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import train_throughput

ROOT = Path(__file__).resolve().parents[2]


def source_path(tree: Path) -> str:
    """``PYTHONPATH`` that makes ``tree``'s packages win over the installed ones."""
    sources = sorted((tree / "packages").glob("*/src"))
    if not sources:
        raise SystemExit(f"compare_commits.py: {tree} has no packages/*/src: not a titan tree")
    return os.pathsep.join(str(s) for s in sources)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the source tree to compare with")
    parser.add_argument("--new", type=Path, default=ROOT, help="default: this checkout")
    parser.add_argument("--only", nargs="*", default=["1p-none", "2p-fsdp-fp32"])
    parser.add_argument("--steps", type=int, default=3, help="steps per run (first discarded)")
    parser.add_argument("--rounds", type=int, default=1, help="old-new-new-old rounds")
    options = parser.parse_args()
    unknown = set(options.only) - train_throughput.SETTINGS.keys()
    if unknown:
        parser.error(
            f"unknown settings {sorted(unknown)}; choose from {sorted(train_throughput.SETTINGS)}"
        )
    trees = {"old": source_path(options.old), "new": source_path(options.new)}
    for name in options.only:
        nproc, threads, args = train_throughput.SETTINGS[name]
        tps: dict[str, list[float]] = {"old": [], "new": []}
        for _ in range(options.rounds):
            for label in ("old", "new", "new", "old"):
                os.environ["PYTHONPATH"] = trees[label]
                result = train_throughput.run_setting(nproc, threads, args, options.steps)
                print(name, label, json.dumps(result), flush=True)
                if "tps" in result:
                    tps[label].append(result["tps"])
        if tps["old"] and tps["new"]:
            old, new = statistics.mean(tps["old"]), statistics.mean(tps["new"])
            print(
                f"{name}: old {old:,.0f} new {new:,.0f} tokens/s per rank, new/old {new / old:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
