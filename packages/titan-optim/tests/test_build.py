"""Optimizers built from ``OptimizerConfig`` match torch's own, step for step, bit for bit."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from titan_optim import OptimizerConfig, ParamGroupRule, build_optimizers
from titan_optim.build import group_parameters


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.output = nn.Linear(6, 11, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(torch.tanh(self.proj(self.tok_embeddings(tokens)))))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 11, (4, 5), generator=g)
    return nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


TORCH_FLAGS = {
    "for-loop": {"foreach": False, "fused": False},
    "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True},
}


@pytest.mark.parametrize("implementation", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize(
    ("name", "torch_cls", "torch_kwargs"),
    [
        ("Adam", torch.optim.Adam, {"betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01}),
        ("AdamW", torch.optim.AdamW, {"betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.01}),
        ("SGD", torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01}),
    ],
)
def test_matches_torch_step_for_step(name, torch_cls, torch_kwargs, implementation):
    torch.manual_seed(0)
    ours_model = Tiny()
    ref_model = copy.deepcopy(ours_model)
    config = OptimizerConfig(name=name, lr=0.05, implementation=implementation, **torch_kwargs)
    ours = build_optimizers(ours_model, config)
    ref = torch_cls(ref_model.parameters(), lr=0.05, **torch_kwargs, **TORCH_FLAGS[implementation])
    assert type(ours.optimizers[0]) is torch_cls
    for step in range(4):
        for model, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
        for p, q in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p, q), f"{name}/{implementation} differs at step {step}"
    assert not torch.equal(ours_model.proj.weight, Tiny().proj.weight)


def test_first_matching_rule_wins_and_rest_is_default_group():
    config = OptimizerConfig(
        lr=1e-3,
        weight_decay=0.1,
        param_group_rules=[
            ParamGroupRule(pattern="tok_embeddings.*", lr=1e-2),
            ParamGroupRule(pattern="*norm*", weight_decay=0.0),
            ParamGroupRule(pattern="*.bias", weight_decay=0.0, lr=5e-4),  # norm.bias: rule 2
            ParamGroupRule(pattern="nothing.*", lr=1.0),  # matches nothing: no empty group
        ],
    )
    model = Tiny()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = group_parameters(model, config)
    got = [
        ([names[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k != "params"})
        for g in groups
    ]
    assert got == [
        (["tok_embeddings.weight"], {"lr": 1e-2}),
        (["norm.weight", "norm.bias"], {"weight_decay": 0.0}),
        (["proj.bias"], {"lr": 5e-4, "weight_decay": 0.0}),
        (["proj.weight", "output.weight"], {}),
    ]
    opt = build_optimizers(model, config).optimizers[0]
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [
        (1e-2, 0.1),
        (1e-3, 0.0),
        (5e-4, 0.0),
        (1e-3, 0.1),
    ]


def test_frozen_parameters_are_left_out():
    model = Tiny()
    model.tok_embeddings.weight.requires_grad_(False)
    (opt,) = build_optimizers(model, OptimizerConfig()).optimizers
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.tok_embeddings.weight) not in params
    assert len(params) == 5


def test_fused_runs_on_cpu_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (opt,) = build_optimizers(Tiny(), OptimizerConfig(implementation="fused")).optimizers
    assert opt.defaults["fused"] is True


class Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.z = nn.Parameter(torch.randn(3, dtype=torch.complex64))


def test_fused_falls_back_with_one_warning_where_torch_has_no_kernel():
    torch.manual_seed(0)
    parts = [Complex(), Complex()]
    ref_parts = copy.deepcopy(parts)
    with pytest.warns(UserWarning, match="fused") as record:
        ours = build_optimizers(parts, OptimizerConfig(implementation="fused", lr=0.1))
    assert len(record) == 1
    message = str(record[0].message)
    assert "optimizer.implementation='fused' is not available for torch.complex64" in message
    assert "using 'for-loop' instead" in message
    ref = torch.optim.AdamW(
        [p for m in ref_parts for p in m.parameters()],
        lr=0.1,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        foreach=False,
    )
    for opt, models in ((ours, parts), (ref, ref_parts)):
        for m in models:
            m.z.grad = torch.full((3,), 1 + 2j)
        opt.step()
    for m, r in zip(parts, ref_parts, strict=True):
        assert torch.equal(m.z, r.z)
