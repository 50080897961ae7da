"""Llama3Args: published shapes and parameter counts (checked against the model built on the
meta device and against the published totals), FLOPs, and validation errors."""

from __future__ import annotations

import pytest
import torch

from titan_models import ModelConfigError
from titan_models.llama3 import LLAMA3_FLAVORS, Llama3, Llama3Args, RopeScaling, llama3_args
from titan_models.llama3.args import rope_scaling_of

# Published totals with vocab 128256 and an untied output matrix (1B and 3B ship tied: their
# published 1.24B and 3.21B are these minus one 128256 x dim matrix).
PUBLISHED = {
    "1B": (2048, 8192, 1_498_482_688),
    "3B": (3072, 8192, 3_606_752_256),
    "8B": (4096, 14336, 8_030_261_248),
    "70B": (8192, 28672, 70_553_706_496),
    "405B": (16384, 53248, 405_853_388_800),
}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_shapes_and_parameter_counts(flavor):
    dim, hidden, params = PUBLISHED[flavor]
    args = llama3_args(flavor)
    assert (args.dim, args.hidden_dim, args.num_params()) == (dim, hidden, params)


def test_8b_on_meta_device_has_exactly_the_published_parameter_count():
    with torch.device("meta"):
        model = Llama3(llama3_args("8B"))
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248
    assert model.layers["31"].attention.wk.weight.shape == (1024, 4096)
    assert model.layers["0"].feed_forward.w1.weight.shape == (14336, 4096)


def test_debugmodel_shape():
    args = llama3_args("debugmodel")
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads) == (256, 6, 16, 16)


def test_flops_per_token_counts_matmul_weights_and_attention():
    args = llama3_args("8B")
    non_embedding = 8_030_261_248 - 128256 * 4096
    assert args.num_params(exclude_embedding=True) == non_embedding
    assert args.flops_per_token(8192) == 6 * non_embedding + 12 * 32 * 32 * 128 * 8192


def test_flavor_copies_are_independent():
    a = llama3_args("8B", vocab_size=1000)
    a.rope_scaling.factor = 2.0
    assert llama3_args("8B").vocab_size == 128256
    assert llama3_args("8B").rope_scaling.factor == 8.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 100, "n_heads": 3}, "dim=100 must be divisible by n_heads=3"),
        ({"n_heads": 8, "n_kv_heads": 3, "dim": 64}, "n_heads=8 must be divisible by n_kv_heads=3"),
        ({"n_layers": 0}, r"n_layers=0 is not allowed"),
        ({"dim": 24, "n_heads": 8}, "must be even"),
        ({"norm_eps": -1.0}, "norm_eps"),
        ({"rope_scaling": {"low_freq_factor": 4.0, "high_freq_factor": 1.0}}, "high_freq_factor"),
    ],
)
def test_invalid_args_name_the_field(kwargs, match):
    with pytest.raises(ModelConfigError, match=match):
        Llama3Args(**kwargs)


def test_unknown_flavor_lists_the_known_ones():
    with pytest.raises(ModelConfigError, match="'8B'"):
        llama3_args("7B")


def test_rope_scaling_from_a_dict():
    args = Llama3Args(rope_scaling={"factor": 32.0})
    assert args.rope_scaling == RopeScaling(factor=32.0)


def test_unknown_override_is_a_config_error():
    with pytest.raises(ModelConfigError, match="vocab"):
        llama3_args("8B", vocab=5)


def test_flavors_keep_torchtitans_current_llama31_scaling():
    # torchtitan's main scales every Llama 3 flavor ("llama" scaling, factor 8 by default);
    # its July 2025 models did not: that is what rope_scaling="none" is for.
    assert all(args.rope_scaling is not None for args in LLAMA3_FLAVORS.values())
    assert llama3_args("8B").rope_scaling == RopeScaling()


@pytest.mark.parametrize(
    ("flavor", "name", "expected"),
    [
        ("debugmodel", "none", None),
        ("debugmodel", "flavor", RopeScaling()),
        ("debugmodel", "llama3", RopeScaling()),
        ("1B", "llama3", RopeScaling(factor=32.0)),  # the flavor's own factors
        ("1B", "none", None),
    ],
)
def test_rope_scaling_by_name(flavor, name, expected):
    args = llama3_args(flavor, rope_scaling=name)
    assert args.rope_scaling == expected
    assert LLAMA3_FLAVORS[flavor].rope_scaling is not None  # the flavor table is untouched


def test_rope_scaling_names_and_hf_forms():
    assert rope_scaling_of("llama3", None) == RopeScaling()
    hf = {
        "rope_type": "llama3",
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 5e5,  # transformers 5's rope_parameters hold the base too
    }
    assert rope_scaling_of(hf, None) == RopeScaling(factor=16.0)
    assert rope_scaling_of({"rope_type": "default", "rope_theta": 5e5}, RopeScaling()) is None
    with pytest.raises(ModelConfigError, match="'flavor', 'none', 'llama3'"):
        llama3_args("8B", rope_scaling="yes")
    with pytest.raises(ModelConfigError, match="'yarn' is not supported"):
        rope_scaling_of({"rope_type": "yarn", "factor": 4.0}, None)
    with pytest.raises(ModelConfigError, match="Unknown rope_scaling field"):
        Llama3Args(rope_scaling={"factr": 2.0})
