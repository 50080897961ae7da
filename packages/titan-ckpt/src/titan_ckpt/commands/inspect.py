"""``titan-ckpt inspect``: what a checkpoint holds, from its metadata alone: a folder's steps
(committed?, size, age), or a checkpoint's keys with shape, dtype, bytes (and DCP shards),
grouped by state. ``--stats`` loads tensors a bounded batch at a time for min/max/mean/std.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from titan_ckpt.commands import detect, open_source
from titan_ckpt.formats.base import (
    STATE_GROUPS,
    Entry,
    Source,
    batches,
    dtype_name,
    group_of,
)
from titan_ckpt.layout import (
    UNREADABLE_MARKER_MEANS,
    marker_problem,
    read_manifest,
    scan_steps,
    step_dir,
)
from titan_ckpt.storage import LocalStorage

__all__ = ["inspect_path", "render"]

_OBJECT_REPR_LIMIT = 200


def inspect_path(path: str, *, stats: bool = False, trust_pickles: bool = False) -> dict[str, Any]:
    """The inspect report of ``path`` as a JSON-able dict (``trust_pickles``: see
    ``open_source``)."""
    if detect(path) == "folder":
        return _inspect_folder(path)
    return _inspect_source(open_source(path, trust_pickles=trust_pickles), stats=stats)


def _dir_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def _inspect_folder(path: str) -> dict[str, Any]:
    storage = LocalStorage()
    scan = scan_steps(storage, path)
    steps = []
    now = time.time()
    kinds = {s: "committed" for s in scan.committed}
    kinds |= {s: "interrupted" for s in scan.uncommitted}
    kinds |= {s: "torchtitan" for s in scan.torchtitan}
    kinds |= {s: "foreign" for s in scan.foreign}
    for step, kind in sorted(kinds.items()):
        directory = step_dir(storage, path, step)
        manifest = read_manifest(storage, directory)
        mtime = os.path.getmtime(directory)
        steps.append(
            {
                "step": step,
                "path": directory,
                "committed": manifest is not None,
                "kind": kind,
                "bytes": _dir_size(directory),
                "age_seconds": round(now - (manifest.created if manifest else mtime), 1),
                "world_size": manifest.world_size if manifest else None,
                "states": manifest.states if manifest else None,
                "model_only": manifest.model_only if manifest else None,
                "marker_problem": None if manifest else marker_problem(storage, directory),
            }
        )
    return {"path": path, "format": "folder", "steps": steps}


def _inspect_source(source: Source, *, stats: bool) -> dict[str, Any]:
    report: dict[str, Any] = {"path": source.path, "format": source.format}
    if source.format == "dcp":
        report["manifest"] = _manifest_summary(source.path)
        if report["manifest"] is None:
            report["marker_problem"] = marker_problem(LocalStorage(), source.path)
    if source.info:
        report["info"] = source.info
    report["files"] = source.files()
    objects = [k for k, e in source.entries.items() if not e.is_tensor]
    values = source.read(objects) if objects else {}
    tensor_stats: dict[str, dict[str, Any]] = {}
    if stats:
        tensors = [k for k, e in source.entries.items() if e.is_tensor]
        budget = max(source.largest_tensor_bytes(), 1)
        for group in batches(source, tensors, budget):
            for key, t in source.read(group).items():
                tensor_stats[key] = tensor_statistics(t)
    groups: dict[str, dict[str, Any]] = {}
    for key, e in source.entries.items():
        g = groups.setdefault(group_of(key), {"tensors": [], "objects": [], "bytes": 0, "numel": 0})
        if e.is_tensor:
            g["tensors"].append(_tensor_row(source, key, e, tensor_stats))
            g["bytes"] += e.nbytes
            g["numel"] += e.numel
        else:
            text = repr(values.get(key))
            if len(text) > _OBJECT_REPR_LIMIT:
                text = text[: _OBJECT_REPR_LIMIT - 3] + "..."
            g["objects"].append({"key": key, "value": text})
    order = {name: i for i, name in enumerate(STATE_GROUPS)}
    report["groups"] = dict(sorted(groups.items(), key=lambda kv: order.get(kv[0], 99)))
    report["total"] = {
        "tensors": sum(len(g["tensors"]) for g in groups.values()),
        "objects": sum(len(g["objects"]) for g in groups.values()),
        "bytes": sum(g["bytes"] for g in groups.values()),
        "numel": sum(g["numel"] for g in groups.values()),
    }
    return report


def _manifest_summary(path: str) -> dict[str, Any] | None:
    manifest = read_manifest(LocalStorage(), path)
    if manifest is None:
        return None
    return {
        "step": manifest.step,
        "world_size": manifest.world_size,
        "states": manifest.states,
        "model_only": manifest.model_only,
        "created": manifest.created,
    }


def _tensor_row(
    source: Source, key: str, e: Entry, tensor_stats: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "key": key,
        "shape": list(e.shape or ()),
        "dtype": dtype_name(e.dtype) if e.dtype else None,
        "bytes": e.nbytes,
    }
    if source.format == "dcp":
        row["shards"] = len(e.shards)
        row["ranks"] = sorted({s["rank"] for s in e.shards if s["rank"] is not None})
        row["files"] = sorted({s["file"] for s in e.shards if s["file"]})
    if key in tensor_stats:
        row["stats"] = tensor_stats[key]
    return row


def tensor_statistics(t: torch.Tensor) -> dict[str, Any]:
    """min, max, mean, std over the finite values, and the NaN and Inf counts."""
    x = t.detach().reshape(-1)
    x = x.float() if x.is_floating_point() else x.to(torch.float64)
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    finite = x[torch.isfinite(x)] if nan or inf else x
    if finite.numel() == 0:
        return {"min": None, "max": None, "mean": None, "std": None, "nan": nan, "inf": inf}
    return {
        "min": float(finite.min()),
        "max": float(finite.max()),
        "mean": float(finite.double().mean()),
        "std": float(finite.double().std()) if finite.numel() > 1 else 0.0,
        "nan": nan,
        "inf": inf,
    }


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


_KIND_LABELS = {
    "committed": "committed",
    "interrupted": "UNCOMMITTED (interrupted or in progress)",
    "torchtitan": "torchtitan checkpoint (resumable; titan never modifies it)",
    "foreign": "FOREIGN (not titan's or torchtitan's: a run on this folder stops)",
}


def render(report: dict[str, Any]) -> str:
    """The text form of an inspect report."""
    if report["format"] == "folder":
        return _render_folder(report)
    head = f"{report['format']} checkpoint {report['path']}"
    lines = [head]
    manifest = report.get("manifest", "absent")
    if manifest is None and report.get("marker_problem"):
        lines.append(
            f"  titan commit marker UNREADABLE ({report['marker_problem']}): "
            f"{UNREADABLE_MARKER_MEANS} (titan-ckpt verify checks the files)"
        )
    elif manifest is None:
        lines.append("  no titan commit marker (a plain DCP checkpoint, e.g. torchtitan's)")
    elif manifest != "absent":
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(manifest["created"]))
        lines.append(
            f"  titan step {manifest['step']}, committed {when}, world size "
            f"{manifest['world_size']}{', model only' if manifest['model_only'] else ''}"
        )
    lines.append(f"  {len(report['files'])} data file(s): {', '.join(report['files'][:8])}")
    for name, g in report["groups"].items():
        lines.append("")
        lines.append(
            f"{name}: {len(g['tensors'])} tensors, {g['numel']:,} elements, "
            f"{human_bytes(g['bytes'])}"
            + (f", {len(g['objects'])} other values" if g["objects"] else "")
        )
        width = max((len(t["key"]) for t in g["tensors"]), default=0)
        for t in g["tensors"]:
            lines.append(_tensor_line(t, width))
        for o in g["objects"]:
            lines.append(f"  {o['key']} = {o['value']}")
    total = report["total"]
    lines.append("")
    lines.append(
        f"total: {total['tensors']} tensors, {total['numel']:,} elements, "
        f"{human_bytes(total['bytes'])}; {total['objects']} other values"
    )
    return "\n".join(lines)


def _render_folder(report: dict[str, Any]) -> str:
    lines = [f"checkpoint folder {report['path']}: {len(report['steps'])} step(s)"]
    for s in report["steps"]:
        state = _KIND_LABELS[s["kind"]]
        if s.get("marker_problem"):
            state = "UNCOMMITTED (commit marker unreadable: damaged, or torn by a crash)"
        extra = ""
        if s["committed"]:
            extra = f", world size {s['world_size']}, states {', '.join(s['states'])}"
        lines.append(
            f"  step-{s['step']:<10} {human_bytes(s['bytes']):>10}  {_age(s['age_seconds'])}"
            f"  {state}{extra}"
        )
    return "\n".join(lines)


def _tensor_line(t: dict[str, Any], width: int) -> str:
    shape = "[" + ", ".join(map(str, t["shape"])) + "]"
    line = f"  {t['key']:<{width}}  {shape:<16} {t['dtype']:<10} {human_bytes(t['bytes']):>10}"
    if "shards" in t:  # a DCP checkpoint's row
        ranks = ",".join(map(str, t["ranks"])) or "?"
        line += f"  {t['shards']} shard(s), rank(s) {ranks}"
    if "stats" in t:
        s = t["stats"]
        if s["min"] is None:
            line += f"  (no finite values; nan={s['nan']} inf={s['inf']})"
        else:
            line += (
                f"  min={s['min']:.4g} max={s['max']:.4g} mean={s['mean']:.4g} "
                f"std={s['std']:.4g} nan={s['nan']} inf={s['inf']}"
            )
    return line
