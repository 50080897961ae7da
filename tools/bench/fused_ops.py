"""Eager fused RMSNorm and SwiGLU (``titan_models.fused``) against the plain ops: forward +
backward of each op at the Llama 3 debug model's shapes, then whole training steps of that
model (Llama 3 debugmodel, fp32, ``F.cross_entropy``, AdamW foreach, no compile, no AC)
with its norms plain (``nn.RMSNorm``), fused (``FusedRMSNorm``), and fused plus ``swiglu``
in the feed-forward.

    python tools/bench/fused_ops.py                       # 1 thread, batch 8, ~4 minutes
    python tools/bench/fused_ops.py --batch 4 --step-reps 2

Times are CPU time of this process (``time.process_time``) at one thread, variants
interleaved, the minimum over repetitions: on a machine that others load, wall time says
little. Freed host memory is kept for reuse (``titan_train``'s setting, on by default in
training) unless ``--no-reuse``: without it glibc maps and zeroes every large block anew and
page faults dominate every elementwise op.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional

from titan_models.fused import FusedRMSNorm, rms_norm, swiglu
from titan_models.llama3 import Llama3, llama3_args
from titan_models.llama3.model import FeedForward


def _op_time(fn: Callable, inputs: list[torch.Tensor], grad: torch.Tensor) -> float:
    leaves = [t.detach().requires_grad_() for t in inputs]
    start = time.process_time()
    fn(*leaves).backward(grad)
    return time.process_time() - start


def bench_ops(batch: int, seq: int, reps: int) -> None:
    """Print forward + backward milliseconds of each op, plain and fused."""
    torch.manual_seed(0)
    dim, hidden = 256, 768
    x, w = torch.randn(batch, seq, dim), torch.randn(dim) * 0.1 + 1
    a, b = torch.randn(batch, seq, hidden), torch.randn(batch, seq, hidden)
    cases = {
        f"rms_norm ({batch},{seq},{dim})": (
            [x, w],
            torch.randn_like(x),
            lambda x, w: functional.rms_norm(x, (dim,), w, 1e-5),
            lambda x, w: rms_norm(x, w, 1e-5),
        ),
        f"swiglu ({batch},{seq},{hidden})": (
            [a, b],
            torch.randn_like(a),
            lambda a, b: functional.silu(a) * b,
            swiglu,
        ),
    }
    print(f"{'op fwd+bwd':<28}{'plain ms':>10}{'fused ms':>10}{'fused/plain':>13}")
    for name, (inputs, grad, plain, fused) in cases.items():
        times: dict[str, list[float]] = {"plain": [], "fused": []}
        for _ in range(reps):
            times["plain"].append(_op_time(plain, inputs, grad))
            times["fused"].append(_op_time(fused, inputs, grad))
        p, f = min(times["plain"]) * 1e3, min(times["fused"]) * 1e3
        print(f"{name:<28}{p:>10.1f}{f:>10.1f}{f / p:>13.3f}")


def _swiglu_forward(self: FeedForward, x: torch.Tensor) -> torch.Tensor:
    return self.w2(swiglu(self.w1(x), self.w3(x)))


def _set_variant(model: nn.Module, variant: str) -> None:
    """Switch the model's norms and feed-forwards to ``variant`` in place (same weights)."""
    norm_class = nn.RMSNorm if variant == "plain" else FusedRMSNorm
    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.__class__ = norm_class
        if isinstance(module, FeedForward):
            if variant == "fused+swiglu":
                module.forward = _swiglu_forward.__get__(module)
            else:
                module.__dict__.pop("forward", None)


def bench_steps(batch: int, seq: int, reps: int, variants: list[str]) -> None:
    """Print the CPU seconds of one training step per variant and the gain over plain."""
    torch.manual_seed(0)
    model = Llama3(llama3_args("debugmodel", max_seq_len=seq))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tokens = torch.randint(0, model.args.vocab_size, (batch, seq + 1))

    def step() -> float:
        start = time.process_time()
        logits = model(tokens[:, :-1])
        loss = functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.process_time() - start

    step()  # one-time costs (allocator growth, optimizer state) outside the timing
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(reps):
        # Each repetition starts with another variant: none always runs after the same one.
        for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            _set_variant(model, variant)
            times[variant].append(step())
    header = f"step (batch {batch})"
    print(f"{header:<20}{'CPU s':>8}{'tokens/s':>10}{'gain':>8}{'median gain':>13}")
    plain = min(times.get("plain", [0.0])) or min(min(t) for t in times.values())
    for variant in variants:
        seconds = min(times[variant])
        gain = (plain - seconds) / plain
        median = statistics.median(times[variant])
        plain_median = statistics.median(times.get("plain", [median]))
        median_gain = (plain_median - median) / plain_median
        print(
            f"{variant:<20}{seconds:>8.3f}{batch * seq / seconds:>10.0f}{gain:>8.1%}"
            f"{median_gain:>13.1%}"
        )
    for variant in variants:
        print(f"  {variant} steps (s): " + " ".join(f"{t:.3f}" for t in times[variant]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--op-reps", type=int, default=5, help="repetitions per op")
    parser.add_argument("--step-reps", type=int, default=3, help="steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--no-reuse", action="store_true", help="glibc's malloc defaults")
    parser.add_argument(
        "--variants", default="plain,fused,fused+swiglu", help="comma-separated step variants"
    )
    parser.add_argument("--skip-steps", action="store_true", help="per-op numbers only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.no_reuse:
        from titan_train.trainer.host_memory import reuse_host_memory

        reuse_host_memory()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), CPU time, min")
    bench_ops(args.batch, args.seq, args.op_reps)
    if not args.skip_steps:
        bench_steps(args.batch, args.seq, args.step_reps, args.variants.split(","))


if __name__ == "__main__":
    main()
