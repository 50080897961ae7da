"""parallelize_llama: impossible layouts fail before any work; activation checkpointing
leaves gradients unchanged; per-block compile runs every block through inductor with eager's
losses; and under torchrun (gloo, 2 and 4 ranks) FSDP (also compiled), HSDP, DDP, TP and
FSDP+TP, context parallel (alone, with FSDP, with TP; the ring variant alone and with FSDP)
and pipelines (each schedule, with FSDP, with TP) train to the same per-step losses as one
process on the same model and data; FSDP with bf16 compute tracks them within bf16 rounding
and keeps fp32 master weights; our context-parallel attentions (all-gather and ring) have
the gradients of plain attention; torch's context parallel is refused on CPU before any
work."""

from __future__ import annotations

import pytest
import torch

from titan_dims import ParallelDims
from titan_models import ActivationCheckpointConfig, ModelConfigError, ParallelizeConfig
from titan_models.llama3 import Llama3, check_llama, parallelize_llama


@pytest.mark.parametrize(
    ("degrees", "match"),
    [
        ({"world_size": 8, "tp": 4}, "tp=4 must divide n_kv_heads=2"),
        ({"world_size": 8, "ep": 2}, "ep=2: Llama 3 is a dense model without experts; set ep=1"),
    ],
)
def test_impossible_layouts_fail_before_any_work(tiny, degrees, match):
    """Llama 3's facts for the shared rules (tests/parallel/test_rules.py): its key/value
    heads split too, it has no experts; parallelize_llama refuses before touching the model."""
    dims = ParallelDims(**degrees)
    with torch.device("meta"):
        model = Llama3(tiny.tiny_args())
    before = dict(model.named_parameters())
    # No process group exists here: reaching for a mesh would raise a different error.
    with pytest.raises(ModelConfigError, match=match):
        parallelize_llama(model, dims, ParallelizeConfig(), seq_len=32)
    assert dict(model.named_parameters()).keys() == before.keys()
    with pytest.raises(ModelConfigError, match=match):
        check_llama(tiny.tiny_args(), dims, ParallelizeConfig(), seq_len=32)


def test_torch_context_parallel_on_cpu_fails_before_any_work(tiny):
    dims = ParallelDims(world_size=2, cp=2, device_type="cpu")
    config = ParallelizeConfig(cp_attention="torch")
    with torch.device("meta"):
        model = Llama3(tiny.tiny_args())
    attentions = [type(b.attention.inner_attention) for b in model.layers.values()]
    match = r"cp_attention='torch' cannot run on device 'cpu'.*'titan_ring' and 'auto' run on"
    with pytest.raises(ModelConfigError, match=match):
        parallelize_llama(model, dims, config)
    assert [type(b.attention.inner_attention) for b in model.layers.values()] == attentions
    # Without context parallel the choice is irrelevant and accepted.
    check_llama(tiny.tiny_args(), ParallelDims(world_size=1, device_type="cpu"), config)


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
    "cp_ring",
]
# Per-block compile under FSDP runs in a launch of its own, `full`: compile on CPU costs
# ~25-50 s cold. CI compiles with inductor in titan-train's test_compiled_loss.py; per-block
# compile (test_compile_compiles_each_block_and_matches_eager too) runs in `test-full`.
COMPILED = ["fsdp_compile"]
FOUR_RANKS = [
    "hsdp",
    "fsdp_tp",
    "pp_fsdp",
    "pp_tp",
    "pp_tp_loss_parallel",
    "fsdp_cp",
    "fsdp_cp_ring",
    "tp_cp",
]
# Errors of each context-parallel attention against plain attention (see the worker).
CP_ATTENTION_CHECKS = ("cp_attention", "cp_ring_attention")

# Losses agree to float32 rounding of different reduction orders, not bitwise.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}


@pytest.fixture(scope="module")
def single_process_losses(tiny):
    """Per-step losses of one process: 2 blocks, and 4 for the pipeline layouts."""
    return {2: tiny.train_single_process(2), 4: tiny.train_single_process(4)}


@pytest.fixture(scope="module")
def two_rank_losses(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("two")
    return run_torchrun("parallel_train.py", 2, out, *TWO_RANKS, "fsdp_bf16", *CP_ATTENTION_CHECKS)


@pytest.fixture(scope="module")
def two_rank_compiled(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("two_compiled")
    return run_torchrun("parallel_train.py", 2, out, "fsdp", *COMPILED)


@pytest.fixture(scope="module")
def four_rank_losses(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("four")
    return run_torchrun("parallel_train.py", 4, out, *FOUR_RANKS, *CP_ATTENTION_CHECKS)


def _expected(layout: str, single_process_losses: dict[int, list[float]]) -> list[float]:
    return single_process_losses[4 if layout.startswith("pp") else 2]


@pytest.mark.parametrize(
    "layout", [*TWO_RANKS, *(pytest.param(n, marks=pytest.mark.full) for n in COMPILED)]
)
def test_two_rank_layout_matches_single_process(layout, request, single_process_losses):
    two_rank_losses = request.getfixturevalue(
        "two_rank_compiled" if layout in COMPILED else "two_rank_losses"
    )
    expected = _expected(layout, single_process_losses)
    assert expected[-1] < expected[0]
    torch.testing.assert_close(two_rank_losses[layout], expected, **TOLERANCE)


@pytest.mark.parametrize("layout", FOUR_RANKS)
def test_four_rank_layout_matches_single_process(layout, four_rank_losses, single_process_losses):
    expected = _expected(layout, single_process_losses)
    torch.testing.assert_close(four_rank_losses[layout], expected, **TOLERANCE)


@pytest.mark.parametrize(
    ("layout", "ranks", "attention"),
    [
        ("cp", 2, "ContextParallelAttention"),
        ("fsdp_cp", 4, "ContextParallelAttention"),
        ("tp_cp", 4, "ContextParallelAttention"),
        ("cp_ring", 2, "RingContextParallelAttention"),
        ("fsdp_cp_ring", 4, "RingContextParallelAttention"),
        ("fsdp", 2, "CausalAttention"),
    ],
)
def test_cp_attention_choice_is_applied(layout, ranks, attention, request):
    """cp_attention 'auto' on CPU swapped in our all-gather attention, 'titan_ring' the ring
    one, and no CP kept plain attention (the losses match one process:
    test_*_rank_layout_matches_single_process)."""
    losses = request.getfixturevalue("two_rank_losses" if ranks == 2 else "four_rank_losses")
    assert losses[f"{layout}.inner_attention"] == [attention]


@pytest.mark.full  # COMPILED
def test_fsdp_compile_runs_every_block_compiled(two_rank_compiled):
    """Under FSDP each of the 2 blocks ran inductor code in each of the 3 steps (the losses
    equal one eager process: test_two_rank_layout_matches_single_process)."""
    assert two_rank_compiled["fsdp_compile.compiled_calls"] == [2 * 3]
    assert two_rank_compiled["fsdp.compiled_calls"] == [0]


# bf16 keeps 8 significant bits (a relative rounding error up to 2^-9, ~0.002, per operation).
# The loss is a mean over tokens of log-softmax of logits of magnitude ~1, computed from bf16
# activations: its error is a few such roundings, measured ~1e-3 over 3 steps. 1e-2 leaves
# margin and is still well below the loss changes between steps (~0.04 or more).
BF16_LOSS_ATOL = 1e-2


def test_fsdp_bf16_mixed_precision(two_rank_losses, single_process_losses):
    """FSDP with param_dtype bfloat16 and reduce_dtype float32: blocks compute in bf16, the
    sharded parameters and their gradients stay fp32, and the losses fall and track the fp32
    single-process run within bf16 rounding (without being equal to it)."""
    losses, expected = two_rank_losses["fsdp_bf16"], single_process_losses[2]
    assert two_rank_losses["fsdp_bf16.activation_dtypes"] == ["torch.bfloat16"]
    # The RoPE table reaches every block in fp32 (FSDP does not cast block inputs).
    assert two_rank_losses["fsdp_bf16.rope_dtypes"] == ["torch.float32"]
    assert two_rank_losses["fsdp_bf16.param_dtypes"] == ["torch.float32"]
    assert two_rank_losses["fsdp_bf16.grad_dtypes"] == ["torch.float32"]
    assert two_rank_losses["fsdp.activation_dtypes"] == ["torch.float32"]
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, expected, rtol=0, atol=BF16_LOSS_ATOL)
    assert losses != expected


@pytest.mark.parametrize("check", CP_ATTENTION_CHECKS)
@pytest.mark.parametrize("ranks", [2, 4])
def test_context_parallel_attention_matches_plain_attention(ranks, check, request):
    """Output and q/k/v gradients (float64, GQA, load-balanced shards) of our all-gather and
    our ring attention equal plain causal attention over the whole sequence, on 2 and 4
    context-parallel ranks."""
    losses = request.getfixturevalue("two_rank_losses" if ranks == 2 else "four_rank_losses")
    out_error, dq_error, dk_error, dv_error = losses[check]
    assert max(out_error, dq_error, dk_error, dv_error) < 1e-12


def test_compile_compiles_each_block_and_matches_eager(tiny):
    """With compile on, each block's forward runs inductor-compiled code (counted by a backend
    that wraps inductor: one call per block per step), the root module stays eager, parameter
    names do not change, and 3 training steps give eager's losses within fp32 rounding
    (inductor fuses and reorders reductions; measured difference ~5e-7)."""
    backend = tiny.register_counting_backend()
    # Forget code compiled earlier in this process, which this model could reuse uncounted.
    torch._dynamo.reset()
    model = Llama3(tiny.tiny_args())
    names = set(dict(model.named_parameters()))
    parallelize_llama(
        model, ParallelDims(world_size=1), ParallelizeConfig(compile=True, compile_backend=backend)
    )
    assert model._compiled_call_impl is None
    assert set(dict(model.named_parameters())) == names
    model.load_state_dict(tiny.reference_state_dict())
    before = dict(tiny.COMPILED)
    losses = tiny.train_steps(model)
    # Blocks are identical code with identical guards: inductor may share one graph.
    assert 1 <= tiny.COMPILED["graphs"] - before["graphs"] <= len(model.layers)
    assert tiny.COMPILED["calls"] - before["calls"] == len(model.layers) * tiny.STEPS
    torch.testing.assert_close(losses, tiny.train_single_process(), rtol=1e-5, atol=1e-5)
