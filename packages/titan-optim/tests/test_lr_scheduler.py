"""Warmup-stable-decay schedules against torchtitan's definition, a hand-computed table,
clamping, and save / restore, also into a changed schedule.

Reference: torchtitan's ``linear_warmup_stable_decay`` (``components/lr_scheduler.py``),
re-derived below in its own terms (``stable = T + 1 - W - D``, a ``+ 1`` on the step in
warmup and decay) rather than in titan's, so a shift by one step cannot hide.

Table: 10 training steps, 2 warmup, decay_ratio 0.4 (4 decay steps, so 4 stable),
min_lr_factor 0.1. Steps 0..6 (0-based) run at 0.5 then 1; decay progress p = 0.25, 0.5,
0.75 on steps 7..9 and 1 from step 10 (past the end); the factor is 0.1 + 0.9 * curve(p):
linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
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

WARMUP_STABLE = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
TABLES = {
    "linear": [*WARMUP_STABLE, 0.775, 0.55, 0.325, 0.1, 0.1],
    "sqrt": [*WARMUP_STABLE, 0.55, 0.36360389693, 0.22057713659, 0.1, 0.1],
    "cosine": [*WARMUP_STABLE, 0.86819805153, 0.55, 0.23180194847, 0.1, 0.1],
}


def torchtitan_factor(
    step: int, *, steps: int, warmup: int, decay_ratio, decay_type: str, min_lr: float
) -> float:
    """torchtitan's lr factor of 0-based ``step``, in torchtitan's own formulation."""
    warmup = min(warmup, steps)
    decay = steps - warmup if decay_ratio is None else round(steps * decay_ratio)
    decay = min(decay, steps - warmup)
    stable = steps + 1 - warmup - decay  # its "virtual last step"
    if step < warmup:
        return (step + 1) / warmup
    if step < warmup + stable:
        return 1.0
    progress = (step + 1 - (warmup + stable)) / decay
    curve = {
        "linear": 1 - progress,
        "sqrt": 1 - math.sqrt(progress),
        "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
    }[decay_type]
    return min_lr + (1 - min_lr) * curve


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))


def lrs_used(schedulers, optimizers, steps: int) -> list[list[float]]:
    """The lr of every group at each of the next ``steps`` optimizer steps."""
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
    used = lrs_used(schedulers, optimizers, 12)  # two steps past the end of training
    assert [norm for norm, _ in used] == pytest.approx([0.5 * f for f in TABLES[decay_type]])
    assert [other for _, other in used] == pytest.approx(TABLES[decay_type])


@pytest.mark.parametrize(
    ("steps", "warmup", "decay_ratio", "decay_type", "min_lr"),
    list(
        itertools.product(
            [1, 2, 7, 10, 13],
            [0, 1, 3, 20],
            [None, 0.0, 0.3, 1.0],
            ["linear", "sqrt", "cosine"],
            [0.0, 0.1],
        )
    ),
)
def test_every_training_step_follows_torchtitan(steps, warmup, decay_ratio, decay_type, min_lr):
    config = LRSchedulerConfig(
        warmup_steps=warmup, decay_ratio=decay_ratio, decay_type=decay_type, min_lr_factor=min_lr
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # clamped lengths warn; torchtitan clamps alike
        schedule = WarmupStableDecay.from_config(config, training_steps=steps)
    # Every trained step and the step after the last (the lr a finished run leaves behind).
    expected = [
        torchtitan_factor(
            s,
            steps=steps,
            warmup=warmup,
            decay_ratio=decay_ratio,
            decay_type=decay_type,
            min_lr=min_lr,
        )
        for s in range(steps + 1)
    ]
    assert [schedule(s) for s in range(steps + 1)] == pytest.approx(expected, rel=1e-12)
    assert schedule.training_steps == steps


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_last_step_does_not_train_at_the_minimum(decay_type):
    schedule = WarmupStableDecay.from_config(
        LRSchedulerConfig(warmup_steps=2, decay_type=decay_type), training_steps=10
    )
    # 8 decay steps at progress 0/8 .. 7/8: the last step trains at curve(7/8) > 0, and the
    # minimum comes one step after the end.
    curve = {
        "linear": 1 / 8,
        "sqrt": 1 - math.sqrt(7 / 8),
        "cosine": (1 + math.cos(7 * math.pi / 8)) / 2,
    }
    assert schedule(9) == pytest.approx(curve[decay_type])
    assert schedule(9) > 0
    assert schedule(10) == 0.0
    assert schedule(2) == 1.0  # the first decay step is still at the peak
    assert schedule(50) == 0.0  # past the end: stays at the minimum


def test_no_decay_ratio_decays_over_everything_after_warmup():
    schedule = WarmupStableDecay.from_config(
        LRSchedulerConfig(warmup_steps=2, decay_type="linear"), training_steps=6
    )
    assert (schedule.stable_steps, schedule.decay_steps) == (0, 4)
    assert [schedule(s) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_zero_warmup_starts_at_peak():
    schedule = WarmupStableDecay.from_config(
        LRSchedulerConfig(warmup_steps=0, decay_ratio=0.5), training_steps=4
    )
    assert [schedule(s) for s in range(5)] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.0])


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
        (
            {"warmup_steps": -1},
            r"lr_scheduler.warmup_steps=-1 is not allowed; it must be a whole number >= 0",
        ),
        (
            {"warmup_steps": 2.5},
            r"lr_scheduler.warmup_steps=2.5 is not allowed; it must be a whole number",
        ),
        (
            {"decay_ratio": 1.5},
            r"lr_scheduler.decay_ratio=1.5 is not allowed; it must be a finite number in \[0, 1\]",
        ),
        (
            {"decay_type": "exp"},
            r"decay_type='exp' is not allowed; choose one of 'linear', 'sqrt', 'cosine'",
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


def train(net, optimizers, schedulers, steps: int) -> list[float]:
    """``steps`` AdamW steps on fixed data; the lr of each step."""
    lrs = []
    for _ in range(steps):
        lrs.append(optimizers.param_groups[0]["lr"])
        optimizers.zero_grad()
        net(torch.ones(3, 2)).square().sum().backward()
        optimizers.step()
        schedulers.step()
    return lrs


def fresh(sched: LRSchedulerConfig, steps: int):
    torch.manual_seed(0)
    net = model()
    optimizers = build_optimizers(net, OptimizerConfig(lr=0.1))
    return net, optimizers, build_lr_schedulers(optimizers, sched, training_steps=steps)


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_extended_run_resumes_on_the_new_schedule_bit_for_bit(tmp_path, optimizer_first):
    # Constant after warmup: 10 steps, then the same run extended to 20 from its saved
    # state must equal 20 uninterrupted steps. The finished 10-step schedule leaves its
    # step-10 lr in the optimizer's saved param groups; it must not be used.
    sched = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.0, min_lr_factor=0.0)
    net, optimizers, schedulers = fresh(sched, 10)
    train(net, optimizers, schedulers, 10)
    saved = copy.deepcopy(
        {
            "model": net.state_dict(),
            "optimizer": optimizers.state_dict(),
            "lr_scheduler": schedulers.state_dict(),
        }
    )

    resumed_net, resumed_opt, resumed_sched = fresh(sched, 20)
    train(resumed_net, resumed_opt, resumed_sched, 1)  # state to overwrite, as in a real run
    names = ["optimizer", "lr_scheduler"] if optimizer_first else ["lr_scheduler", "optimizer"]
    for name in names:  # either load order gives the schedule's lr
        {"optimizer": resumed_opt, "lr_scheduler": resumed_sched}[name].load_state_dict(saved[name])
    resumed_net.load_state_dict(saved["model"])
    assert resumed_sched.last_step == 10
    resumed_lrs = train(resumed_net, resumed_opt, resumed_sched, 10)

    ref_net, ref_opt, ref_sched = fresh(sched, 20)
    ref_lrs = train(ref_net, ref_opt, ref_sched, 20)
    assert resumed_lrs == ref_lrs[10:] == [0.1] * 10
    for got, want in zip(resumed_net.parameters(), ref_net.parameters(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_finished_decay_does_not_leak_into_the_extended_run(optimizer_first):
    # A 10-step run decays to 0 and saves lr 0 with its optimizer; extended to 20 steps,
    # step 11 must train at the 20-step schedule's lr for it, whatever the load order.
    sched = LRSchedulerConfig(warmup_steps=2, decay_type="linear")
    first, optimizers, schedulers = fresh(sched, 10)
    train(first, optimizers, schedulers, 10)
    assert optimizers.param_groups[0]["lr"] == 0.0
    saved = copy.deepcopy(
        {"optimizer": optimizers.state_dict(), "lr_scheduler": schedulers.state_dict()}
    )
    net, resumed_opt, resumed_sched = fresh(sched, 20)
    states = {"optimizer": resumed_opt, "lr_scheduler": resumed_sched}
    for name in sorted(states, reverse=optimizer_first):
        states[name].load_state_dict(saved[name])
    expected = [
        0.1
        * torchtitan_factor(s, steps=20, warmup=2, decay_ratio=None, decay_type="linear", min_lr=0)
        for s in range(10, 20)
    ]
    assert train(net, resumed_opt, resumed_sched, 10) == pytest.approx(expected, rel=1e-12)
    assert expected[0] == pytest.approx(0.1 * 10 / 18)


def test_dcp_load_of_optimizer_and_schedule_applies_the_new_schedule(tmp_path):
    # DCP loads the states in its own order; each step after the resume must follow the
    # *new* schedule (other length, warmup, decay type and floor) from the saved position.
    old = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.4, decay_type="cosine")
    net, optimizers, schedulers = fresh(old, 10)
    train(net, optimizers, schedulers, 8)  # saved lr: 0.1 x 0.5 (cosine halfway)
    dcp.save(
        {"optimizer": optimizers, "lr_scheduler": schedulers},
        checkpoint_id=str(tmp_path),
        no_dist=True,
    )
    new = LRSchedulerConfig(warmup_steps=4, decay_ratio=0.5, decay_type="linear", min_lr_factor=0.2)
    net, optimizers, schedulers = fresh(new, 20)
    train(net, optimizers, schedulers, 1)
    dcp.load(
        {"optimizer": optimizers, "lr_scheduler": schedulers},
        checkpoint_id=str(tmp_path),
        no_dist=True,
    )
    assert schedulers.state_dict() == {"step": 8}
    expected = [
        0.1
        * torchtitan_factor(s, steps=20, warmup=4, decay_ratio=0.5, decay_type="linear", min_lr=0.2)
        for s in range(8, 20)
    ]
    assert expected[0] == 0.1  # the new schedule is still at its peak there
    assert train(net, optimizers, schedulers, 12) == pytest.approx(expected, rel=1e-12)
    assert expected[-1] > 0.1 * 0.2  # the last step is above the floor


def test_torchtitan_last_epoch_key_loads_as_the_step():
    _, optimizers, schedulers = fresh(LRSchedulerConfig(warmup_steps=4), 10)
    schedulers.load_state_dict({"last_epoch": 2})
    assert schedulers.last_step == 2
    assert optimizers.param_groups[0]["lr"] == pytest.approx(0.1 * 3 / 4)
