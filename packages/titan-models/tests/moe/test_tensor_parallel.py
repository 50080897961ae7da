"""Tensor parallel without expert parallel on 2 gloo ranks (workers/moe_tensor_parallel.py)
against one process: every rank holds 1/tp of each routed and shared expert (their hidden
dimension), its part of the sequence, and computes a partial output that the plan sums over
tp. Output, input gradient, the router's gradient (summed over tp by the plan, the balance
loss's divided by tp) agree to fp32 rounding of the split sums; the experts' gradients and
the token counts exactly; with grouped mm and with the fallback, under activation
checkpointing too. DCP checkpoints of the split layer load into a whole one (one process's
layout) and into a split one."""

from __future__ import annotations

import pytest

CASES = ("grouped_mm", "fallback", "no_shared", "aux_loss")
# Per case: output, each parameter's gradient in parameters() order, the input's gradient,
# the counts, then one entry per split weight (|1/tp - the fraction held|).
NAMES = {
    True: ["output", "router", "w1", "w2", "w3", "shared.w1", "shared.w2", "shared.w3"],
    False: ["output", "router", "w1", "w2", "w3"],
}
# The balance loss's gradient counted tp times moves the router's gradient by ~5e-5 here.
ROUNDING = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("moe_tp")
    return run_torchrun("moe_tensor_parallel.py", 2, out, *CASES, "reshard")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_split_experts_match_one_process(case, results):
    shared = case != "no_shared"
    names = NAMES[shared]
    errors = dict(zip([*names, "input", "counts"], results[case], strict=False))
    held = results[case][len(names) + 2 :]
    # Every expert weight is split (routed: 3, shared: 3), each rank holding exactly 1/tp.
    assert held == [0.0] * (6 if shared else 3)
    for name in ("w1", "w2", "w3", "counts", *(("shared.w1", "shared.w2", "shared.w3"))):
        if name in errors:
            assert errors[name] == 0.0, name
    for name in ("output", "router", "input"):
        assert errors[name] < ROUNDING, (name, errors[name])


@pytest.mark.slow
def test_checkpoint_of_split_experts_loads_whole_and_split(results):
    assert results["reshard"]
    assert all(error == 0.0 for error in results["reshard"])
