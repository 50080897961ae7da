"""Llama 3 training-step speed per activation-checkpointing mode and parameter dtype.

Builds a titan-models Llama 3 flavor in one process, applies each activation-checkpointing
mode through ``parallelize_llama`` (one rank: nothing else applies), and times forward +
backward + SGD step on random tokens, reporting tokens/s and achieved GFLOP/s (from
``Llama3Args.flops_per_token``). It justifies the defaults: no activation checkpointing
unless memory runs out, and ``param_dtype="auto"`` (bf16 only where the hardware has it).

    python tools/bench/models_step.py                               # debugmodel, seq 512
    python tools/bench/models_step.py --flavor debugmodel --seq 2048 --dtypes float32

Threads: torch's default (all cores) unless ``--threads``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional

from titan_dims import ParallelDims
from titan_models import ActivationCheckpointConfig, ParallelizeConfig
from titan_models.llama3 import Llama3, llama3_args, parallelize_llama
from titan_models.parallel import cpu_has_fast_bf16

AC_MODES = {
    "none": ActivationCheckpointConfig(),
    "selective-op": ActivationCheckpointConfig(mode="selective", selective_option="op"),
    "selective-2": ActivationCheckpointConfig(mode="selective", selective_option="2"),
    "full": ActivationCheckpointConfig(mode="full"),
}


def time_steps(args: argparse.Namespace, ac: ActivationCheckpointConfig, dtype: str) -> float:
    model_args = llama3_args(args.flavor, max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Llama3(model_args)
    model.init_weights()
    model.to(getattr(torch, dtype))
    parallelize_llama(
        model, ParallelDims(world_size=1), ParallelizeConfig(activation_checkpoint=ac)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, model_args.vocab_size, (args.batch, args.seq + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    return (time.perf_counter() - start) / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel", help="a Llama 3 flavor")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--ac", default=",".join(AC_MODES), help="comma-separated AC modes")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_args = llama3_args(args.flavor, max_seq_len=args.seq)
    flops = model_args.flops_per_token(args.seq)
    tokens = args.batch * args.seq
    print(
        f"Llama 3 {args.flavor}: {model_args.num_params() / 1e6:.1f}M parameters, batch "
        f"{args.batch} x seq {args.seq}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}, CPU bf16 instructions: {cpu_has_fast_bf16()}"
    )
    print(f"{'dtype':<10}{'AC':<14}{'s/step':>9}{'tokens/s':>10}{'GFLOP/s':>9}{'x best':>8}")
    results = {}
    # One discarded run first: the first model built in a process pays one-time costs
    # (allocator growth, kernel selection) that would otherwise count against it.
    time_steps(args, AC_MODES["none"], args.dtypes.split(",")[0])
    for dtype in args.dtypes.split(","):
        for mode in args.ac.split(","):
            results[dtype, mode] = time_steps(args, AC_MODES[mode], dtype)
    best = min(results.values())
    for (dtype, mode), seconds in results.items():
        print(
            f"{dtype:<10}{mode:<14}{seconds:>9.3f}{tokens / seconds:>10.0f}"
            f"{flops * tokens / seconds / 1e9:>9.1f}{seconds / best:>8.2f}"
        )


if __name__ == "__main__":
    main()
