"""DeepSeekV3Args: the flavors' total and active parameter counts against the published ones
and against torchtitan's own count (recorded in data/torchtitan_fqns.json), FLOPs per token,
the softmax scale, and validation errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from titan_models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args, deepseek_v3_args
from titan_models.errors import ModelConfigError

TORCHTITAN = json.loads((Path(__file__).parent / "data" / "torchtitan_fqns.json").read_text())

# flavor: (total, active without the input embedding), as our count gives them exactly; the
# published figures are these rounded: DeepSeek-V2-Lite "15.7B total, 2.4B activated"
# (15.706e9; 2.451e9, cut to one decimal), DeepSeek-V2 "236B, 21B activated" (235.74e9;
# 20.85e9), DeepSeek-V3 "671B, 37B activated" (671.03e9; 36.63e9). DeepSeek counts
# activated parameters without the embedding lookup (with it: 2.66e9, 21.38e9, 37.55e9), and
# V3's 671B leaves out its 14B multi-token-prediction module.
COUNTS = {
    "16B": (15_706_484_224, 2_451_435_008),
    "236B": (235_741_434_880, 20_851_512_320),
    "671B": (671_026_404_352, 36_625_603_584),
}


@pytest.mark.parametrize("flavor", list(COUNTS))
def test_parameter_counts_equal_the_published_ones(flavor):
    total, active = COUNTS[flavor]
    args = deepseek_v3_args(flavor)
    assert args.num_params() == total
    assert args.num_active_params(exclude_embedding=True) == active
    published = {"16B": (15.7, 2.4), "236B": (236, 21), "671B": (671, 37)}[flavor]
    if flavor == "16B":
        assert (round(total / 1e9, 1), math.floor(active / 1e8) / 10) == published
    else:
        assert (round(total / 1e9), round(active / 1e9)) == published


@pytest.mark.parametrize("flavor", list(DEEPSEEK_V3_FLAVORS))
def test_total_count_equals_torchtitans_own(flavor):
    assert deepseek_v3_args(flavor).num_params() == TORCHTITAN["flavors"][flavor]["num_params"]


def test_active_count_keeps_shared_experts_and_router_and_top_k_experts():
    args = deepseek_v3_args("671B")
    expert = 3 * args.dim * args.moe_inter_dim
    moe_blocks = args.n_layers - args.n_dense_layers
    assert args.num_params() - args.num_active_params() == moe_blocks * (256 - 8) * expert
    with_embedding = args.num_active_params()
    assert with_embedding - args.num_active_params(exclude_embedding=True) == 129280 * 7168


def test_flops_per_token_counts_active_matmul_weights_and_attention():
    args = deepseek_v3_args("671B")
    active = 36_625_603_584
    attention = 6 * 61 * 128 * (192 + 128) * 4096
    assert args.flops_per_token(4096) == 6 * active + attention
    with pytest.raises(ValueError, match="seq_len"):
        args.flops_per_token(0)


def test_softmax_scale_has_the_yarn_factor_only_above_original_seq_len():
    assert deepseek_v3_args("16B", max_seq_len=4096).softmax_scale == 192**-0.5
    long = deepseek_v3_args("16B", max_seq_len=8192)
    assert long.yarn
    assert long.softmax_scale == pytest.approx(192**-0.5 * (0.07 * math.log(40) + 1) ** 2)
    plain = deepseek_v3_args("16B", max_seq_len=8192, rope_scaling="none")
    assert not plain.yarn
    assert plain.softmax_scale == 192**-0.5


def test_rope_scaling_names():
    assert deepseek_v3_args("16B", rope_scaling="flavor").rope_scaling == "yarn"
    assert deepseek_v3_args("16B", rope_scaling="none").rope_scaling == "none"
    with pytest.raises(ModelConfigError, match=r"'llama3'.*YaRN.*'none'"):
        deepseek_v3_args("16B", rope_scaling="llama3")
    with pytest.raises(ModelConfigError, match="rope_scaling='ntk'"):
        deepseek_v3_args("16B", rope_scaling="ntk")


def test_flavors_carry_torchtitans_shapes_and_copies_are_independent():
    a = deepseek_v3_args("671B", vocab_size=1000)
    a.n_layers = 1
    b = DEEPSEEK_V3_FLAVORS["671B"]
    assert (b.vocab_size, b.n_layers, b.score_func, b.route_norm) == (129280, 61, "sigmoid", True)
    assert (b.n_expert_groups, b.n_limited_groups, b.route_scale) == (8, 4, 2.5)
    assert DEEPSEEK_V3_FLAVORS["16B"].route_norm is False


def test_moe_args_carry_the_routing_fields():
    moe = deepseek_v3_args("671B", aux_loss_alpha=1e-4).moe_args()
    got = {k: getattr(moe, k) for k in ("num_experts", "num_shared_experts", "top_k")}
    assert got == {"num_experts": 256, "num_shared_experts": 1, "top_k": 8}
    assert (moe.score_func, moe.route_norm, moe.route_scale) == ("sigmoid", True, 2.5)
    assert (moe.n_expert_groups, moe.n_limited_groups) == (8, 4)
    assert (moe.load_balance_coeff, moe.aux_loss_alpha) == (1e-3, 1e-4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_layers": 0}, r"n_layers=0 is not allowed"),
        ({"n_dense_layers": 30}, "n_dense_layers=30 is more than n_layers=27"),
        ({"qk_rope_head_dim": 63}, "must be even"),
        ({"n_activated_experts": 65}, "n_activated_experts=65 is more than n_routed_experts=64"),
        ({"n_expert_groups": 5}, "divisible by n_expert_groups=5"),
        ({"n_expert_groups": 8, "n_limited_groups": 9}, "n_limited_groups=9 is more than"),
        ({"n_expert_groups": 32, "n_limited_groups": 1}, "hold fewer than n_activated_experts"),
        ({"score_func": "relu"}, "score_func='relu' is not allowed; choose one of"),
        ({"load_balance_coeff": 0.0}, "load_balance_coeff=0.0 is not allowed"),
        ({"q_lora_rank": -1}, "q_lora_rank=-1"),
        ({"route_norm": "yes"}, "route_norm='yes'"),
        ({"rope_factor": 0.5}, "rope_factor=0.5"),
    ],
)
def test_invalid_args_name_the_field(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        DeepSeekV3Args(**kwargs)


def test_unknown_flavor_and_field():
    with pytest.raises(ModelConfigError, match="'debugmodel', '16B', '236B', '671B'"):
        deepseek_v3_args("7B")
    with pytest.raises(ModelConfigError, match=r"Unknown DeepSeekV3Args field.*n_kv_heads"):
        deepseek_v3_args("16B", n_kv_heads=2)


def test_args_are_json_ready():
    record = dataclasses.asdict(deepseek_v3_args("debugmodel"))
    assert DeepSeekV3Args(**json.loads(json.dumps(record))) == deepseek_v3_args("debugmodel")
