"""Optimizer-in-backward: the same numbers as stepping after backward, and clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from titan_optim import (
    OptimizerConfig,
    OptimizerInBackwardError,
    OptimizersInBackwardContainer,
    ParamGroupRule,
    build_optimizers,
)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return nn.functional.mse_loss(
        model(torch.randn(5, 4, generator=g)), torch.randn(5, 2, generator=g)
    )


def test_steps_in_backward_like_an_ordinary_step():
    rules = [ParamGroupRule(pattern="1.*", weight_decay=0.0, lr=0.01)]
    model, ref_model = make_model(), make_model()
    ours = build_optimizers(
        model, OptimizerConfig(lr=0.05, early_step_in_backward=True, param_group_rules=rules)
    )
    ref = build_optimizers(ref_model, OptimizerConfig(lr=0.05, param_group_rules=rules))
    assert isinstance(ours, OptimizersInBackwardContainer)
    assert len(ours) == 6  # one optimizer per parameter
    for step in range(3):
        ours.zero_grad()
        loss_of(model, step).backward()
        assert all(p.grad is None for p in model.parameters())  # consumed during backward
        ours.step()
        ref.zero_grad()
        loss_of(ref_model, step).backward()
        ref.step()
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p, q)


def test_pre_hooks_run_before_the_first_update_in_backward_and_once_per_step():
    model = make_model()
    ours = build_optimizers(model, OptimizerConfig(lr=0.05, early_step_in_backward=True))
    weights = list(model.parameters())
    seen = []
    ours.register_step_pre_hook(lambda o: seen.append(("pre", [w.clone() for w in weights])))
    ours.register_step_post_hook(lambda o: seen.append(("post", [w.clone() for w in weights])))
    for step in range(2):
        before = [w.detach().clone() for w in weights]
        loss_of(model, step).backward()  # every parameter steps in here
        assert [tag for tag, _ in seen] == ["pre", "post"] * step + ["pre"]
        assert all(torch.equal(a, b) for a, b in zip(seen[-1][1], before, strict=True))
        ours.step()  # runs the post hooks, not the pre hooks again
        assert [tag for tag, _ in seen] == ["pre", "post"] * (step + 1)
        assert not any(torch.equal(a, b) for a, b in zip(seen[-1][1], before, strict=True))
    ours.step()  # no backward in between: nothing stepped, so the pre hooks run here
    assert [tag for tag, _ in seen] == ["pre", "post"] * 3


def test_state_dict_round_trip_uses_fqn_keys():
    model = make_model()
    ours = build_optimizers(model, OptimizerConfig(early_step_in_backward=True))
    loss_of(model, 0).backward()
    sd = ours.state_dict()
    assert "state.2.weight.exp_avg" in sd
    twin = copy.deepcopy(model)
    other = build_optimizers(twin, OptimizerConfig(early_step_in_backward=True))
    other.load_state_dict(copy.deepcopy(sd))
    loss_of(model, 1).backward()
    loss_of(twin, 1).backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def test_clipping_is_refused():
    model = make_model()
    ours = build_optimizers(model, OptimizerConfig(early_step_in_backward=True))
    loss_of(model, 0).backward()
    with pytest.raises(OptimizerInBackwardError, match=r"Gradient clipping cannot be used"):
        ours.clip_grad_norm_(1.0)


@pytest.mark.parametrize("pipeline_parallel", [True, False])
def test_pipeline_parallel_is_refused(pipeline_parallel):
    m = make_model()
    parts = [m] if pipeline_parallel else [m[0], m[2]]
    with pytest.raises(OptimizerInBackwardError, match=r"cannot be used with pipeline parallelism"):
        build_optimizers(
            parts,
            OptimizerConfig(early_step_in_backward=True),
            pipeline_parallel=pipeline_parallel,
        )


def test_gradients_that_bypass_the_hook_are_reported():
    model = make_model()
    ours = build_optimizers(model, OptimizerConfig(early_step_in_backward=True))
    model[0].weight.grad = torch.ones_like(model[0].weight)  # set, not accumulated by autograd
    with pytest.raises(OptimizerInBackwardError, match=r"found gradients left after backward"):
        ours.step()
