"""Tokens of a step and throughput per device: ``tokens_of_step`` over parallel layouts,
and the tokens/s, TFLOPs and MFU that ``MetricsLogger`` derives from them.

Checked against torchtitan's definition: each rank's local tokens divided by
``cp * tp * pp`` (``components/metrics.py``: ``ntokens / (time * non_data_parallel_size)``).
"""

from __future__ import annotations

import json

import pytest

from titan_dims import ParallelDims
from titan_train.metrics import MetricsConfig, MetricsLogger, StepTokens, tokens_of_step

LOCAL = 4 * 64  # a local batch of 4 sequences of 64 tokens


@pytest.mark.parametrize(
    "degrees",
    [
        {},
        {"dp_shard": 2},
        {"dp_shard": 1, "tp": 2},
        {"dp_shard": 1, "cp": 2},
        {"dp_shard": 1, "pp": 2},
        {"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2, "pp": 2},
    ],
)
@pytest.mark.parametrize("replica_groups", [1, 3])
def test_tokens_per_device_is_torchtitans(degrees, replica_groups):
    world = 1
    for degree in degrees.values():
        world *= degree
    dims = ParallelDims(world_size=world, **degrees)
    step = tokens_of_step(LOCAL, dims, replica_groups)
    dp = degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    assert step.global_tokens == LOCAL * dp * replica_groups
    assert step.devices == world * replica_groups
    non_dp = degrees.get("cp", 1) * degrees.get("tp", 1) * degrees.get("pp", 1)
    assert step.per_device == LOCAL / non_dp  # torchtitan: local tokens / (cp x tp x pp)


def test_tensor_parallel_ranks_share_the_batch():
    # 2 TP ranks each load the same 256 tokens: 256 tokens of work over 2 devices.
    step = tokens_of_step(LOCAL, ParallelDims(world_size=2, dp_shard=1, tp=2))
    assert step == StepTokens(global_tokens=256, devices=2)
    assert step.per_device == 128


def test_no_participants_counts_this_group():
    step = tokens_of_step(LOCAL, ParallelDims(world_size=2, dp_shard=2), replica_groups=0)
    assert step == StepTokens(global_tokens=512, devices=2)


def test_logger_divides_by_devices(tmp_path):
    config = MetricsConfig(log_freq=2, peak_flops=1e12, enable_tensorboard=False)
    with MetricsLogger(config, dump_folder=tmp_path, flops_per_token=6e6, total_steps=4) as metrics:
        for step, seconds in enumerate([0.5, 0.25, 1.0, 1.0], start=1):
            metrics.log(step=step, loss=1.0, tokens=1024, devices=4, step_seconds=seconds)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 4]
    # Step 1: 1024 tokens over 4 devices in 0.5 s; steps 3-4: 2048 tokens over 4 in 2 s.
    assert [r["tps"] for r in lines] == [512.0, 1024.0, 256.0]
    assert [r["global_tokens"] for r in lines] == [1024, 1024, 1024]
    assert [r["devices"] for r in lines] == [4, 4, 4]
    assert [r["step_s"] for r in lines] == [0.5, 0.25, 1.0]
    for r in lines:
        assert r["tps"] * r["devices"] == r["global_tokens"] / r["step_s"]
        assert r["mfu_pct"] == pytest.approx(100 * 6e6 * r["tps"] / 1e12)
        assert r["tflops"] == pytest.approx(6e6 * r["tps"] / 1e12)
