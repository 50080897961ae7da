"""Profiler on CPU: Chrome traces (read back as JSON) at the end of each window of
``profile_freq`` steps, aligned to step numbers after a resume, none for a window cut short;
memory snapshots off CUDA only warn; impossible schedules are refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from titan_train.config import ConfigError
from titan_train.trainer.profiling import Profiler, ProfilingConfig


def _train(profiler, steps):
    a = torch.randn(64, 64)
    for _ in range(steps):
        (a @ a).sum()
        profiler.step()


def _trace_steps(folder):
    return sorted(int(p.name.split("_")[1]) for p in (folder / "profile_traces").iterdir())


def test_a_trace_per_window_that_parses_as_json(tmp_path):
    config = ProfilingConfig(enable_profiling=True, profile_freq=3, profiler_warmup=1)
    with Profiler(config, dump_folder=str(tmp_path), rank=2, device=torch.device("cpu")) as p:
        _train(p, 7)  # windows end at steps 3 and 6; step 7 starts one that never ends
    assert _trace_steps(tmp_path) == [3, 6]
    trace = json.loads(
        (tmp_path / "profile_traces" / "iteration_3" / "rank2_trace.json").read_text()
    )
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names


def test_windows_stay_aligned_after_a_resume(tmp_path):
    config = ProfilingConfig(enable_profiling=True, profile_freq=4, profiler_warmup=0)
    with Profiler(
        config, dump_folder=str(tmp_path), rank=0, device=torch.device("cpu"), step=5
    ) as p:
        _train(p, 7)  # steps 6..12
    assert _trace_steps(tmp_path) == [8, 12]


def test_off_writes_nothing_and_memory_snapshot_needs_an_accelerator(tmp_path, caplog):
    config = ProfilingConfig(enable_memory_snapshot=True, profile_freq=1, profiler_warmup=0)
    with (
        caplog.at_level(logging.WARNING, logger="titan_train"),
        Profiler(config, dump_folder=str(tmp_path), rank=0, device=torch.device("cpu")) as p,
    ):
        _train(p, 2)
    assert "enable_memory_snapshot needs an accelerator" in caplog.text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"profile_freq": 0}, "profiling.profile_freq=0"),
        ({"profiler_active": 0}, "profiling.profiler_active=0"),
        ({"profiler_warmup": -1}, "profiler_warmup=-1"),
        ({"profile_freq": 4, "profiler_warmup": 3, "profiler_active": 2}, "fit in profile_freq=4"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ProfilingConfig(**kwargs)
