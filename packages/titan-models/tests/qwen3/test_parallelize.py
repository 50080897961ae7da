"""parallelize_qwen3, pipeline_qwen3 and check_qwen3: impossible layouts fail before any work
(check_qwen3, no process group); under torchrun (gloo, 2 and 4 ranks) a tiny dense Qwen3,
tied and untied, trains under FSDP, DDP, HSDP, activation checkpointing, per-block compile,
tensor parallel (loss parallel and replicated logits), FSDP + TP, context parallel
(all-gather and ring) and pipelines (untied; tied alone, with FSDP and with TP), and a tiny
MoE Qwen3 under tensor parallel, expert parallel, EP + FSDP, EP + TP and EP + PP, to the
per-step losses AND gradient norms of one process (workers/qwen3_train.py); tied weights
stay one parameter under every plan."""

from __future__ import annotations

import pytest
import torch

from titan_dims import ParallelDims
from titan_models import ModelConfigError, ParallelizeConfig, PipelineConfig
from titan_models.qwen3 import QWEN3, Qwen3, check_qwen3
from titan_models.qwen3.args import Qwen3Args, qwen3_args

TWO_RANKS = (
    "fsdp_tied", "fsdp_untied", "ddp_tied", "fsdp_ac_tied", "tp_tied",
    "tp_untied",
    "tp_replicated_logits_tied", "cp_tied", "cp_ring_untied", "pp_untied", "pp_tied", "ep_moe",
    "tp_moe",
)  # fmt: skip
# Per-block compile runs in a launch of its own, `full`: compile on CPU costs ~25-50 s cold;
# per-block compile is proven in llama3's test_compile_compiles_each_block_and_matches_eager.
COMPILED = ("fsdp_compile_tied",)
FOUR_RANKS = (
    "hsdp_tied", "fsdp_tp_tied", "fsdp_tp_untied", "pp_fsdp_untied", "pp_fsdp_tied", "pp_tp_tied",
    "ep_fsdp_moe",
    "ep_tp_moe", "ep_pp_moe", "fsdp_tp_moe",
)  # fmt: skip
REFERENCES = ("single_tied", "single_untied", "single_moe")
# Losses agree to float32 rounding of different reduction orders, not bitwise.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}


def small(**overrides) -> Qwen3Args:
    fields = dict(
        dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
        vocab_size=256, max_seq_len=32,
    )  # fmt: skip
    return Qwen3Args(**{**fields, **overrides})


MOE = {"moe_enabled": True, "num_experts": 4, "top_k": 2, "moe_inter_dim": 32}


@pytest.mark.parametrize(
    ("degrees", "match"),
    [
        ({"world_size": 4, "tp": 4}, r"tp=4 must divide n_kv_heads=2.*\[1, 2\]"),
        ({"world_size": 2, "dp_shard": 2, "ep": 2}, "no MoE block .* choose an MoE"),
    ],
)
def test_impossible_layouts_fail_before_any_work(degrees, match):
    """Qwen3's facts for the shared rules (tests/parallel/test_rules.py): its key/value
    heads split too; a dense flavor has no experts."""
    dims = ParallelDims(device_type="cpu", **degrees)
    with pytest.raises(ModelConfigError, match=match):
        check_qwen3(small(), dims, ParallelizeConfig(), seq_len=32)


def test_tied_embeddings_pass_the_pipeline_check():
    """A tied flavor is no longer refused under pipeline parallel: the pipeline keeps its two
    ends one weight (the pp_*_tied layouts below prove the numbers)."""
    assert QWEN3.check_fn is check_qwen3
    dims = ParallelDims(world_size=2, pp=2, device_type="cpu")
    pipeline = {"pipeline_config": PipelineConfig(), "local_batch_size": 4}
    check_qwen3(small(enable_weight_tying=True), dims, ParallelizeConfig(), **pipeline)
    check_qwen3(qwen3_args("0.6B", max_seq_len=32), dims, ParallelizeConfig(), **pipeline)
    check_qwen3(qwen3_args("8B", max_seq_len=32), dims, ParallelizeConfig(), **pipeline)


def test_a_dense_model_has_no_expert_hooks():
    dims = ParallelDims(world_size=1, device_type="cpu")
    with torch.device("meta"):
        dense, moe = Qwen3(small()), Qwen3(small(**MOE))
    assert QWEN3.post_step_fn([dense], dims) is None
    assert QWEN3.metrics_fn([dense]) == {}
    assert QWEN3.post_step_fn([moe], dims) is not None


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("two")
    return run_torchrun("qwen3_train.py", 2, out, *REFERENCES, *TWO_RANKS)


@pytest.fixture(scope="module")
def two_rank_compiled(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("two_compiled")
    return run_torchrun("qwen3_train.py", 2, out, "single_tied", "fsdp_tied", *COMPILED)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("four")
    return run_torchrun("qwen3_train.py", 4, out, *REFERENCES, *FOUR_RANKS)


def _expected_tp_shapes(whole: dict[str, list[int]], tp: int) -> dict[str, list[int]]:
    """Expert weight shapes of one of ``tp`` ranks when tensor parallel splits every expert's
    hidden dimension: w1 and w3 (E, dim, hidden) on dim 2, w2 (E, hidden, dim) on dim 1."""
    split = {}
    for name, shape in whole.items():
        hidden = 1 if name.endswith("w2") else 2
        split[name] = [n // tp if i == hidden else n for i, n in enumerate(shape)]
    return split


def _check(results: dict, layout: str) -> None:
    kind = layout.rsplit("_", 1)[1]
    reference = f"single_{kind}"
    expected = results[reference]
    assert expected[-1] < expected[0]
    torch.testing.assert_close(results[layout], expected, **TOLERANCE)
    # AdamW would hide a wrongly scaled gradient (a tied weight's counted once, or twice).
    torch.testing.assert_close(
        results[f"{layout}.grad_norms"], results[f"{reference}.grad_norms"], rtol=1e-5, atol=0
    )
    if "pp" not in layout:
        assert results[f"{layout}.tied"] is (kind == "tied")
    if layout == "tp_moe":
        # Each tp rank holds 1/tp of every routed and shared expert (not a replica).
        whole = results[f"{reference}.expert_shapes"]
        assert len(whole) == 2 * 3  # two MoE blocks' routed experts (this Qwen3: no shared)
        assert results[f"{layout}.expert_shapes"] == _expected_tp_shapes(whole, 2)


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
    """Per-block compile (dense blocks whole, fullgraph): compiled code ran in every step (its
    losses equal one eager process: test_two_rank_layout_matches_single_process)."""
    assert two_rank_compiled["fsdp_compile_tied.compiled_calls"] >= 2 * 3  # 2 blocks x 3 steps
    assert two_rank_compiled["fsdp_tied.compiled_calls"] == 0
