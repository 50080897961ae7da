"""parallelize_llama: impossible layouts fail before any work; activation checkpointing
leaves gradients unchanged; and under torchrun (gloo, 2 and 4 ranks) FSDP, HSDP, DDP, TP and
FSDP+TP, context parallel (alone, with FSDP, with TP) and pipelines (each schedule, with
FSDP, with TP) train to the same per-step losses as one process on the same model and data;
our context-parallel attention has the gradients of plain attention."""

from __future__ import annotations

import pytest
import torch

from titan_dims import ParallelDims
from titan_models import (
    ActivationCheckpointConfig,
    ConfigError,
    Llama3,
    ParallelizeConfig,
    check_parallelism,
    parallelize_llama,
)


@pytest.mark.parametrize(
    ("degrees", "seq_len", "match"),
    [
        ({"world_size": 8, "tp": 4}, 32, "tp=4 must divide n_kv_heads=2"),
        ({"world_size": 8, "tp": 8}, 32, "tp=8 must divide n_heads=4"),
        ({"world_size": 8, "tp": 2}, 30, r"seq_len=30 must be divisible by 4 \(tp=2 x cp=1"),
        ({"world_size": 4, "dp_replicate": 2, "dp_shard": 1, "tp": 2}, 32, "use HSDP instead"),
        ({"world_size": 8, "cp": 2, "tp": 2}, 36, r"seq_len=36 must be divisible by 8"),
        ({"world_size": 8, "ep": 2}, 32, "dense model without experts"),
    ],
)
def test_impossible_layouts_fail_before_any_work(tiny, degrees, seq_len, match):
    dims = ParallelDims(**degrees)
    with torch.device("meta"):
        model = Llama3(tiny.tiny_args())
    before = dict(model.named_parameters())
    # No process group exists here: reaching for a mesh would raise a different error.
    with pytest.raises(ConfigError, match=match):
        parallelize_llama(model, dims, ParallelizeConfig(), seq_len=seq_len)
    assert dict(model.named_parameters()).keys() == before.keys()
    with pytest.raises(ConfigError, match=match):
        check_parallelism(tiny.tiny_args(), dims, ParallelizeConfig(), seq_len=seq_len)


def _grads(tiny, ac: ActivationCheckpointConfig) -> tuple[float, dict[str, torch.Tensor]]:
    model = Llama3(tiny.tiny_args())
    model.load_state_dict(tiny.reference_state_dict())
    parallelize_llama(
        model, ParallelDims(world_size=1), ParallelizeConfig(activation_checkpoint=ac)
    )
    inputs, labels = tiny.batches()
    loss = tiny.cross_entropy(model(inputs[0]), labels[0])
    loss.backward()
    grads = {
        n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()
    }
    return loss.item(), grads


def test_cpu_offload_without_fsdp_is_rejected(tiny):
    with pytest.raises(ConfigError, match="cpu_offload=True offloads FSDP"):
        check_parallelism(
            tiny.tiny_args(),
            ParallelDims(world_size=2, tp=2),
            ParallelizeConfig(cpu_offload=True),
        )


@pytest.mark.parametrize(
    ("mode", "option", "wrapped"),
    [("full", "2", 2), ("selective", "2", 1), ("selective", "op", 2)],
)
def test_activation_checkpointing_keeps_loss_and_gradients(tiny, mode, option, wrapped):
    ac = ActivationCheckpointConfig(mode=mode, selective_option=option)
    loss, grads = _grads(tiny, ac)
    ref_loss, ref_grads = _grads(tiny, ActivationCheckpointConfig())
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    model = Llama3(tiny.tiny_args())
    parallelize_llama(
        model, ParallelDims(world_size=1), ParallelizeConfig(activation_checkpoint=ac)
    )
    is_wrapped = [
        "_checkpoint_wrapped_module" in type(b).__name__ or hasattr(b, "_checkpoint_wrapped_module")
        for b in model.layers.values()
    ]
    assert sum(is_wrapped) == wrapped
    # Checkpoints keep the plain names.
    assert set(model.state_dict()) == set(Llama3(tiny.tiny_args()).state_dict())


# One torchrun launch per world size runs every layout; each layout is its own test.
TWO_RANKS = [
    "fsdp",
    "fsdp_ac_op",
    "fsdp_offload",
    "ddp",
    "tp",
    "tp_replicated_logits",
    "pp_gpipe",
    "pp_1f1b",
    "pp_interleaved_1f1b",
    "pp_interleaved_zb",
    "pp_zbv",
    "pp_csv",
    "cp",
]
FOUR_RANKS = ["hsdp", "fsdp_tp", "pp_fsdp", "pp_tp", "pp_tp_loss_parallel", "fsdp_cp", "tp_cp"]

# Losses agree to float32 rounding of different reduction orders, not bitwise.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}


@pytest.fixture(scope="module")
def single_process_losses(tiny):
    """Per-step losses of one process: 2 blocks, and 4 for the pipeline layouts."""
    return {2: tiny.train_single_process(2), 4: tiny.train_single_process(4)}


@pytest.fixture(scope="module")
def two_rank_losses(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("two")
    return run_torchrun("parallel_train.py", 2, out, *TWO_RANKS, "cp_attention")


@pytest.fixture(scope="module")
def four_rank_losses(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("four")
    return run_torchrun("parallel_train.py", 4, out, *FOUR_RANKS, "cp_attention")


def _expected(layout: str, single_process_losses: dict[int, list[float]]) -> list[float]:
    return single_process_losses[4 if layout.startswith("pp") else 2]


@pytest.mark.parametrize("layout", TWO_RANKS)
def test_two_rank_layout_matches_single_process(layout, two_rank_losses, single_process_losses):
    expected = _expected(layout, single_process_losses)
    assert expected[-1] < expected[0]
    torch.testing.assert_close(two_rank_losses[layout], expected, **TOLERANCE)


@pytest.mark.parametrize("layout", FOUR_RANKS)
def test_four_rank_layout_matches_single_process(layout, four_rank_losses, single_process_losses):
    expected = _expected(layout, single_process_losses)
    torch.testing.assert_close(four_rank_losses[layout], expected, **TOLERANCE)


@pytest.mark.parametrize("ranks", [2, 4])
def test_context_parallel_attention_matches_plain_attention(ranks, request):
    """Output and q/k/v gradients (float64, GQA, load-balanced shards) equal plain causal
    attention over the whole sequence, on 2 and 4 context-parallel ranks."""
    losses = request.getfixturevalue("two_rank_losses" if ranks == 2 else "four_rank_losses")
    out_error, dq_error, dk_error, dv_error = losses["cp_attention"]
    assert max(out_error, dq_error, dk_error, dv_error) < 1e-12


def test_compile_option_compiles_each_block_in_place(tiny):
    """Compilation itself is lazy (first forward) and too slow for CI on CPU; this checks
    that every block is set up for it and that no parameter name changes."""
    model = Llama3(tiny.tiny_args())
    names = set(dict(model.named_parameters()))
    parallelize_llama(model, ParallelDims(world_size=1), ParallelizeConfig(compile=True))
    assert all(block._compiled_call_impl is not None for block in model.layers.values())
    assert model._compiled_call_impl is None
    assert set(dict(model.named_parameters())) == names
