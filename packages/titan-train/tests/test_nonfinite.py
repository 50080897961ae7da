"""The non-finite gradient-norm policy, on real components: a Linear model, titan-optim's
container and clipping, and a batch holding an inf, which makes the gradient norm inf.

A skipped step leaves the weights as they were; up to ``limit`` consecutive skips are
allowed, the next raises ``NonFiniteStepsError``; a finite step resets the run of skips.
"""

from __future__ import annotations

import pytest
import torch

from titan_optim import OptimizerConfig, build_optimizers
from titan_train.config import ConfigError, TrainingConfig
from titan_train.trainer.nonfinite import NonFiniteGuard, NonFiniteStepsError


def make():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, build_optimizers([model], OptimizerConfig(lr=0.1))


def step(model, optimizers, guard, number: int, *, poisoned: bool) -> float:
    x = torch.ones(3, 4)
    if poisoned:
        x[0, 0] = float("inf")  # the gradients of the first column become inf
    optimizers.zero_grad()
    model(x).pow(2).sum().backward()
    norm = float(optimizers.clip_grad_norm_(1.0))
    guard.observe(number, norm)  # raises past the limit, before the update
    optimizers.step()
    return norm


def test_skips_up_to_the_limit_then_stops_with_weights_finite(caplog):
    model, optimizers = make()
    guard = NonFiniteGuard(2)
    step(model, optimizers, guard, 1, poisoned=False)
    before = model.weight.detach().clone()
    for number in (2, 3):
        assert step(model, optimizers, guard, number, poisoned=True) == float("inf")
        assert torch.equal(model.weight, before)  # the update was skipped
    assert guard.skipped == 2
    assert guard.consecutive == 2
    assert sum("update skipped" in r.message for r in caplog.records) == 2
    with pytest.raises(NonFiniteStepsError, match=r"Step 4: the gradient norm is inf, the 3rd"):
        step(model, optimizers, guard, 4, poisoned=True)
    assert torch.equal(model.weight, before)
    assert torch.isfinite(model.weight).all()


def test_a_finite_step_resets_the_consecutive_count():
    model, optimizers = make()
    guard = NonFiniteGuard(1)
    step(model, optimizers, guard, 1, poisoned=True)
    before = model.weight.detach().clone()
    step(model, optimizers, guard, 2, poisoned=False)
    assert not torch.equal(model.weight, before)  # this one updated
    step(model, optimizers, guard, 3, poisoned=True)
    assert (guard.skipped, guard.consecutive) == (2, 1)


def test_zero_stops_at_the_first_nonfinite_step():
    model, optimizers = make()
    with pytest.raises(NonFiniteStepsError, match="skip_nonfinite_steps=0"):
        step(model, optimizers, NonFiniteGuard(0), 1, poisoned=True)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_config_refuses_bad_limits(value):
    with pytest.raises(ConfigError, match=r"training\.skip_nonfinite_steps"):
        TrainingConfig(skip_nonfinite_steps=value)


def test_a_device_tensor_norm_is_read_only_for_finiteness():
    guard = NonFiniteGuard(limit=1)
    assert not guard.observe(1, torch.tensor(3.0))
    assert guard.observe(2, torch.tensor(float("inf")))
    with pytest.raises(NonFiniteStepsError, match="gradient norm is nan"):
        guard.observe(3, torch.tensor(float("nan")))
