"""Peak FLOP/s of one device, the denominator of MFU.

GPUs: a table of bf16 dense tensor-core peaks (vendor datasheets) matched on the device
name. CPUs: fp32 matmul throughput, measured once per process. Either may read low (a busy
host, another variant's row): MFU then raises its peak to the rate training reached.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

__all__ = [
    "GPU_PEAK_BF16_FLOPS",
    "gpu_peak_flops",
    "measure_cpu_matmul_flops",
    "peak_flops",
    "peak_source",
]

logger = logging.getLogger(__name__)

GPU_PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GB200",), 2.5e15),
    (("B200",), 2.25e15),
    (("H200", "NVL"), 835e12),
    (("H200",), 989e12),  # SXM
    (("H100", "NVL"), 835e12),
    (("H100", "PCIe"), 756e12),
    (("H100",), 989e12),  # SXM, e.g. "NVIDIA H100 80GB HBM3"
    (("H800", "PCIe"), 756e12),
    (("H800",), 989e12),  # SXM: H100's compute
    (("H20",), 148e12),
    (("A100",), 312e12),
    (("A800",), 312e12),
    (("L40S",), 362e12),
    (("L40",), 181e12),
    (("L4",), 121e12),
    (("A10G",), 70e12),
    (("A10",), 125e12),  # after A100 and A10G, whose names contain it
    (("MI355X",), 2.5e15),
    (("MI300X",), 1307e12),
    (("MI325X",), 1307e12),
    (("MI250X",), 383e12),
)
"""(substrings of the device name, bf16 dense FLOP/s); the first row whose substrings all
occur in the name wins, so more specific rows come first."""


def gpu_peak_flops(device_name: str) -> float | None:
    """bf16 dense peak of a GPU by its name, or ``None`` if the table lacks it."""
    for parts, flops in GPU_PEAK_BF16_FLOPS:
        if all(part in device_name for part in parts):
            return flops
    return None


@functools.cache
def measure_cpu_matmul_flops(seconds: float = 0.5, size: int = 2048) -> float:
    """fp32 matmul FLOP/s of this process's CPU threads, measured once: the best (a shared
    machine only slows a product down) of repeated products over about ``seconds``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)  # warm-up: thread pool and caches
    best, runs = 0.0, 0
    deadline = time.perf_counter() + seconds
    while runs < 2 or time.perf_counter() < deadline:
        started = time.perf_counter()
        torch.mm(a, b, out=out)
        elapsed = time.perf_counter() - started
        best = max(best, 2 * size**3 / max(elapsed, 1e-9))
        runs += 1
    return best


def peak_source(device: torch.device | str | None = None) -> str:
    """Where ``peak_flops(device)`` comes from, for the log line that states it."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cpu":
        return "measured: the best fp32 matmul of this CPU's threads at start"
    if device.type == "cuda" and torch.cuda.is_available():
        return f"known: the bf16 dense peak of {torch.cuda.get_device_name(device)}"
    return "unknown"


def peak_flops(device: torch.device | str | None = None) -> float | None:
    """Peak FLOP/s of ``device`` (default: CPU): the table for GPUs, the probe for CPU;
    ``None`` for a GPU the table lacks (set ``metrics.peak_flops`` then)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cpu":
        return measure_cpu_matmul_flops()
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device)
        flops = gpu_peak_flops(name)
        if flops is None:
            logger.warning("peak FLOP/s of %r unknown; set metrics.peak_flops for MFU", name)
        return flops
    return None
