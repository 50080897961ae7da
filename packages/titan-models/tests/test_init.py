"""``titan_models.init``: draws by seed and parameter name inside ``seeded_init``, torch's
own draws outside it. Layouts (FSDP, TP, PP, EP, their mixes) against one process are
checked on real gloo ranks in titan-train's ``tests/test_init_layouts.py``."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from titan_models import ModelError, init


def stack() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(8, 16, bias=False))


def draw(model: nn.Module, seed: int) -> list[torch.Tensor]:
    with init.seeded_init(model, seed):
        for p in model.parameters():
            init.trunc_normal_(p, std=0.02)
    return [p.detach().clone() for p in model.parameters()]


def test_outside_seeded_init_the_draws_are_torchs():
    ours, torchs = torch.empty(4, 8), torch.empty(4, 8)
    torch.manual_seed(3)
    init.trunc_normal_(ours, std=0.5, a=-1.0, b=1.0)
    torch.manual_seed(3)
    nn.init.trunc_normal_(torchs, std=0.5, a=-1.0, b=1.0)
    assert torch.equal(ours, torchs)


def test_values_follow_seed_and_name_not_the_global_generator_or_wrappers():
    torch.manual_seed(0)
    first = draw(stack(), seed=5)
    torch.manual_seed(1)
    wrapped = stack()
    wrapped[1] = checkpoint_wrapper(wrapped[1])  # names gain _checkpoint_wrapped_module
    assert torch.equal(torch.stack(first), torch.stack(draw(wrapped, seed=5)))
    assert not torch.equal(first[0], first[1])  # same shape and rule, other name
    assert not torch.equal(first[0], draw(stack(), seed=6)[0])


def test_the_draws_keep_the_rule():
    (weight,) = draw(nn.Linear(1024, 1024, bias=False), seed=0)
    assert weight.std().item() == pytest.approx(0.02, rel=0.01)
    with init.seeded_init(layer := nn.Linear(1024, 1024, bias=False), seed=0):
        init.trunc_normal_(layer.weight, std=1.0, a=-0.5, b=0.5)
        assert layer.weight.abs().max().item() <= 0.5
        init.normal_(layer.weight, mean=3.0)
    assert layer.weight.mean().item() == pytest.approx(3.0, abs=0.01)


def test_a_tensor_of_another_model_is_refused():
    with init.seeded_init(stack(), seed=0), pytest.raises(ModelError, match="not a parameter"):
        init.normal_(nn.Linear(2, 2).weight)
