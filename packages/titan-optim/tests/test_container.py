"""``OptimizersContainer``: several model parts act as one optimizer and save as one dict.

Checked against a single torch optimizer over the unsplit model, and against itself across a
save / load.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from titan_optim import NonFiniteGradError, OptimizerConfig, build_optimizers


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def split(model: nn.Sequential) -> list[nn.Sequential]:
    """Two pipeline stages that keep the full model's FQNs (``0.weight``, ``2.weight``)."""
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    first[2] = nn.Identity()
    second[0], second[1] = nn.Identity(), nn.Identity()
    return [first, second]


def loss_of(parts: list[nn.Module], step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)
    for part in parts:
        x = part(x)
    return nn.functional.mse_loss(x, y)


def train(parts, optimizers, steps: range) -> None:
    for step in steps:
        optimizers.zero_grad()
        loss_of(parts, step).backward()
        optimizers.step()


def test_parts_step_like_one_optimizer_over_the_whole_model():
    model = make_model()
    parts = split(model)
    config = OptimizerConfig(lr=0.05)
    optimizers = build_optimizers(parts, config)
    ref = torch.optim.AdamW(model.parameters(), **config.optimizer_kwargs(), fused=True)
    assert len(optimizers) == 2
    train(parts, optimizers, range(3))
    train([model], ref, range(3))
    assert torch.equal(parts[0][0].weight, model[0].weight)
    assert torch.equal(parts[1][2].weight, model[2].weight)


def test_step_hooks_run_around_the_step_and_can_be_removed():
    parts = split(make_model())
    optimizers = build_optimizers(parts, OptimizerConfig(lr=0.1))
    seen = []
    weight = parts[0][0].weight
    pre = optimizers.register_step_pre_hook(lambda o: seen.append(("pre", weight.clone())))
    optimizers.register_step_post_hook(lambda o: seen.append(("post", weight.clone())))
    train(parts, optimizers, range(1))
    assert [tag for tag, _ in seen] == ["pre", "post"]
    assert not torch.equal(seen[0][1], seen[1][1])  # the step happened between them
    pre.remove()
    train(parts, optimizers, range(1, 2))
    assert [tag for tag, _ in seen] == ["pre", "post", "post"]


def test_state_dict_is_flat_fqn_keyed_and_stateful():
    parts = split(make_model())
    optimizers = build_optimizers(parts, OptimizerConfig())
    assert isinstance(optimizers, Stateful)
    train(parts, optimizers, range(1))
    sd = optimizers.state_dict()
    assert {"state.0.weight.exp_avg", "state.2.bias.exp_avg_sq", "param_groups.2.weight.lr"} <= set(
        sd
    )
    assert sd["state.2.weight.exp_avg"].shape == (3, 8)


def test_parts_with_the_same_fqns_are_refused_when_saving():
    parts = [nn.Linear(2, 2), nn.Linear(2, 2)]  # both call their weight "weight"
    optimizers = build_optimizers(parts, OptimizerConfig())
    with pytest.raises(ValueError, match=r"model parts share parameter names \['bias', 'weight'\]"):
        optimizers.state_dict()


def test_load_state_dict_continues_identically():
    parts = split(make_model())
    optimizers = build_optimizers(parts, OptimizerConfig(lr=0.05))
    train(parts, optimizers, range(2))
    saved_parts = copy.deepcopy(parts)
    saved = copy.deepcopy(optimizers.state_dict())
    train(parts, optimizers, range(2, 4))

    torch.manual_seed(1)  # a fresh run whose state must all come from the checkpoint
    resumed = build_optimizers(saved_parts, OptimizerConfig(lr=0.05))
    resumed.load_state_dict(saved)
    train(saved_parts, resumed, range(2, 4))
    for a, b in zip(parts, saved_parts, strict=True):
        for p, q in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_equals_torch(norm_type):
    model = make_model()
    parts = split(model)
    optimizers = build_optimizers(parts, OptimizerConfig())
    loss_of(parts, 0).backward()
    loss_of([model], 0).backward()
    ours = optimizers.clip_grad_norm_(0.1, norm_type=norm_type)
    ref = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=norm_type)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6)
    assert ref.item() > 0.1
    assert torch.allclose(parts[1][2].weight.grad, model[2].weight.grad, rtol=1e-6, atol=0)


def test_a_mirrored_parameter_is_clipped_but_not_counted():
    """A tied weight held by two pipeline stages: its second copy (``mirrored``) must not
    count twice in the norm, yet its gradient is scaled like every other."""
    model = make_model()
    parts = split(model)
    optimizers = build_optimizers(parts, OptimizerConfig())
    loss_of(parts, 0).backward()
    copy = parts[1][2].weight
    grads = [p.grad.clone() for part in parts for p in part.parameters()]
    counted = [p.grad for part in parts for p in part.parameters() if p is not copy]
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in counted]))
    everything = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    norm = optimizers.clip_grad_norm_(0.01, mirrored=[copy])
    assert norm.item() == pytest.approx(expected.item(), rel=1e-6)
    assert norm.item() < everything.item()
    scale = 0.01 / (expected.item() + 1e-6)
    after = [p.grad for part in parts for p in part.parameters()]
    for before, now in zip(grads, after, strict=True):  # the copy's gradient scaled too
        torch.testing.assert_close(now, before * scale, rtol=1e-5, atol=0)


def test_nonfinite_norm_skips_the_step_and_its_hooks():
    parts = split(make_model())
    optimizers = build_optimizers(parts, OptimizerConfig(lr=0.1))
    calls = []
    optimizers.register_step_post_hook(lambda o: calls.append(1))
    before = parts[1][2].weight.detach().clone()
    loss_of(parts, 0).backward()
    parts[0][0].weight.grad[0, 0] = float("inf")
    norm = optimizers.clip_grad_norm_(1.0)
    assert norm.item() == float("inf")
    assert parts[1][2].weight.grad.isfinite().all()  # left untouched, not scaled by nan
    optimizers.step()
    assert torch.equal(parts[1][2].weight, before)
    assert (optimizers.skipped_steps, calls) == (1, [])
    train(parts, optimizers, range(1, 2))  # a finite step afterwards runs
    assert not torch.equal(parts[1][2].weight, before)
    assert calls == [1]


def test_nonfinite_norm_raises_under_the_raise_policy():
    parts = split(make_model())
    optimizers = build_optimizers(parts, OptimizerConfig())
    loss_of(parts, 0).backward()
    parts[1][2].bias.grad[0] = float("nan")
    with pytest.raises(
        NonFiniteGradError, match=r"global gradient norm is nan .*on_nonfinite='skip'"
    ):
        optimizers.clip_grad_norm_(1.0, on_nonfinite="raise")


def test_bad_clip_arguments_raise():
    # Arguments of a call, not config settings: plain ValueErrors, not OptimizerConfigError
    # (which titan-train would report as a bad config).
    optimizers = build_optimizers(make_model(), OptimizerConfig())
    with pytest.raises(
        ValueError, match=r"^on_nonfinite='ignore' is not allowed; choose one of 'skip', 'raise'"
    ) as error:
        optimizers.clip_grad_norm_(1.0, on_nonfinite="ignore")
    assert type(error.value) is ValueError
    with pytest.raises(ValueError, match=r"^max_norm=-1.0 is not allowed; it must be") as error:
        optimizers.clip_grad_norm_(-1.0)
    assert type(error.value) is ValueError
    with pytest.raises(ValueError, match=r"^norm_type=0.0 is not allowed; it must be > 0 or inf"):
        optimizers.clip_grad_norm_(1.0, norm_type=0)
