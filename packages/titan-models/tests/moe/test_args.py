"""MoEArgs: every setting that cannot route fails when the args are built, with one
ModelConfigError naming the field, its value and what is allowed."""

from __future__ import annotations

import pytest

from titan_models import ModelConfigError
from titan_models.moe import MoEArgs


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts": 0}, "num_experts=0 is not allowed"),
        ({"num_shared_experts": -1}, "num_shared_experts=-1"),
        ({"top_k": 0}, "top_k=0"),
        ({"num_experts": 4, "top_k": 5}, "at most num_experts=4"),
        ({"score_func": "relu"}, "choose one of 'softmax', 'sigmoid'"),
        ({"route_norm": "yes"}, "route_norm='yes'"),
        ({"route_scale": 0.0}, "route_scale=0.0"),
        ({"num_experts": 8, "n_expert_groups": 3}, "must divide num_experts=8"),
        ({"n_expert_groups": 2, "n_limited_groups": 3}, "at most n_expert_groups=2"),
        ({"num_experts": 4, "n_expert_groups": 4}, "needs at least 2"),
        (
            {"num_experts": 8, "n_expert_groups": 4, "n_limited_groups": 1, "top_k": 3},
            "hold only 2 experts",
        ),
        ({"load_balance_coeff": 0.0}, "None turns the load-balancing bias off"),
        ({"load_balance_coeff": -1e-3}, "load_balance_coeff=-0.001"),
        ({"aux_loss_alpha": -0.1}, "aux_loss_alpha=-0.1"),
        ({"use_grouped_mm": 1}, "use_grouped_mm=1"),
    ],
)
def test_bad_settings_raise_one_clear_error(fields, message):
    with pytest.raises(ModelConfigError, match=message):
        MoEArgs(**fields)


def test_defaults_and_grouped_routing_are_valid():
    assert MoEArgs().experts_per_group == 8
    args = MoEArgs(num_experts=8, top_k=4, n_expert_groups=4, n_limited_groups=2)
    assert args.experts_per_group == 2
    assert MoEArgs(load_balance_coeff=None).load_balance_coeff is None
