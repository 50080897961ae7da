"""The summary table of ``tools/gpu_8.sh``: one row per item from ``OUT/items.tsv`` (name,
status, seconds, folder, reference item, metric, reference step), with the item's last
record in ``metrics.jsonl`` and its difference from the reference item's value of the same
metric at the same step (or at the reference step given).

    python tools/gpu8/summary.py OUT

A difference above ``TOLERANCE`` (relative) is marked ``!``: layouts of one model from one
seed checkpoint differ only by bf16 rounding and reduction order over 20 steps.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

TOLERANCE = 0.02
NAN = float("nan")


def records(folder: Path) -> list[dict]:
    """Every metrics record of a run folder (torchft groups: replica 0's)."""
    for path in (folder / "metrics.jsonl", folder / "ft-replica-0" / "metrics.jsonl"):
        if path.is_file():
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return []


def value_at(folder: Path, key: str, step: int | None) -> tuple[int | None, float]:
    """(step, value) of ``key``: at ``step``, or the last record holding it."""
    found = [(r["step"], r[key]) for r in records(folder) if key in r]
    if step is not None:
        found = [(s, v) for s, v in found if s == step]
    return found[-1] if found else (None, NAN)


def save_seconds(log: Path) -> str:
    """The checkpoint timings rank 0 logged (``Saved``/``Staged`` ... in N s)."""
    if not log.is_file():
        return ""
    times = re.findall(r"(Saved|Staged) \S*?(step-\d+) in ([\d.]+) s", log.read_text())
    return " ".join(f"{kind.lower()} {step} {secs}s" for kind, step, secs in times[-3:])


def main(out: Path) -> None:
    rows = [line.split("\t") for line in (out / "items.tsv").read_text().splitlines() if line]
    folders = {row[0]: Path(row[3]) for row in rows}
    head = (
        f"{'item':<22} {'status':<10} {'wall s':>6} {'step':>4} {'metric':>9} {'vs ref':>8} "
        f"{'tok/s/GPU':>10} {'MFU %':>6} {'resv GiB':>8} {'alloc GiB':>9} {'retries':>7}  notes"
    )
    print(head)
    print("-" * len(head))
    for name, status, seconds, folder, ref, key, ref_step in rows:
        step, value = value_at(Path(folder), key, None)
        last = records(Path(folder))
        last = next((r for r in reversed(last) if "tps" in r), {})
        versus = ""
        if ref and ref != name and not math.isnan(value):
            want_step = int(ref_step) if ref_step else step
            _, expected = value_at(folders.get(ref, Path("/nonexistent")), key, want_step)
            if not math.isnan(expected):
                rel = (value - expected) / abs(expected)
                versus = f"{100 * rel:+.2f}%" + ("!" if abs(rel) > TOLERANCE else "")
        notes = save_seconds(out / f"{name}.log")
        if key != "loss" and not math.isnan(value):
            notes = f"{key} {value:.4f} {notes}"
        print(
            f"{name:<22} {status[:10]:<10} {float(seconds):>6.0f} {step or '-':>4} "
            f"{value:>9.4f} {versus:>8} {last.get('tps', NAN):>10,.0f} "
            f"{last.get('mfu_pct', NAN):>6.1f} {last.get('memory_gib', NAN):>8.2f} "
            f"{last.get('memory_allocated_gib', NAN):>9.2f} "
            f"{last.get('memory_alloc_retries', NAN):>7.0f}  {notes}".rstrip()
        )
    failed = [row[0] for row in rows if row[1] != "ok"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} items ok", end="")
    print(f"; not ok: {', '.join(failed)}" if failed else "")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
