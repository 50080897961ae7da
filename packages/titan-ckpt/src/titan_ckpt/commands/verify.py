"""``titan-ckpt verify``: is a checkpoint intact, and if not, which files and keys are damaged.

A DCP step: the manifest (sizes, checksums), ``.metadata``, every tensor's chunks covering it
exactly once, every chunk inside an existing file, every entry loading. A torchtitan step gets
all but the manifest; an uncommitted step of ours is not OK (exit 1). Safetensors and
torch.save files are checked for readability.
"""

from __future__ import annotations

import math
import os
from typing import Any

from titan_ckpt.commands import detect, open_source
from titan_ckpt.errors import CheckpointIntegrityError, UnsafeCheckpointError
from titan_ckpt.formats.base import Source, batches
from titan_ckpt.formats.checksums import entry_algorithm
from titan_ckpt.formats.dcp import DCP_METADATA, DcpSource
from titan_ckpt.layout import (
    COMMIT_MARKER,
    OWNER_MARKER,
    UNREADABLE_MARKER_MEANS,
    marker_problem,
    read_manifest,
    scan_steps,
    step_dir,
    step_name,
    verify_step,
)
from titan_ckpt.storage import LocalStorage

__all__ = ["verify_path"]

NO_MANIFEST = "no titan manifest: checked metadata and readability only"
NEVER_COMMITTED = (
    f"no commit marker ({COMMIT_MARKER}) beside titan's {OWNER_MARKER}: the save of this step "
    "was interrupted or is still in progress, so a run will not load it"
)


def verify_path(path: str, *, trust_pickles: bool = False) -> dict[str, Any]:
    """``{"path", "ok", "problems": [...], "notes": [...]}`` (a folder: one per step).

    A pickle outside the allowlist is not damage but a refusal: ``UnsafeCheckpointError``
    (unless ``trust_pickles``; see ``open_source``). A step whose save never committed is
    not OK, with ``"uncommitted": True``."""
    if os.path.isdir(path) and _never_committed(path):
        return {
            **_result(path, [NEVER_COMMITTED], ["its files were not checked"]),
            "uncommitted": True,
        }
    kind = detect(path)
    if kind == "folder":
        storage = LocalStorage()
        scan = scan_steps(storage, path)
        # An uncommitted step with a commit marker that does not parse is checked and
        # reported like a damaged one; one without a marker is an interrupted (or running)
        # save. torchtitan's steps get the DCP checks only.
        torn = [s for s in scan.uncommitted if marker_problem(storage, step_dir(storage, path, s))]
        checked = sorted(scan.committed + scan.torchtitan + torn)
        steps = [_verify_one(step_dir(storage, path, s), "dcp", trust_pickles) for s in checked]
        notes = [f"{step_name(s)}: uncommitted (interrupted or in progress), not checked"
                 for s in scan.uncommitted if s not in torn]  # fmt: skip
        notes += [f"{step_name(s)}: not titan's or torchtitan's, not checked" for s in scan.foreign]
        return {
            "path": path,
            "ok": all(s["ok"] for s in steps),
            "problems": [
                f"{os.path.basename(s['path'])}: {p}" for s in steps for p in s["problems"]
            ],
            "notes": notes,
            "steps": steps,
        }
    return _verify_one(path, kind, trust_pickles)


def _never_committed(path: str) -> bool:
    """Ours and never committed: ``classify_step``'s "interrupted" by its owner marker. (A
    commit marker that does not parse is interrupted too, but reported as damage, by
    ``_check_manifest``; a plain DCP directory has neither marker.)"""
    storage = LocalStorage()
    return storage.exists(storage.join(path, OWNER_MARKER)) and not storage.exists(
        storage.join(path, COMMIT_MARKER)
    )


def _verify_one(path: str, kind: str, trust_pickles: bool) -> dict[str, Any]:
    problems: list[str] = []
    notes: list[str] = []
    if kind == "dcp":
        _check_manifest(path, problems, notes)
        if not os.path.exists(os.path.join(path, DCP_METADATA)):
            problems.append(f"{DCP_METADATA}: missing (DCP's index of every key and file)")
            return _result(path, problems, notes)
    try:
        source = open_source(path, trust_pickles=trust_pickles)
    except UnsafeCheckpointError:
        raise
    except Exception as error:  # unreadable metadata, header or pickle
        what = DCP_METADATA if kind == "dcp" else "the checkpoint's header"
        problems.append(f"{what}: unreadable ({type(error).__name__}: {_short(error)})")
        return _result(path, problems, notes)
    if isinstance(source, DcpSource):
        _check_coverage(source, problems)
    _check_bounds(source, problems)
    _check_readable(source, problems)
    return _result(path, problems, notes)


def _result(path: str, problems: list[str], notes: list[str]) -> dict[str, Any]:
    return {"path": path, "ok": not problems, "problems": problems, "notes": notes}


def _check_manifest(path: str, problems: list[str], notes: list[str]) -> None:
    storage = LocalStorage()
    manifest = read_manifest(storage, path)
    if manifest is None:
        problem = marker_problem(storage, path)
        if problem is not None:  # present but unparsable: damaged, or torn by a crash
            problems.append(
                f"{COMMIT_MARKER}: unreadable ({problem}); {UNREADABLE_MARKER_MEANS}. If the "
                "data files are intact, restore the marker from a copy"
            )
        else:
            notes.append(NO_MANIFEST)
        return
    try:
        verify_step(storage, path, manifest, checksums=True)
    except CheckpointIntegrityError as error:
        problems.extend(error.problems)
    algorithms = sorted({entry_algorithm(info) or "?" for info in manifest.files.values()})
    notes.append(
        f"titan manifest: {len(manifest.files)} files checked (size and {', '.join(algorithms)})"
    )


def _check_coverage(source: DcpSource, problems: list[str]) -> None:
    """Each tensor's chunks must tile it: inside its bounds, disjoint, volumes summing to it."""
    for key, e in source.entries.items():
        if not e.is_tensor:
            continue
        shape = e.shape or ()
        boxes = []
        for s in e.shards:
            lo, n = s["offsets"], s["sizes"]
            if len(lo) != len(shape) or any(
                o < 0 or o + k > d for o, k, d in zip(lo, n, shape, strict=True)
            ):
                problems.append(
                    f"{key}: shard at offsets {lo} sizes {n} exceeds shape {list(shape)}"
                )
            boxes.append((lo, n))
        volume = sum(math.prod(n) for _, n in boxes)
        overlap = _first_overlap(boxes)
        if overlap:
            (a, _), (b, _) = overlap
            problems.append(f"{key}: shards at offsets {a} and {b} overlap")
        elif volume != e.numel:
            problems.append(
                f"{key}: shards cover {volume} of {e.numel} elements (a shard is missing from "
                ".metadata)"
            )


def _first_overlap(boxes: list[tuple[list[int], list[int]]]) -> tuple | None:
    """Two overlapping boxes, or None. A sweep along the first dimension compares a box only
    with those whose first-dimension range it meets, so the usual shardings (and a hostile
    .metadata of many thousands of chunks) take about n log n, not n^2, comparisons."""
    if not boxes or not boxes[0][0]:  # scalars: any two chunks overlap
        return (boxes[0], boxes[1]) if len(boxes) > 1 else None
    active: list[tuple[list[int], list[int]]] = []
    for box in sorted((b for b in boxes if math.prod(b[1])), key=lambda b: b[0][0]):
        start = box[0][0]
        active = [a for a in active if a[0][0] + a[1][0] > start]
        for other in active:
            if _overlap(other, box):
                return other, box
        active.append(box)
    return None


def _overlap(a: tuple[list[int], list[int]], b: tuple[list[int], list[int]]) -> bool:
    (ao, an), (bo, bn) = a, b
    return all(x < y + m and y < x + k for x, k, y, m in zip(ao, an, bo, bn, strict=True))


def _check_bounds(source: Source, problems: list[str]) -> None:
    """Every stored chunk must lie inside an existing file; name the keys a file loses."""
    root = source.path if os.path.isdir(source.path) else os.path.dirname(source.path) or "."
    sizes: dict[str, int | None] = {}
    lost: dict[str, list[str]] = {}
    for key, e in source.entries.items():
        for s in e.shards:
            name = s.get("file")
            if name is None:
                problems.append(f"{key}: a shard has no storage entry in {DCP_METADATA}")
                continue
            if name not in sizes:
                full = os.path.join(root, name)
                sizes[name] = os.path.getsize(full) if os.path.exists(full) else None
            size = sizes[name]
            if size is None or s["offset"] + s["length"] > size:
                lost.setdefault(name, []).append(key)
    for name, keys in sorted(lost.items()):
        what = "missing" if sizes[name] is None else f"truncated ({sizes[name]} bytes)"
        shown = ", ".join(sorted(set(keys))[:8]) + (" ..." if len(set(keys)) > 8 else "")
        problems.append(f"{name}: {what}; holds data of {len(set(keys))} key(s): {shown}")


def _check_readable(source: Source, problems: list[str]) -> None:
    """Load every entry, a bounded batch at a time; on failure, retry one by one to name keys."""
    if problems:
        return  # already damaged: loading would only repeat the file errors above
    budget = max(source.largest_tensor_bytes(), 64 << 20)
    for group in batches(source, list(source.entries), budget):
        try:
            source.read(group)
        except UnsafeCheckpointError:
            raise
        except Exception:
            for key in group:
                try:
                    source.read([key])
                except UnsafeCheckpointError:
                    raise
                except Exception as error:
                    problems.append(f"{key}: unreadable ({type(error).__name__}: {_short(error)})")


def _short(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[-1][:200] if text else ""
