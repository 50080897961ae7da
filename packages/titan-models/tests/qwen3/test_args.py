"""Qwen3Args: every published flavor's parameter count against the Qwen3 model cards, and
against the model built on the meta device; FLOPs per token; validation and the trainer's
overrides."""

from __future__ import annotations

import math

import pytest
import torch

from titan_models.errors import ModelConfigError
from titan_models.qwen3.args import QWEN3_FLAVORS, Qwen3Args, qwen3_args
from titan_models.qwen3.model import Qwen3

# flavor: (total, active) as our count gives them exactly (a tied embedding counted once),
# and the model cards' figures: "Number of Parameters" and "Number of Parameters
# (Non-Embedding)", which leaves out the embedding and, untied, the output matrix too.
# Rounding: total and non-embedding to the card's one decimal (0.44B, 6.95B: two), except
# 235B (to the unit); the MoE "activated" figures 3.3B and 22B are the active count cut
# (not rounded: 3.353e9) to one decimal and rounded to the unit.
COUNTS = {
    "0.6B": (596_049_920, 596_049_920),
    "1.7B": (1_720_574_976, 1_720_574_976),
    "4B": (4_022_468_096, 4_022_468_096),
    "8B": (8_190_735_360, 8_190_735_360),
    "14B": (14_768_307_200, 14_768_307_200),
    "32B": (32_762_123_264, 32_762_123_264),
    "30B-A3B": (30_532_122_624, 3_353_032_704),
    "235B-A22B": (235_093_634_560, 22_190_763_520),
}
PUBLISHED = {  # flavor: (total, non-embedding) in billions, as the cards print them
    "0.6B": (0.6, 0.44),
    "1.7B": (1.7, 1.4),
    "4B": (4.0, 3.6),
    "8B": (8.2, 6.95),
    "14B": (14.8, 13.2),
    "32B": (32.8, 31.2),
    "30B-A3B": (30.5, 29.9),
    "235B-A22B": (235, 234),
}


def _rounded(value: float, like: float) -> float:
    decimals = len(repr(like).split(".")[1]) if isinstance(like, float) else 0
    return round(value, decimals)


@pytest.mark.parametrize("flavor", list(COUNTS))
def test_parameter_counts_equal_the_published_ones(flavor):
    args = qwen3_args(flavor)
    total, active = COUNTS[flavor]
    assert (args.num_params(), args.num_active_params()) == (total, active)
    embeddings = args.vocab_size * args.dim * (1 if args.enable_weight_tying else 2)
    published_total, published_non_embedding = PUBLISHED[flavor]
    assert _rounded(total / 1e9, published_total) == published_total
    non_embedding = (total - embeddings) / 1e9
    assert _rounded(non_embedding, published_non_embedding) == published_non_embedding
    if flavor == "30B-A3B":
        assert math.floor(active / 1e8) / 10 == 3.3
    if flavor == "235B-A22B":
        assert round(active / 1e9) == 22


@pytest.mark.parametrize("flavor", list(QWEN3_FLAVORS))
def test_parameter_count_equals_the_model_on_the_meta_device(flavor):
    args = qwen3_args(flavor)
    with torch.device("meta"):
        model = Qwen3(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()  # tied: once
    experts = sum(p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)
    assert args.num_active_params() == args.num_params() - experts + experts * args.top_k // (
        args.num_experts
    )
    embedding = args.vocab_size * args.dim
    assert args.num_params(exclude_embedding=True) == args.num_params() - embedding


def test_tied_flavors_are_the_small_ones():
    tied = sorted(f for f, a in QWEN3_FLAVORS.items() if a.enable_weight_tying)
    assert tied == ["0.6B", "1.7B", "4B", "debugmodel"]


def test_flops_per_token_counts_active_matmuls_and_attention():
    moe = qwen3_args("30B-A3B")
    embedding = 151936 * 2048
    attention = 12 * 48 * 32 * 128 * 4096
    assert moe.flops_per_token(4096) == 6 * (3_353_032_704 - embedding) + attention
    tied = qwen3_args("0.6B")  # the output matmul counts though its weight is the embedding's
    assert tied.flops_per_token(1) == 6 * 596_049_920 + 12 * 28 * 16 * 128
    with pytest.raises(ValueError, match="seq_len"):
        tied.flops_per_token(0)


def test_sparse_step_and_mlp_only_layers_choose_the_moe_blocks():
    args = qwen3_args("debugmodel_moe", n_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert args.mlp_only_layers == (3,)
    assert [args.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    with torch.device("meta"):
        model = Qwen3(args)
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    assert not qwen3_args("8B").is_moe_layer(0)


def test_moe_args_are_qwen3_routing():
    moe = qwen3_args("30B-A3B").moe_args()
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts) == (128, 8, 0)
    assert (moe.score_func, moe.route_norm, moe.route_scale) == ("softmax", True, 1.0)
    # torchtitan's balancing bias, no auxiliary loss, unless asked otherwise.
    assert (moe.load_balance_coeff, moe.aux_loss_alpha) == (1e-3, 0.0)
    tuned = qwen3_args("30B-A3B", load_balance_coeff=None, aux_loss_alpha=1e-4).moe_args()
    assert (tuned.load_balance_coeff, tuned.aux_loss_alpha) == (None, 1e-4)
    with pytest.raises(ModelConfigError, match="aux_loss_alpha=-1"):
        qwen3_args("30B-A3B", aux_loss_alpha=-1.0)


def test_trainer_overrides_and_rope_scaling():
    args = qwen3_args("8B", vocab_size=1000, max_seq_len=2048, rope_scaling="none")
    assert (args.vocab_size, args.max_seq_len, args.rope_theta) == (1000, 2048, 1e6)
    assert qwen3_args("8B", rope_scaling="flavor") == qwen3_args("8B")
    with pytest.raises(ModelConfigError, match=r"rope_scaling='llama3' does not apply to Qwen3"):
        qwen3_args("8B", rope_scaling="llama3")
    with pytest.raises(ModelConfigError, match="Unknown Qwen3 flavor '7B'"):
        qwen3_args("7B")
    with pytest.raises(ModelConfigError, match=r"Unknown Qwen3Args field.*multiple_of"):
        qwen3_args("8B", multiple_of=256)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_heads": 12, "n_kv_heads": 8}, "n_heads=12 must be divisible by n_kv_heads=8"),
        ({"head_dim": 63}, "head_dim=63 must be even"),
        ({"top_k": 9, "num_experts": 8}, "top_k=9 is more than num_experts=8"),
        ({"mlp_only_layers": (28,)}, r"mlp_only_layers=\(28,\) is not allowed"),
        ({"dim": 0}, "dim=0 is not allowed"),
        ({"enable_weight_tying": "yes"}, "enable_weight_tying='yes' is not allowed"),
        ({"load_balance_coeff": 0.0}, "load_balance_coeff=0.0 is not allowed"),
    ],
)
def test_bad_args_raise_one_clear_error(fields, message):
    with pytest.raises(ModelConfigError, match=message):
        Qwen3Args(**fields)
