"""How close ``titan-train estimate`` comes to real runs: a ~100M-parameter Llama 3 (dim 768,
14 blocks, 12 heads, the shipped 2,048-token vocabulary; 102M parameters) and the debug
model, in one process and on 2 gloo ranks with FSDP, TP and PP.

The real peak of each rank is the CPU allocator's own count of live bytes (torch's profiler
with ``profile_memory=True``) over building the run with ``titan_train.trainer.build`` and two real
steps of ``titan_train.trainer.step.train_step`` (``titan_train.estimate.check``); the estimate is
``titan_train.estimate.estimate_memory`` of the same command line, in this process.

    python tools/bench/estimate_accuracy.py                    # both models (~5 min, 2 cores)
    python tools/bench/estimate_accuracy.py --model 100M --seq 512 --batch 2
"""

from __future__ import annotations

import argparse
import json

from titan_models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan_train.config import parse_job_config
from titan_train.estimate import estimate_memory
from titan_train.estimate.check import spawn_real_peaks

FLAVOR_100M = "bench100M"
LAYOUTS = {
    "1 process": (1, []),
    "2-rank FSDP": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "2-rank TP": (2, ["--parallelism.tensor_parallel_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1"]),
    "2-rank PP": (2, ["--parallelism.pipeline_parallel_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "1"]),
}  # fmt: skip


def register_100m() -> None:
    """A ~100M flavor, registered in this process (and in each rank: spawned ranks import this
    module, whose import registers it)."""
    LLAMA3_FLAVORS.setdefault(
        FLAVOR_100M, Llama3Args(dim=768, n_layers=14, n_heads=12, vocab_size=2048)
    )


register_100m()


def compare(flavor: str, seq: int, batch: int) -> list[dict]:
    """Estimate and real peak per layout and rank."""
    base = [
        "--model.flavor", flavor, "--training.seq_len", str(seq),
        "--training.local_batch_size", str(batch), "--training.steps", "2",
        "--lr_scheduler.warmup_steps", "1", "--metrics.no_enable_tensorboard",
    ]  # fmt: skip
    real = {"1 process": spawn_real_peaks([base], 1)[0]}
    two = [name for name, (world, _) in LAYOUTS.items() if world == 2]
    peaks = spawn_real_peaks([[*base, *LAYOUTS[name][1]] for name in two], 2)
    real.update(zip(two, peaks, strict=True))
    rows = []
    for name, (world, extra) in LAYOUTS.items():
        for rank in range(world):
            estimate = estimate_memory(
                parse_job_config([*base, *extra]), world_size=world, rank=rank
            )
            measured = real[name][rank]
            rows.append(
                {
                    "model": flavor,
                    "layout": name,
                    "rank": rank,
                    "estimate_mib": round(estimate.peak / 2**20, 1),
                    "real_mib": round(measured / 2**20, 1),
                    "error_pct": round(100 * (estimate.peak - measured) / measured, 1),
                    "estimate_s": estimate.seconds,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["debug", "100M", "both"], default="both")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    flavors = {"debug": ["debugmodel"], "100M": [FLAVOR_100M]}.get(
        args.model, ["debugmodel", FLAVOR_100M]
    )
    rows = [row for flavor in flavors for row in compare(flavor, args.seq, args.batch)]
    print("\n| model | layout | rank | estimate (MiB) | real (MiB) | error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layout']} | {r['rank']} | {r['estimate_mib']} | "
            f"{r['real_mib']} | {r['error_pct']:+.1f}% |"
        )


if __name__ == "__main__":
    main()
