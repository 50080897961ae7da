"""``titan-ckpt diff``: how two checkpoints differ, key by key, in any pair of formats.

Equal when every key is on both sides with the same shape and dtype and ``|a - b| <= atol +
rtol * |b|`` everywhere (NaN equals NaN; the default 0, 0 is bit-for-bit). Tensors are read a
bounded batch at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_ckpt.commands import open_source
from titan_ckpt.errors import CheckpointConfigError
from titan_ckpt.formats.base import Source, batches, dtype_name, select_keys

__all__ = ["diff_paths", "render_diff"]


def diff_paths(
    a: str,
    b: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    trust_pickles: bool = False,
) -> dict[str, Any]:
    """The diff report: ``equal`` plus the keys that differ and how (``trust_pickles``: see
    ``open_source``)."""
    if atol < 0 or rtol < 0:
        raise CheckpointConfigError("--atol and --rtol must be >= 0.")
    left = open_source(a, trust_pickles=trust_pickles)
    right = open_source(b, trust_pickles=trust_pickles)
    return _diff(left, right, atol, rtol, include or [], exclude or [])


def _diff(
    left: Source, right: Source, atol: float, rtol: float, include: list[str], exclude: list[str]
) -> dict[str, Any]:
    lk = select_keys(left.entries, include, exclude)
    rk = set(select_keys(right.entries, include, exclude))
    if include and not lk and not rk:
        # Else "equal, 0 tensors compared": a filter typo would pass for a clean diff.
        sample = ", ".join(repr(k) for k in list(left.entries)[:3])
        raise CheckpointConfigError(
            f"--include {' '.join(include)} matches no key of either checkpoint; keys look "
            f"like {sample}. Use globs on those names (e.g. 'layers.*'), or --exclude."
        )
    only_a = [k for k in lk if k not in rk]
    only_b = sorted(rk - set(lk))
    common = [k for k in lk if k in rk]
    changed: list[dict[str, Any]] = []
    kind: list[dict[str, Any]] = []
    tensors: list[str] = []
    objects: list[str] = []
    for key in common:
        ea, eb = left.entries[key], right.entries[key]
        if (ea.is_tensor, ea.shape, ea.dtype) != (eb.is_tensor, eb.shape, eb.dtype):
            kind.append({"key": key, "a": _describe(ea), "b": _describe(eb)})
        elif ea.is_tensor:
            tensors.append(key)
        else:
            objects.append(key)
    compared = 0
    budget = max(left.largest_tensor_bytes(), right.largest_tensor_bytes(), 1)
    for group in batches(left, tensors, budget):
        va, vb = left.read(group), right.read(group)
        for key in group:
            row = _compare(va.pop(key), vb.pop(key), atol, rtol)
            compared += 1
            if not row["equal"]:
                changed.append({"key": key, **row})
    if objects:
        va, vb = left.read(objects), right.read(objects)
        for key in objects:
            if not _same_object(va[key], vb[key]):
                changed.append({"key": key, "equal": False, "a": repr(va[key])[:200],
                                "b": repr(vb[key])[:200]})  # fmt: skip
    return {
        "a": left.path,
        "b": right.path,
        "atol": atol,
        "rtol": rtol,
        "equal": not (only_a or only_b or kind or changed),
        "compared": {"tensors": compared, "objects": len(objects)},
        "only_in_a": only_a,
        "only_in_b": only_b,
        "shape_or_dtype": kind,
        "different": changed,
    }


def _describe(e: Any) -> str:
    if not e.is_tensor:
        return "non-tensor"
    return f"{list(e.shape)} {dtype_name(e.dtype)}"


def _same_object(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return repr(a) == repr(b)


def _compare(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> dict[str, Any]:
    if atol == 0 and rtol == 0:
        # Bit-for-bit: compare the raw bytes, so NaN payloads and -0.0 count too.
        same = torch.equal(_bytes(a), _bytes(b))
        if same:
            return {"equal": True, "max_abs": 0.0, "max_rel": 0.0}
    x, y = a.double(), b.double()
    both_nan = torch.isnan(x) & torch.isnan(y)
    delta = (x - y).abs().masked_fill(both_nan, 0.0)
    delta = torch.where(x == y, torch.zeros_like(delta), delta)  # equal infinities
    rel = delta / y.abs().clamp_min(torch.finfo(torch.float64).tiny)
    bad = delta > atol + rtol * y.abs()
    bad |= torch.isnan(delta)
    max_abs = float(delta.max()) if delta.numel() else 0.0
    max_rel = float(rel.max()) if rel.numel() else 0.0
    equal = not bool(bad.any()) and not (atol == 0 and rtol == 0)
    return {"equal": equal, "max_abs": max_abs, "max_rel": max_rel, "mismatched": int(bad.sum())}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def render_diff(report: dict[str, Any], *, limit: int = 50) -> str:
    """The text form of a diff report."""
    lines = [f"a: {report['a']}", f"b: {report['b']}"]
    for side in ("a", "b"):
        keys = report[f"only_in_{side}"]
        if keys:
            lines.append(f"only in {side} ({len(keys)}):")
            lines += [f"  {k}" for k in keys[:limit]] + (["  ..."] if len(keys) > limit else [])
    if report["shape_or_dtype"]:
        lines.append(f"shape or dtype differs ({len(report['shape_or_dtype'])}):")
        lines += [f"  {r['key']}: {r['a']} -> {r['b']}" for r in report["shape_or_dtype"][:limit]]
    if report["different"]:
        lines.append(f"values differ ({len(report['different'])}):")
        for r in report["different"][:limit]:
            if "max_abs" in r:
                lines.append(
                    f"  {r['key']}: max abs {r['max_abs']:.3g}, max rel {r['max_rel']:.3g}, "
                    f"{r['mismatched']} element(s) outside tolerance"
                )
            else:
                lines.append(f"  {r['key']}: {r['a']} -> {r['b']}")
    c = report["compared"]
    verdict = "equal" if report["equal"] else "DIFFERENT"
    tol = f"atol={report['atol']:g}, rtol={report['rtol']:g}"
    lines.append(
        f"{verdict} ({tol}; compared {c['tensors']} tensors and {c['objects']} other values)"
    )
    return "\n".join(lines)
