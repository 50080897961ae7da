"""Device memory in the metrics (issue 18, F24): on an accelerator the peaks of reserved,
allocated and active memory since the last report, allocation retries and OOM count, read
through torch's device module; on CPU the resident set size. The key mapping is checked
on CPU from an allocator's ``memory_stats()`` dict; the real allocator only where there is
an accelerator (skipped cleanly without one; ``tools/gpu_smoke.sh`` runs these tests)."""

from __future__ import annotations

import pytest
import torch

from titan_train.metrics import MetricsConfig, MetricsLogger, device_memory
from titan_train.metrics.memory import MEMORY_KEYS, accelerator_memory, memory_metrics

ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
needs_accelerator = pytest.mark.skipif(ACCELERATOR is None, reason="needs an accelerator")


def test_memory_metrics_from_allocator_stats():
    stats = {  # as torch.cuda.memory_stats() names them (a few of its many entries)
        "reserved_bytes.all.peak": 6 * 2**30,
        "allocated_bytes.all.peak": 3 * 2**30,
        "active_bytes.all.peak": 2**29,
        "allocated_bytes.all.current": 2**20,
        "num_alloc_retries": 7,
        "num_ooms": 1,
    }
    assert memory_metrics(stats) == {
        "memory_gib": 6.0,
        "memory_allocated_gib": 3.0,
        "memory_active_gib": 0.5,
        "memory_alloc_retries": 7.0,
        "memory_ooms": 1.0,
    }
    assert set(memory_metrics({})) == set(MEMORY_KEYS)  # absent entries count 0


def test_cpu_reports_resident_memory_only(tmp_path):
    assert accelerator_memory("cpu") is None
    numbers, kind = device_memory("cpu")
    assert kind == "RSS"
    assert set(numbers) == {"memory_gib"}
    config = MetricsConfig(enable_tensorboard=False, enable_jsonl=False)
    with MetricsLogger(config, dump_folder=tmp_path, device="cpu") as metrics:
        record = metrics.log(step=1, loss=1.0, tokens=10, step_seconds=1.0)
    assert record["memory_gib"] > 0
    assert not (set(MEMORY_KEYS) - {"memory_gib"}) & set(record)


@needs_accelerator
def test_accelerator_memory_peaks_retries_and_ooms(tmp_path):
    device = torch.device(ACCELERATOR.type, torch.accelerator.current_device_index())
    module = accelerator_memory(device)
    assert module is torch.get_device_module(device.type)
    device_memory(device)  # reset the peaks
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    del block  # gone, but the peak since the last reset holds it
    config = MetricsConfig(enable_tensorboard=False, enable_jsonl=False)
    with MetricsLogger(config, dump_folder=tmp_path, device=device) as metrics:
        record = metrics.log(step=1, loss=1.0, tokens=10, step_seconds=1.0)
        assert set(MEMORY_KEYS) <= set(record)
        assert record["memory_allocated_gib"] >= 0.25
        assert record["memory_gib"] >= record["memory_allocated_gib"]
        ooms = record["memory_ooms"]
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**50, dtype=torch.uint8, device=device)  # a petabyte
        record = metrics.log(step=2, loss=1.0, tokens=10, step_seconds=1.0)
    assert record["memory_ooms"] == ooms + 1
    assert record["memory_allocated_gib"] < 0.25  # the peak was reset after step 1
    assert record["memory_alloc_retries"] >= 0
