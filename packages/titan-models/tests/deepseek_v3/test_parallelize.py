"""parallelize_deepseek_v3 and pipeline_deepseek_v3: impossible layouts fail before any work
(check_deepseek_v3, no process group); under torchrun (gloo, 2 and 4 ranks) FSDP, expert
parallel (alone, with activation checkpointing, with per-block compile, with FSDP over
dp_shard_mod_ep, with tensor
parallel, with pipeline stages, under HSDP), tensor parallel, context parallel and a
pipeline train a tiny DeepSeek-V3 to the per-step losses of one process, with the experts'
bias update after each step: the biases and the experts' load (tokens counted on each rank,
summed over dp x cp) equal one process's too."""

from __future__ import annotations

import pytest
import torch

from titan_dims import ParallelDims
from titan_models import ModelConfigError, ParallelizeConfig
from titan_models.deepseek_v3 import DeepSeekV3Args, check_deepseek_v3

TWO_RANKS = ("fsdp", "ep", "ep_ac", "tp", "cp", "pp")
# Per-block compile runs in a launch of its own, `full`: compile on CPU costs ~25-50 s cold;
# per-block compile is proven in llama3's test_compile_compiles_each_block_and_matches_eager.
COMPILED = ("ep_compile",)
FOUR_RANKS = ("ep_fsdp", "ep_tp", "ep_pp", "hsdp_ep")
REFERENCES = ("single", "single_5")
BATCH, SEQ, TOP_K = 4, 32, 2  # workers/deepseek_train.py
# Losses agree to float32 rounding of different reduction orders, not bitwise.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}


def small(**overrides) -> DeepSeekV3Args:
    fields = dict(
        vocab_size=256, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=3, n_heads=4,
        n_routed_experts=4, n_activated_experts=2, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_seq_len=32,
    )  # fmt: skip
    return DeepSeekV3Args(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("degrees", "args", "config", "match"),
    [
        ({"world_size": 2, "dp_shard": 2, "ep": 2}, {"n_layers": 1}, {}, "no MoE block"),
        (
            {"world_size": 2, "cp": 2, "dp_shard": 1},
            {},
            {"cp_attention": "titan_ring"},
            r"different head sizes \(24 and 16\); set parallelize.cp_attention='titan'",
        ),
    ],
)
def test_impossible_layouts_fail_before_any_work(degrees, args, config, match):
    """DeepSeek-V3's own rules beside the shared ones (tests/parallel/test_rules.py): dense
    blocks only have no experts, and MLA runs titan's all-gather attention only."""
    dims = ParallelDims(device_type="cpu", **degrees)
    with pytest.raises(ModelConfigError, match=match):
        check_deepseek_v3(small(**args), dims, ParallelizeConfig(**config), seq_len=32)


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("two")
    return run_torchrun("deepseek_train.py", 2, out, *REFERENCES, *TWO_RANKS)


@pytest.fixture(scope="module")
def two_rank_compiled(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("two_compiled")
    return run_torchrun("deepseek_train.py", 2, out, "single", "ep", *COMPILED)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("four")
    return run_torchrun("deepseek_train.py", 4, out, *REFERENCES, *FOUR_RANKS)


def _expected_tp_shapes(whole: dict[str, list[int]], tp: int) -> dict[str, list[int]]:
    """Expert weight shapes of one of ``tp`` ranks when tensor parallel splits every expert's
    hidden dimension: w1 and w3 (E, dim, hidden) on dim 2, w2 (E, hidden, dim) on dim 1."""
    split = {}
    for name, shape in whole.items():
        hidden = 1 if name.endswith("w2") else 2
        split[name] = [n // tp if i == hidden else n for i, n in enumerate(shape)]
    return split


def _check(results: dict, layout: str) -> None:
    reference = "single_5" if "pp" in layout else "single"
    expected = results[reference]
    assert expected[-1] < expected[0]
    torch.testing.assert_close(results[layout], expected, **TOLERANCE)
    # AdamW would hide a wrongly scaled gradient (e.g. experts' divided by the wrong degree).
    torch.testing.assert_close(
        results[f"{layout}.grad_norms"], results[f"{reference}.grad_norms"], rtol=1e-4, atol=0
    )
    # Every bias moved, by the same steps as in one process (rank 0's stages' layers).
    bias, expected_bias = results[f"{layout}.bias"], results[f"{reference}.bias"]
    assert bias
    assert all(value > 0 for value in bias.values())
    assert bias == {name: expected_bias[name] for name in bias}
    # The last step's tokens, counted on each rank and summed over dp x cp: each layer saw
    # every token of the batch twice (top-2), once; torch's pipeline metadata forward and
    # activation checkpointing's recomputation are not counted.
    load, expected_load = results[f"{layout}.load"], results[f"{reference}.load"]
    counted = {k: v for k, v in load.items() if k.startswith("counted/")}
    assert counted
    assert set(counted.values()) == {BATCH * SEQ * TOP_K}
    if layout == "tp":
        # Each tp rank holds 1/tp of every routed and shared expert (not a replica).
        whole = results[f"{reference}.expert_shapes"]
        assert len(whole) == 2 * 2 * 3  # two MoE blocks, routed and shared, w1 w2 w3
        assert results[f"{layout}.expert_shapes"] == _expected_tp_shapes(whole, 2)
    if "pp" not in layout:
        # The shares per expert: a router near-tie may send one token elsewhere under another
        # reduction order (1 of 256 slots: 0.004 of a share).
        torch.testing.assert_close(load, expected_load, rtol=0, atol=1e-2)


@pytest.mark.parametrize(
    "layout", [*TWO_RANKS, *(pytest.param(n, marks=pytest.mark.full) for n in COMPILED)]
)
def test_two_rank_layout_matches_single_process(layout, request):
    _check(
        request.getfixturevalue("two_rank_compiled" if layout in COMPILED else "two_rank"), layout
    )


@pytest.mark.parametrize("layout", FOUR_RANKS)
def test_four_rank_layout_matches_single_process(layout, four_rank):
    _check(four_rank, layout)


@pytest.mark.full  # COMPILED
def test_compiled_blocks_ran_inductor_code(two_rank_compiled):
    """Per-block compile with expert parallel: compiled code ran in every step (its losses
    equal one eager process: test_two_rank_layout_matches_single_process)."""
    assert two_rank_compiled["ep_compile.compiled_calls"] >= 3 * 3  # 3 blocks x 3 steps, at least
    assert two_rank_compiled["ep.compiled_calls"] == 0
