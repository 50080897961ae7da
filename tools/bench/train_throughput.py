"""Training throughput of the real ``titan-train`` command: tokens/s and MFU of the Llama 3
debug model (batch 8 x seq 2048, 2,048-token vocabulary) per setting, side by side.

Each setting is one ``titan-train`` run (no checkpoints) of ``--steps`` steps; its tokens/s
is the median of the steps after the first (which pays for warm-up and compilation), read
back from the run's ``metrics.jsonl``. The fp32 matmul peak is measured in this same
process (best 2048^3 product, with 1 and with all threads), so MFU compares with what this
machine does at the moment of the run: a shared machine slows both alike.

    python tools/bench/train_throughput.py                  # every setting (~10 minutes on 2 cores)
    python tools/bench/train_throughput.py --only 1p-none 2p-fsdp-fp32 --steps 4
    python tools/bench/train_throughput.py --compile        # also per-block torch.compile

Settings: one process with torch's default threads (all cores) or 1 thread, activation
checkpointing none / selective-op / full; two FSDP ranks (torchrun: 1 thread each) in fp32,
bf16 parameters (what ``param_dtype="auto"`` picks on CPUs with AVX512-BF16) and with
activation checkpointing; the DeepSeek-V3 debug model (mixture of experts) on two ranks at
expert-parallel degree 1 and 2. MFU per rank = rank tokens/s x training FLOPs per token (the
trainer's count for the model it built; active experts only) / peak of that rank's threads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from titan_models.llama3 import llama3_args
from titan_train.metrics.flops import measure_cpu_matmul_flops

BATCH, SEQ, VOCAB = 8, 2048, 2048
BASE = [
    "--training.local_batch_size", str(BATCH),
    "--training.seq_len", str(SEQ),
    "--checkpoint.no_enable",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_tensorboard",
    "--lr_scheduler.warmup_steps", "1",
]  # fmt: skip
AC = {
    "none": ["--parallelize.activation_checkpoint.mode", "none"],
    "op": [
        "--parallelize.activation_checkpoint.mode", "selective",
        "--parallelize.activation_checkpoint.selective_option", "op",
    ],
    "full": ["--parallelize.activation_checkpoint.mode", "full"],
}  # fmt: skip
FSDP2 = ["--parallelism.data_parallel_shard_degree", "2"]
# Batch 2 per rank: at 8 x 2048 tokens two ranks of it exceed 24 GiB (attention over 16
# heads of 192 channels, the experts' token copies).
DEEPSEEK = [
    "--model.name", "deepseek_v3", "--model.flavor", "debugmodel",
    "--training.local_batch_size", "2",
]  # fmt: skip
EP2 = ["--parallelism.expert_parallel_degree", "2"]
FP32 = ["--parallelize.param_dtype", "float32"]

# name -> (processes, threads per process or None for torch's default, arguments)
SETTINGS: dict[str, tuple[int, int | None, list[str]]] = {
    "1p-none": (1, None, [*FP32, *AC["none"]]),
    "1p-op": (1, None, [*FP32, *AC["op"]]),
    "1p-full": (1, None, [*FP32, *AC["full"]]),
    "1p-none-1thread": (1, 1, [*FP32, *AC["none"]]),
    "2p-fsdp-fp32": (2, 1, [*FSDP2, *FP32, *AC["none"]]),
    "2p-fsdp-fp32-op": (2, 1, [*FSDP2, *FP32, *AC["op"]]),
    "2p-fsdp-bf16": (2, 1, [*FSDP2, "--parallelize.param_dtype", "bfloat16", *AC["none"]]),
    # DeepSeek-V3 debugmodel (8 routed experts, top 3): experts sharded by FSDP, or spread
    # over the two ranks by expert parallelism (tokens travel by all-to-all).
    "2p-dsv3-ep1": (2, 1, [*DEEPSEEK, *FSDP2, *FP32, *AC["none"]]),
    "2p-dsv3-ep2": (2, 1, [*DEEPSEEK, *FSDP2, *EP2, *FP32, *AC["none"]]),
}
COMPILED: dict[str, tuple[int, int | None, list[str]]] = {
    "1p-none-compile": (1, None, [*FP32, *AC["none"], "--parallelize.compile"]),
    "2p-fsdp-bf16-compile": (
        2,
        1,
        [*FSDP2, "--parallelize.param_dtype", "bfloat16", *AC["none"], "--parallelize.compile"],
    ),
}


def run_setting(nproc: int, threads: int | None, args: list[str], steps: int) -> dict:
    """Launch one titan-train run; its median tokens/s per rank and wall seconds."""
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ)
        env.pop("OMP_NUM_THREADS", None)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        command = [
            sys.executable, "-m", "titan_train.cli",
            "--nproc-per-node", str(nproc),
            "--job.dump_folder", folder,
            "--training.steps", str(steps),
            *BASE, *args,
        ]  # fmt: skip
        started = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            return {"error": result.stderr.strip().splitlines()[-1][:200], "wall_s": wall}
        lines = Path(folder, "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        steady = [r for r in records if "tps" in r and r["step"] > 1]
        return {
            "tps": statistics.median(r["tps"] for r in steady),
            # The trainer's own training FLOPs per token of the model it built (tflops / tps).
            "flops_per_token": steady[-1]["tflops"] * 1e12 / steady[-1]["tps"],
            "memory_gib": max(r["memory_gib"] for r in steady),
            "loss": records[-1]["loss"],
            "wall_s": wall,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="steps per run (first discarded)")
    parser.add_argument("--only", nargs="*", help="setting names to run (default: all)")
    parser.add_argument("--compile", action="store_true", help="also per-block torch.compile")
    options = parser.parse_args()
    settings = dict(SETTINGS, **(COMPILED if options.compile else {}))
    if options.only:
        unknown = set(options.only) - settings.keys() - COMPILED.keys()
        if unknown:
            parser.error(f"unknown settings {sorted(unknown)}; choose from {sorted(settings)}")
        settings = {k: v for k, v in {**SETTINGS, **COMPILED}.items() if k in options.only}

    flops_per_token = llama3_args("debugmodel", vocab_size=VOCAB, max_seq_len=SEQ).flops_per_token(
        SEQ
    )
    default_threads = torch.get_num_threads()
    peaks = {}
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        peaks[threads] = measure_cpu_matmul_flops.__wrapped__(seconds=2.0)
    torch.set_num_threads(default_threads)
    print(
        f"Llama 3 debugmodel, batch {BATCH} x seq {SEQ}, vocab {VOCAB}: "
        f"{flops_per_token / 1e6:.1f} MFLOP per token (forward + backward)"
    )
    print(
        "fp32 matmul peak: "
        + ", ".join(f"{peaks[t] / 1e9:.0f} GFLOP/s with {t} thread(s)" for t in sorted(peaks))
    )
    header = f"{'setting':<18} {'procs':>5} {'thr':>3} {'tok/s/rank':>10} {'tok/s all':>9} "
    header += f"{'MFU':>6} {'mem GiB':>7} {'loss':>7} {'wall s':>6}"
    print(header)
    for name, (nproc, threads, args) in settings.items():
        result = run_setting(nproc, threads, args, options.steps)
        rank_threads = threads or default_threads
        if "error" in result:
            print(f"{name:<18} {nproc:>5} {rank_threads:>3} failed: {result['error']}")
            continue
        peak = peaks.get(rank_threads, peaks[default_threads])
        mfu = result["tps"] * result["flops_per_token"] / peak
        print(
            f"{name:<18} {nproc:>5} {rank_threads:>3} {result['tps']:>10,.0f} "
            f"{result['tps'] * nproc:>9,.0f} {100 * mfu:>5.1f}% {result['memory_gib']:>7.2f} "
            f"{result['loss']:>7.3f} {result['wall_s']:>6.0f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
