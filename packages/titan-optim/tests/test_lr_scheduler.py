"""Warmup-stable-decay schedules against hand-computed tables, clamping, and save / restore.

Tables: 10 training steps, 2 warmup, decay_ratio 0.4 (4 decay steps, so 4 stable),
min_lr_factor 0.1. Decay progress p = 0.25, 0.5, 0.75, 1 on steps 6..9, and the factor is
0.1 + 0.9 * curve(p): linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2.
"""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from titan_optim import (
    LRSchedulerConfig,
    OptimizerConfig,
    OptimizerConfigError,
    ParamGroupRule,
    WarmupStableDecay,
    build_lr_schedulers,
    build_optimizers,
)

WARMUP_STABLE = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
TABLES = {
    "linear": [*WARMUP_STABLE, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1],
    "sqrt": [*WARMUP_STABLE, 0.55, 0.36360389693, 0.22057713659, 0.1, 0.1, 0.1],
    "cosine": [*WARMUP_STABLE, 0.86819805153, 0.55, 0.23180194847, 0.1, 0.1, 0.1],
}


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))


def lrs_used(schedulers, optimizers, steps: int) -> list[list[float]]:
    """The lr of every group at each optimizer step (two steps past the end of training)."""
    used = []
    for _ in range(steps):
        used.append([g["lr"] for g in optimizers.param_groups])
        optimizers.step()
        schedulers.step()
    return used


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_schedule_matches_hand_computed_table(decay_type):
    config = OptimizerConfig(lr=1.0, param_group_rules=[ParamGroupRule(pattern="1.*", lr=0.5)])
    optimizers = build_optimizers(model(), config)
    sched = LRSchedulerConfig(
        warmup_steps=2, decay_ratio=0.4, decay_type=decay_type, min_lr_factor=0.1
    )
    schedulers = build_lr_schedulers(optimizers, sched, training_steps=10)
    used = lrs_used(schedulers, optimizers, 12)
    assert [norm for norm, _ in used] == pytest.approx([0.5 * f for f in TABLES[decay_type]])
    assert [other for _, other in used] == pytest.approx(TABLES[decay_type])


def test_no_decay_ratio_decays_over_everything_after_warmup():
    schedule = WarmupStableDecay.from_config(
        LRSchedulerConfig(warmup_steps=2, decay_type="linear"), training_steps=6
    )
    assert (schedule.stable_steps, schedule.decay_steps) == (0, 4)
    assert [schedule(s) for s in range(6)] == pytest.approx([0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_zero_warmup_starts_at_peak():
    schedule = WarmupStableDecay.from_config(
        LRSchedulerConfig(warmup_steps=0, decay_ratio=0.5), training_steps=4
    )
    assert [schedule(s) for s in range(4)] == pytest.approx([1.0, 1.0, 0.5, 0.0])


def test_warmup_longer_than_training_clamps_with_one_warning():
    with pytest.warns(UserWarning, match="longer than training") as record:
        schedule = WarmupStableDecay.from_config(
            LRSchedulerConfig(warmup_steps=20, decay_ratio=0.5), training_steps=10
        )
    assert len(record) == 1
    message = str(record[0].message)
    assert "warmup_steps=20 is longer than training.steps=10" in message
    assert "warmup (10) + decay" in message
    assert (schedule.warmup_steps, schedule.stable_steps, schedule.decay_steps) == (10, 0, 0)
    assert schedule(9) == 1.0


def test_warmup_plus_decay_longer_than_training_clamps_with_one_warning():
    with pytest.warns(UserWarning, match=r"decay_ratio=0.8 x 10 = 8\) is longer") as record:
        schedule = WarmupStableDecay.from_config(
            LRSchedulerConfig(warmup_steps=4, decay_ratio=0.8), training_steps=10
        )
    assert len(record) == 1
    assert (schedule.warmup_steps, schedule.stable_steps, schedule.decay_steps) == (4, 0, 6)


def test_sound_settings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        WarmupStableDecay.from_config(LRSchedulerConfig(warmup_steps=2), training_steps=10)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_steps": -1}, r"lr_scheduler.warmup_steps=-1 is not allowed; it must be >= 0"),
        ({"warmup_steps": 2.5}, r"lr_scheduler.warmup_steps=2.5 must be a whole number"),
        (
            {"decay_ratio": 1.5},
            r"lr_scheduler.decay_ratio=1.5 is not allowed; it must be in \[0, 1\]",
        ),
        (
            {"decay_type": "exp"},
            r"decay_type='exp' is not known; choose one of 'linear', 'sqrt', 'cosine'",
        ),
        ({"min_lr_factor": -0.1}, r"lr_scheduler.min_lr_factor=-0.1 is not allowed"),
    ],
)
def test_bad_schedule_settings_raise(kwargs, match):
    with pytest.raises(OptimizerConfigError, match=match):
        LRSchedulerConfig(**kwargs)


def test_training_steps_must_be_positive():
    with pytest.raises(OptimizerConfigError, match=r"training.steps=0 is not allowed"):
        build_lr_schedulers(build_optimizers(model()), training_steps=0)


def test_state_restores_into_another_layout():
    sched = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.4, decay_type="cosine")
    optimizers = build_optimizers(model(), OptimizerConfig(lr=1.0))
    schedulers = build_lr_schedulers(optimizers, sched, training_steps=10)
    lrs_used(schedulers, optimizers, 7)
    state = schedulers.state_dict()
    assert state == {"step": 7}
    expected = lrs_used(schedulers, optimizers, 3)

    # Two pipeline parts now, so two optimizers and two schedulers.
    m = model()
    parts = [m[0], m[1]]
    resumed_opt = build_optimizers(parts, OptimizerConfig(lr=1.0))
    resumed = build_lr_schedulers(resumed_opt, sched, training_steps=10)
    resumed.load_state_dict(state)
    assert resumed.last_step == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler stepped before optimizer" warning
        got = lrs_used(resumed, resumed_opt, 3)
    assert [g[0] for g in got] == pytest.approx([e[0] for e in expected])
    assert [g[1] for g in got] == pytest.approx([e[0] for e in expected])
