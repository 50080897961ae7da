"""Load balancing: the bias update equals a hand computation, a deliberately unbalanced
router moves toward balance over a few update steps, the load metrics are the shares of
the counted tokens, and a model without MoE layers is left alone."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from titan_models.moe import MoE, MoEArgs, expert_load, moe_layers, update_expert_bias

DIM = 8


class Block(nn.Module):
    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.moe = MoE(args, dim=DIM, hidden_dim=16)


class TwoLayers(nn.Module):
    def __init__(self, **fields) -> None:
        super().__init__()
        args = MoEArgs(num_experts=4, top_k=1, score_func="sigmoid", **fields)
        self.layers = nn.ModuleDict({"0": nn.Linear(DIM, DIM), "1": Block(args), "2": Block(args)})


def test_moe_layers_and_bias_update_by_hand():
    model = TwoLayers(load_balance_coeff=0.1)
    assert [name for name, _ in moe_layers(model)] == ["layers.1.moe", "layers.2.moe"]
    first, second = (layer for _, layer in moe_layers(model))
    first.tokens_per_expert.copy_(torch.tensor([10.0, 2.0, 4.0, 4.0]))  # mean 5
    second.tokens_per_expert.copy_(torch.tensor([5.0, 5.0, 5.0, 5.0]))  # balanced
    first.expert_bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))
    update_expert_bias([model])
    # sign(mean - n) = [-1, 1, 1, 1] -> * 0.1, minus its mean 0.05 -> [-0.15, 0.05, 0.05, 0.05]
    torch.testing.assert_close(first.expert_bias, torch.tensor([0.35, 0.05, 0.05, 0.05]))
    torch.testing.assert_close(second.expert_bias, torch.zeros(4))
    assert first.tokens_per_expert.abs().sum() == 0
    assert second.tokens_per_expert.abs().sum() == 0


def test_expert_load_shares_and_entropy():
    model = TwoLayers()
    first, second = (layer for _, layer in moe_layers(model))
    first.tokens_per_expert.copy_(torch.tensor([6.0, 2.0, 2.0, 0.0]))
    shares = [0.6, 0.2, 0.2]
    entropy = -sum(p * math.log(p) for p in shares) / math.log(4)
    load = expert_load(model)
    assert load == pytest.approx(
        {
            "moe/layers.1/min_share": 0.0,
            "moe/layers.1/max_share": 0.6,
            "moe/layers.1/entropy": entropy,
        }
    )
    second.tokens_per_expert.fill_(3.0)
    assert expert_load(model)["moe/layers.2/entropy"] == pytest.approx(1.0)
    assert expert_load(model)["moe/layers.2/min_share"] == pytest.approx(0.25)
    assert expert_load(nn.Linear(2, 2)) == {}


def test_no_moe_layers_or_no_bias_is_a_no_op():
    dense = nn.Sequential(nn.Linear(2, 2))
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    update_expert_bias(dense)
    assert all(torch.equal(before[k], v) for k, v in dense.state_dict().items())
    model = TwoLayers(load_balance_coeff=None)
    first = moe_layers(model)[0][1]
    first.tokens_per_expert.fill_(7.0)
    update_expert_bias(model)
    assert first.expert_bias is None
    assert first.tokens_per_expert.abs().sum() == 0


def test_an_unbalanced_router_moves_toward_balance():
    torch.manual_seed(0)
    moe = MoE(
        MoEArgs(num_experts=4, top_k=1, score_func="sigmoid", load_balance_coeff=0.02),
        dim=DIM,
        hidden_dim=16,
    )
    moe.init_weights(0.02)
    # Tokens share a direction u that expert 0's gate row follows: it wins almost every one
    # (sigmoid score ~0.88 against ~0.5).
    u = torch.nn.functional.normalize(torch.randn(DIM), dim=0)
    x = 0.3 * torch.randn(4, 16, DIM) + u
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.3)
        moe.router.gate.weight[0] += 2.0 * u
    history = []
    for _ in range(16):
        moe(x).sum().backward()  # a training forward counts its tokens
        history.append(expert_load(moe))
        update_expert_bias(moe)
    first = history[0]
    assert first["moe/max_share"] == 1.0
    assert first["moe/min_share"] == 0.0
    # The sign update is a bang-bang controller: near balance it oscillates by one step,
    # so the last few steps are checked, each.
    for load in history[-4:]:
        assert load["moe/min_share"] > 0.09
        assert load["moe/max_share"] < 0.45
        assert load["moe/entropy"] > first["moe/entropy"] + 0.5
    assert moe.expert_bias[0] < 0
    assert moe.expert_bias.sum().abs() < 1e-6


def test_layer_names_leave_out_checkpoint_and_compile_wrappers():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = TwoLayers()
    model.layers["1"] = checkpoint_wrapper(model.layers["1"])
    model.layers["2"].moe = torch.compile(model.layers["2"].moe)
    assert [name for name, _ in moe_layers(model)] == ["layers.1.moe", "layers.2.moe"]
    for _, layer in moe_layers(model):
        layer.tokens_per_expert.fill_(1.0)
    assert set(expert_load(model)) == {
        f"moe/layers.{i}/{stat}" for i in (1, 2) for stat in ("min_share", "max_share", "entropy")
    }
