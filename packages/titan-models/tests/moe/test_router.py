"""The router against routing computed by hand on a fixed tiny input: which experts each
token gets and with which weights, for softmax and sigmoid scores, with and without grouped
routing, and with a bias that changes the selection but not the weights. The gate is the
identity, so a token's logits are the token itself and the expected scores are plain
``math.exp`` / sigmoid arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from titan_models.moe import MoEArgs, TokenChoiceTopKRouter


def sigmoid(value: float) -> float:
    return 1.0 / (1.0 + math.exp(-value))


def router_for(logits: list[list[float]], **fields) -> tuple[TokenChoiceTopKRouter, torch.Tensor]:
    num_experts = len(logits[0])
    router = TokenChoiceTopKRouter(num_experts, MoEArgs(num_experts=num_experts, **fields))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))
    return router, torch.tensor(logits)


TOKENS = [
    [2.0, 1.0, 0.0, -1.0],  # top 2: experts 0, 1
    [0.0, 0.25, 3.0, 1.0],  # top 2: experts 2, 3
    [1.0, 0.5, -1.0, 2.0],  # top 2: experts 3, 0 -> listed 0, 3
]


def softmax_weights(token: list[float], experts: list[int]) -> list[float]:
    total = sum(math.exp(v) for v in token)
    return [math.exp(token[e]) / total for e in experts]


def test_softmax_top2():
    router, x = router_for(TOKENS, top_k=2)
    routing = router(x)
    expected = [[0, 1], [2, 3], [0, 3]]
    assert routing.experts.tolist() == expected
    weights = [softmax_weights(t, e) for t, e in zip(TOKENS, expected, strict=True)]
    torch.testing.assert_close(routing.weights, torch.tensor(weights), rtol=1e-6, atol=0)
    assert routing.scores.dtype == torch.float32


def test_bias_changes_the_selection_but_not_the_weights():
    router, x = router_for(TOKENS, top_k=2)
    # +10 on expert 3 puts it in every token's top 2; the weights stay unbiased softmax scores.
    routing = router(x, torch.tensor([0.0, 0.0, 0.0, 10.0]))
    expected = [[0, 3], [2, 3], [0, 3]]
    assert routing.experts.tolist() == expected
    weights = [softmax_weights(t, e) for t, e in zip(TOKENS, expected, strict=True)]
    torch.testing.assert_close(routing.weights, torch.tensor(weights), rtol=1e-6, atol=0)


def test_sigmoid_with_route_norm_and_scale():
    router, x = router_for(TOKENS, top_k=2, score_func="sigmoid", route_norm=True, route_scale=2.5)
    routing = router(x)
    expected = [[0, 1], [2, 3], [0, 3]]
    assert routing.experts.tolist() == expected
    weights = []
    for token, experts in zip(TOKENS, expected, strict=True):
        raw = [sigmoid(token[e]) for e in experts]
        weights.append([2.5 * w / sum(raw) for w in raw])
    torch.testing.assert_close(routing.weights, torch.tensor(weights), rtol=1e-6, atol=0)


def test_sigmoid_top1_without_norm_is_the_raw_score_times_scale():
    router, x = router_for(TOKENS, top_k=1, score_func="sigmoid", route_scale=2.0)
    routing = router(x)
    assert routing.experts.tolist() == [[0], [2], [3]]
    expected = [[2.0 * sigmoid(2.0)], [2.0 * sigmoid(3.0)], [2.0 * sigmoid(2.0)]]
    torch.testing.assert_close(routing.weights, torch.tensor(expected), rtol=1e-6, atol=0)


# 8 experts in 4 groups of 2. Group scores (sum of the group's two sigmoids):
# g0 = s(3) + s(-5) = 0.959, g1 = s(1) + s(0.9) = 1.442, g2 = s(0.6) + s(0.5) = 1.268,
# g3 = 2 s(-5) = 0.013. The best two groups are g1 and g2, so expert 0 (the best single
# score) is out of reach.
GROUPED_TOKEN = [3.0, -5.0, 1.0, 0.9, 0.6, 0.5, -5.0, -5.0]
GROUPED = {"top_k": 2, "score_func": "sigmoid", "n_expert_groups": 4, "n_limited_groups": 2}


@pytest.mark.parametrize(("groups", "expected"), [(1, [0, 2]), (4, [2, 3])])
def test_grouped_routing_keeps_to_the_best_groups(groups, expected):
    fields = {**GROUPED, "n_expert_groups": groups, "n_limited_groups": min(groups, 2)}
    router, x = router_for([GROUPED_TOKEN], **fields)
    routing = router(x)
    assert routing.experts.tolist() == [expected]
    weights = [sigmoid(GROUPED_TOKEN[e]) for e in expected]
    torch.testing.assert_close(routing.weights, torch.tensor([weights]), rtol=1e-6, atol=0)


def test_grouped_routing_ranks_groups_by_biased_scores():
    router, x = router_for([GROUPED_TOKEN], **GROUPED)
    # +1 on expert 5 lifts g2 to 2.268 (best); within g1 and g2 the biased scores rank
    # expert 5 (1.62) and expert 2 (0.73) first. The weights are the unbiased sigmoids.
    bias = torch.zeros(8)
    bias[5] = 1.0
    routing = router(x, bias)
    assert routing.experts.tolist() == [[2, 5]]
    expected = [sigmoid(1.0), sigmoid(0.5)]
    torch.testing.assert_close(routing.weights, torch.tensor([expected]), rtol=1e-6, atol=0)
    # A group of bias alone: +2 on expert 7 makes g3 (2 s(-5) + 2 = 2.013) the best group.
    bias = torch.zeros(8)
    bias[7] = 2.0
    assert router(x, bias).experts.tolist() == [[2, 7]]
