"""MoE layer speed by expert implementation: grouped matmuls, the per-expert fallback, and a
per-expert Python loop over unsorted tokens (transformers' eager way), side by side.

Times forward + backward of one ``titan_models.moe.MoE`` layer (router, experts, shared
expert) in one process, with the same weights and tokens for all three, taking turns step
by step (medians shown), on a few shapes:
``tiny``, ``debug`` (DeepSeek-V3 debugmodel's MoE: dim 256, 8 experts of 256, top 3, 2
shared) and ``debug-64e`` (the same width with 64 experts, top 6, as in the 16B model). It
also checks that the three agree before timing. ``grouped_mm`` is reported as unavailable
where ``torch._grouped_mm`` does not run for the device and dtype (the layer then falls
back itself).

    python tools/bench/moe_experts.py                       # all shapes, 4096 tokens
    python tools/bench/moe_experts.py --shapes debug --tokens 16384 --threads 2

Threads: torch's default (all cores) unless ``--threads``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional

from titan_models.moe import MoE, MoEArgs, grouped_mm_supported

# name -> (dim, expert hidden dim, MoEArgs fields)
SHAPES = {
    "tiny": (64, 64, {"num_experts": 8, "top_k": 2, "num_shared_experts": 1}),
    "debug": (256, 256, {"num_experts": 8, "top_k": 3, "num_shared_experts": 2}),
    "debug-64e": (256, 256, {"num_experts": 64, "top_k": 6, "num_shared_experts": 2}),
}


def per_expert_loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer with its experts run one at a time over the tokens that chose them, found
    by a mask on the unsorted routing (no sort, no grouped call)."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = moe.router(tokens, moe.expert_bias)
    out = torch.zeros_like(tokens)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for expert in routing.experts.unique().tolist():
        token_index, slot = torch.where(routing.experts == expert)
        rows = tokens[token_index]
        hidden = functional.silu(rows @ w1[expert]) * (rows @ w3[expert])
        weighted = (hidden @ w2[expert]) * routing.weights[token_index, slot, None]
        out = out.index_add(0, token_index, weighted.to(out.dtype))
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(tokens)
    return out.view_as(x)


def make_layer(dim: int, hidden: int, fields: dict, use_grouped_mm: bool) -> MoE:
    moe = MoE(MoEArgs(use_grouped_mm=use_grouped_mm, **fields), dim=dim, hidden_dim=hidden)
    torch.manual_seed(0)
    moe.init_weights(init_std=0.02)
    return moe


def time_interleaved(steps: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict:
    """Median seconds per call of each step, the steps taking turns (one call each per
    round) so that a load that comes and goes on a shared machine falls on all alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_shape(name: str, args: argparse.Namespace) -> None:
    dim, hidden, fields = SHAPES[name]
    torch.manual_seed(1)
    x = torch.randn(1, args.tokens, dim)
    grad = torch.randn_like(x)
    layers = {
        "grouped_mm": make_layer(dim, hidden, fields, True),
        "fallback": make_layer(dim, hidden, fields, False),
        "python_loop": make_layer(dim, hidden, fields, False),
    }
    run = {
        "grouped_mm": layers["grouped_mm"],
        "fallback": layers["fallback"],
        "python_loop": lambda t: per_expert_loop(layers["python_loop"], t),
    }
    if not grouped_mm_supported(x.device.type, x.dtype):
        del run["grouped_mm"]
    with torch.no_grad():
        outputs = {impl: forward(x) for impl, forward in run.items()}
    first = next(iter(outputs.values()))
    drift = max((out - first).abs().max().item() for out in outputs.values())

    def step_of(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            out = forward(x)
            out.backward(grad)
            return out

        return step

    steps = {impl: step_of(forward) for impl, forward in run.items()}
    seconds = time_interleaved(steps, args.steps, args.warmup)
    best = min(seconds.values())
    for impl in layers:
        if impl not in seconds:
            print(f"{name:<11}{impl:<13}{'unavailable for this device and dtype':>30}")
            continue
        s = seconds[impl]
        print(f"{name:<11}{impl:<13}{s * 1e3:>9.1f}{args.tokens / s:>11.0f}{s / best:>8.2f}")
    print(f"{'':<11}(outputs agree to {drift:.1e})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (the median is shown)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"MoE layer forward + backward, {args.tokens} tokens, fp32, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'shape':<11}{'experts':<13}{'ms/step':>9}{'tokens/s':>11}{'x best':>8}")
    for name in args.shapes.split(","):
        bench_shape(name, args)


if __name__ == "__main__":
    main()
