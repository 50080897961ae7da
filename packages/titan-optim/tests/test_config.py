"""``OptimizerConfig`` / ``ParamGroupRule`` validation: each bad value names field and fix."""

from __future__ import annotations

import pytest

from titan_optim import OptimizerConfig, OptimizerConfigError, ParamGroupRule


def test_defaults_are_valid():
    config = OptimizerConfig()
    assert (config.name, config.implementation, config.betas) == ("AdamW", "fused", (0.9, 0.95))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"name": "Adamw"},
            r"optimizer.name='Adamw' is not allowed; choose one of 'Adam', 'AdamW', 'Muon', 'SGD'",
        ),
        ({"lr": -0.1}, r"optimizer.lr=-0.1 is not allowed; it must be a finite number >= 0"),
        ({"lr": float("nan")}, r"optimizer.lr=nan is not allowed; it must be a finite number >= 0"),
        ({"lr": "1e-3"}, r"optimizer.lr='1e-3' is not allowed; it must be a finite number"),
        (
            {"betas": (0.9, 1.0)},
            r"optimizer.betas\[1\]=1.0 is not allowed; it must be a finite number in \[0, 1\)",
        ),
        ({"betas": (-0.1, 0.9)}, r"optimizer.betas\[0\]=-0.1 is not allowed"),
        ({"betas": (0.9,)}, r"optimizer.betas=\(0.9,\) has 1 values; give two numbers in \[0, 1\)"),
        ({"betas": 0.9}, r"optimizer.betas=0.9 is not allowed; give two numbers"),
        ({"eps": -1e-8}, r"optimizer.eps=-1e-08 is not allowed; it must be a finite number >= 0"),
        ({"weight_decay": -1}, r"optimizer.weight_decay=-1 is not allowed"),
        (
            {"momentum": 1.0},
            r"optimizer.momentum=1.0 is not allowed; it must be a finite number in \[0, 1\)",
        ),
        (
            {"implementation": "fast"},
            r"optimizer.implementation='fast' is not allowed; "
            r"choose one of 'for-loop', 'foreach', 'fused'",
        ),
        (
            {"early_step_in_backward": "yes"},
            r"optimizer.early_step_in_backward='yes' is not allowed; it must be true or false",
        ),
    ],
)
def test_bad_values_raise_naming_field_value_and_allowed(kwargs, match):
    with pytest.raises(OptimizerConfigError, match=match):
        OptimizerConfig(**kwargs)


def test_betas_from_toml_list_become_a_tuple():
    assert OptimizerConfig(betas=[0.8, 0.9]).betas == (0.8, 0.9)


def test_rules_accept_toml_tables_and_check_them():
    config = OptimizerConfig(param_group_rules=[{"pattern": "*.bias", "weight_decay": 0}])
    assert config.param_group_rules == [ParamGroupRule(pattern="*.bias", weight_decay=0.0)]
    with pytest.raises(OptimizerConfigError, match=r"unknown key\(s\) \['wd'\]; allowed keys"):
        OptimizerConfig(param_group_rules=[{"pattern": "*.bias", "wd": 0}])
    with pytest.raises(OptimizerConfigError, match=r"has no 'pattern'"):
        OptimizerConfig(param_group_rules=[{"lr": 0.1}])
    with pytest.raises(OptimizerConfigError, match=r"\['\*.bias'\].lr=-1 is not allowed"):
        ParamGroupRule(pattern="*.bias", lr=-1)
    with pytest.raises(OptimizerConfigError, match=r"pattern='' is not allowed"):
        ParamGroupRule(pattern="")


def test_rule_matches_fqn_globs():
    rule = ParamGroupRule(pattern="*norm*")
    assert rule.matches("layers.0.attention_norm.weight")
    assert not rule.matches("layers.0.attention.wq.weight")
