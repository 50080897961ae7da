"""Device memory for the metrics: on an accelerator the caching allocator's peaks since the
last report (reserved: ``memory_gib``; allocated; active) and the run's allocation retries
(fragmentation) and OOMs, as torchtitan's memory monitor; on the CPU the resident set size.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from types import ModuleType

import torch

__all__ = ["MEMORY_KEYS", "accelerator_memory", "device_memory", "memory_metrics"]

_GIB = 2**30

MEMORY_KEYS = {
    "memory_gib": "reserved_bytes.all.peak",
    "memory_allocated_gib": "allocated_bytes.all.peak",
    "memory_active_gib": "active_bytes.all.peak",
    "memory_alloc_retries": "num_alloc_retries",
    "memory_ooms": "num_ooms",
}
"""Record key -> the ``memory_stats()`` entry it reports (``*_gib`` in GiB, else counts)."""


def accelerator_memory(device: torch.device | str | None) -> ModuleType | None:
    """torch's module for ``device`` (``torch.cuda``, ``torch.xpu``, ...) when its allocator
    reports statistics; ``None`` on CPU or a device without them."""
    device = torch.device(device if device is not None else "cpu")
    if device.type in ("cpu", "meta"):
        return None
    try:
        module = torch.get_device_module(device.type)
    except RuntimeError:  # a device type without a torch module
        return None
    needed = ("memory_stats", "reset_peak_memory_stats", "is_available")
    if not all(hasattr(module, name) for name in needed) or not module.is_available():
        return None
    return module


def memory_metrics(stats: Mapping[str, int | float]) -> dict[str, float]:
    """The record's memory numbers from an allocator's ``memory_stats()`` (missing entries
    count 0)."""
    return {
        key: float(stats.get(entry, 0)) / (_GIB if key.endswith("_gib") else 1)
        for key, entry in MEMORY_KEYS.items()
    }


def device_memory(device: torch.device | str | None = None) -> tuple[dict[str, float], str]:
    """(numbers, what ``memory_gib`` measured): every ``MEMORY_KEYS`` entry on an accelerator,
    its peaks reset for the next report; else ``{"memory_gib": resident set size}``."""
    device = torch.device(device if device is not None else "cpu")
    module = accelerator_memory(device)
    if module is not None:
        numbers = memory_metrics(module.memory_stats(device))
        module.reset_peak_memory_stats(device)
        return numbers, "reserved"
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return {"memory_gib": resident_pages * os.sysconf("SC_PAGE_SIZE") / _GIB}, "RSS"
    except (OSError, ValueError, IndexError):  # not Linux: peak RSS in KiB (bytes on macOS)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {"memory_gib": peak / (_GIB if os.uname().sysname == "Darwin" else 2**20)}, (
            "peak RSS"
        )
