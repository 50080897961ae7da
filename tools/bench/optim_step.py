"""Optimizer step time per implementation (for-loop, foreach, fused), side by side.

Builds titan-optim optimizers for a transformer-shaped stack of parameters (per layer: four
d x d attention matrices, two d x 4d MLP matrices, two norms) of about ``--params``
parameters, gives it fixed random gradients, and times ``optimizer.step()`` for each
implementation in one process, so the ratios compare like with like. It justifies the
default ``OptimizerConfig.implementation``.

    python tools/bench/optim_step.py                         # 100M parameters, AdamW
    python tools/bench/optim_step.py --params 20e6 --steps 5 --name SGD

Threads: torch's default (all cores) unless ``--threads``.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch import nn

from titan_optim import OptimizerConfig, build_optimizers

IMPLEMENTATIONS = ("for-loop", "foreach", "fused")


def make_model(params: float, dim: int) -> nn.Module:
    per_layer = 4 * dim * dim + 2 * 4 * dim * dim + 2 * dim
    layers = max(1, round(params / per_layer))
    model = nn.Module()
    for i in range(layers):
        layer = nn.Module()
        for name in ("wq", "wk", "wv", "wo"):
            layer.register_parameter(name, nn.Parameter(torch.empty(dim, dim)))
        layer.register_parameter("w1", nn.Parameter(torch.empty(4 * dim, dim)))
        layer.register_parameter("w2", nn.Parameter(torch.empty(dim, 4 * dim)))
        layer.register_parameter("attention_norm", nn.Parameter(torch.ones(dim)))
        layer.register_parameter("ffn_norm", nn.Parameter(torch.ones(dim)))
        model.add_module(str(i), layer)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return model


def time_steps(args: argparse.Namespace, implementation: str) -> tuple[float, torch.Tensor]:
    model = make_model(args.params, args.dim)
    config = OptimizerConfig(name=args.name, implementation=implementation, momentum=0.9)
    optimizers = build_optimizers(model, config)
    for _ in range(args.warmup):
        optimizers.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        optimizers.step()
    seconds = (time.perf_counter() - start) / args.steps
    sample = next(iter(model.parameters())).detach()[:4, :4].clone()
    del optimizers, model
    gc.collect()
    return seconds, sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=100e6, help="model size (parameters)")
    parser.add_argument("--dim", type=int, default=768, help="hidden size of the layers")
    parser.add_argument("--name", default="AdamW", choices=("Adam", "AdamW", "SGD"))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per implementation")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    n = sum(p.numel() for p in make_model(args.params, args.dim).parameters())
    print(
        f"{args.name} step, {n / 1e6:.1f}M fp32 parameters (dim {args.dim}), "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{args.steps} timed steps after {args.warmup} warmup"
    )
    results = {impl: time_steps(args, impl) for impl in IMPLEMENTATIONS}
    fastest = min(s for s, _ in results.values())
    print(f"{'implementation':<16}{'ms/step':>10}{'x fastest':>11}{'GB/s':>8}")
    # An Adam step reads param, grad, exp_avg, exp_avg_sq and writes three: ~7 x 4 bytes.
    traffic = n * 4 * (7 if args.name != "SGD" else 5)
    for impl, (seconds, _) in results.items():
        print(
            f"{impl:<16}{seconds * 1e3:>10.1f}{seconds / fastest:>11.2f}"
            f"{traffic / seconds / 1e9:>8.1f}"
        )
    ref = results["for-loop"][1]
    drift = max((s - ref).abs().max().item() for _, s in results.values())
    print(f"max parameter difference between implementations: {drift:.2e}")


if __name__ == "__main__":
    main()
