"""Peak FLOP/s: the GPU table by device name (datasheet bf16 dense numbers) and the CPU
matmul probe (positive, short, measured once per process)."""

from __future__ import annotations

import time

import pytest

from titan_train.metrics import gpu_peak_flops, measure_cpu_matmul_flops, peak_flops


@pytest.mark.parametrize(
    ("name", "flops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA H800", 989e12),
        ("NVIDIA H800 PCIe", 756e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GeForce GTX 1080", None),
    ],
)
def test_gpu_table(name, flops):
    assert gpu_peak_flops(name) == flops


def test_cpu_probe_is_short_and_cached():
    started = time.perf_counter()
    first = peak_flops("cpu")
    elapsed = time.perf_counter() - started
    assert 1e9 < first < 1e14  # between 1 GFLOP/s and 100 TFLOP/s of fp32
    assert elapsed < 5  # ~0.5 s unloaded; generous for a shared machine
    started = time.perf_counter()
    assert measure_cpu_matmul_flops() == first
    assert time.perf_counter() - started < 0.01
