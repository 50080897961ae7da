"""Collective timeouts over a run: long while starting up, short once every rank is past
start-up (after step 1, or after the first validation, whose eval-mode forward compiles
again), and long again around the final save and Hugging Face export, which can take
minutes while some ranks wait in a collective. One process, the real loop."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from titan_dims import init_distributed
from titan_train import JobConfig, World, build, close, preflight, train
from titan_train.trainer import loop as trainer_module
from titan_train.trainer.loop import fail_fast_step


def job(tmp_path, steps: int, validation_freq: int | None) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.training.steps, config.training.seq_len, config.training.local_batch_size = steps, 32, 2
    config.lr_scheduler.warmup_steps = 1
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    config.comm.init_timeout_seconds, config.comm.train_timeout_seconds = 300, 100
    if validation_freq is not None:
        config.validation.enable = True
        config.validation.freq = validation_freq
        config.validation.steps = 1
        config.validation.seq_len, config.validation.local_batch_size = 32, 2
    return config


@pytest.mark.parametrize(
    ("steps", "validation_freq", "expected"),
    [(4, None, 1), (4, 2, 2), (3, 10, 3), (1, None, 1)],
)
def test_fail_fast_starts_after_step_1_or_the_first_validation(
    tmp_path, steps, validation_freq, expected
):
    assert fail_fast_step(job(tmp_path, steps, validation_freq)) == expected


@pytest.mark.parametrize(
    ("validation_freq", "expected"),
    [(None, [(100, 1), (300, 4)]), (2, [(100, 2), (300, 4)])],
)
def test_timeouts_over_a_run(tmp_path, monkeypatch, validation_freq, expected):
    """(timeout seconds, step just trained) of each change."""
    seen: list[tuple[int, int]] = []
    holder = {}
    real = trainer_module.set_collective_timeout

    def record(timeout, groups=None):
        seen.append((int(timeout.total_seconds()), holder["run"].train_state.step))
        real(timeout, groups)

    monkeypatch.setattr(trainer_module, "set_collective_timeout", record)
    config = job(tmp_path, 4, validation_freq)
    device = init_distributed()
    try:
        holder["run"] = run = build(config, preflight(config, World.current(device)))
        try:
            train(run)
        finally:
            close(run)
    finally:
        dist.destroy_process_group()
    assert seen == expected  # short after start-up, long again for the final save
