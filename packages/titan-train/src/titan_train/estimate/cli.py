"""``titan-train estimate``: one rank's memory for a training run of any layout and world size,
in seconds, in this process, without the memory.

    titan-train estimate --world-size 8 --parallelism.data_parallel_shard_degree 8
    titan-train estimate --job.config_file run.toml --world-size 512 --rank 17 --json
    titan-train estimate --model.flavor 8B --vocab-size 128256 --world-size 64 \\
        --parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 2

Options of its own (anywhere on the line; --world_size and --vocab_size work too):
  --world-size N     ranks of the run (default: the product of the parallel degrees given)
  --rank R           the rank to estimate (default 0); under pipeline parallelism the rank
                     picks the stage(s), which the output names
  --vocab-size V     the model's vocabulary instead of the tokenizer's (e.g. 128256 for
                     Llama 3's tokenizer when its file is not at hand)
  --json             one JSON document instead of the table
Progress (a line per phase: checking, building the model, simulating the step) goes to
stderr; the table or JSON document alone to stdout. Besides the tensors' peak, the table
gives what runs out: on the CPU the process's peak resident memory (plus the host allocator
and runtime overhead), on an accelerator the caching allocator's peak reserved bytes.
Every other option is train's (below): the same TOML files and --section.key flags. The
configuration is checked as a real run checks it (same errors, exit status 2, before any
work); layouts an estimate cannot simulate (fault tolerance, CPU offload,
optimizer-in-backward) exit 2 too, with the reason. DDP is one replica plus its gradient
buckets. param_dtype "auto" resolves
for this machine's device: give --parallelize.param_dtype bfloat16 to plan a GPU run.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan_train.errors import ConfigError

if TYPE_CHECKING:  # torch and the models load in run_estimate, after its first line
    from titan_train.estimate import MemoryEstimate

__all__ = ["EstimateOptions", "format_table", "parse_estimate_options", "run_estimate"]

_INT_FLAGS = ("--world-size", "--rank", "--vocab-size")


@dataclass(frozen=True)
class EstimateOptions:
    """The estimate's own options; ``train_argv`` is the rest, train's options."""

    world_size: int | None
    rank: int
    vocab_size: int | None
    json: bool
    train_argv: list[str]


def parse_estimate_options(argv: list[str]) -> EstimateOptions:
    """Split ``argv`` into the estimate's own flags and train's; ``ConfigError`` on a bad value."""
    values: dict[str, int] = {}
    as_json, rest = False, []
    it = iter(argv)
    for arg in it:
        name, _, inline = arg.partition("=")
        spelled = "--" + name[2:].replace("_", "-") if name.startswith("--") else name
        if spelled == "--json" and not inline:
            as_json = True
        elif spelled in _INT_FLAGS:
            value = inline or next(it, None)
            if value is None or not value.isdigit():
                raise ConfigError(f"{spelled} needs a whole number >= 0, got {value!r}.")
            values[spelled[2:].replace("-", "_")] = int(value)
        else:
            rest.append(arg)
    if values.get("world_size") == 0:
        raise ConfigError("--world-size=0 is not allowed; it must be >= 1.")
    if values.get("vocab_size") == 0:
        raise ConfigError("--vocab-size=0 is not allowed; it must be >= 1.")
    return EstimateOptions(
        world_size=values.get("world_size"),
        rank=values.get("rank", 0),
        vocab_size=values.get("vocab_size"),
        json=as_json,
        train_argv=rest,
    )


def run_estimate(argv: list[str]) -> int:
    """``titan-train estimate ARGV``: print the estimate; 0 on success (config errors raise)."""
    options = parse_estimate_options(argv)
    asks_help = bool({"-h", "--help"} & set(options.train_argv))
    if asks_help:
        print((__doc__ or "").replace("``", ""))
    else:
        _progress("loading torch and the model code")
    from titan_train.config import parse_job_config
    from titan_train.estimate import estimate_memory

    config = parse_job_config(options.train_argv, prog="titan-train estimate")
    parallelism = config.parallelism
    world_size = options.world_size
    if world_size is None:
        degrees = (
            parallelism.data_parallel_replicate_degree,
            parallelism.data_parallel_shard_degree,
            parallelism.context_parallel_degree,
            parallelism.tensor_parallel_degree,
            parallelism.pipeline_parallel_degree,
        )
        world_size = math.prod(max(1, d) for d in degrees)
    if options.rank >= world_size:
        raise ConfigError(
            f"--rank={options.rank} is outside a world of {world_size} ranks (valid: 0 to "
            f"{world_size - 1})."
        )
    estimate = estimate_memory(
        config,
        world_size=world_size,
        rank=options.rank,
        vocab_size=options.vocab_size,
        progress=_progress,
    )
    print(json.dumps(estimate.to_json(), indent=2) if options.json else format_table(estimate))
    return 0


def _progress(text: str) -> None:
    """One line of progress on stderr (stdout holds the result alone)."""
    print(f"titan-train estimate: {text} ...", file=sys.stderr, flush=True)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def format_table(estimate: MemoryEstimate) -> str:
    """The estimate as a table a person reads."""
    e = estimate
    layout = " ".join(f"{k}={v}" for k, v in e.layout.items() if v > 1) or "one process"
    lines = [
        f"{e.model} {e.flavor}: {e.num_params:,} parameters; {e.world_size} ranks ({layout}); "
        f"rank {e.rank} holds {e.rank_params:,}",
        f"batch {e.local_batch_size} x seq {e.seq_len} per rank, activation checkpointing "
        f"{e.activation_checkpoint}, compute dtype {e.param_dtype}",
    ]
    if e.pipeline_stages is not None:
        lines.append(
            f"pipeline: rank {e.rank} runs stage(s) {e.pipeline_stages} of {e.num_stages}, "
            f"{e.pipeline_microbatches} microbatches per step"
        )
    rows = [
        ("parameters", e.parameters),
        ("gradients", e.gradients),
        ("optimizer state", e.optimizer_state),
        ("buffers", e.buffers),
        ("activations (most at once)", e.activations if e.step_simulated else None),
        ("peak (one step)", e.peak),
        ("host allocator and runtime", e.host_overhead),
        *([("  of it, FSDP fragmentation", e.fragmentation)] if e.fragmentation else []),
        ("peak resident (CPU process)", e.peak_resident),
        ("peak reserved (accelerator)", e.peak_reserved),
    ]
    lines.append("")
    lines += [f"  {name:<28}{'not simulated' if n is None else _gib(n):>14}" for name, n in rows]
    if e.note:
        lines.append(f"\nnote: {e.note}")
    lines.append(f"\nestimated in {e.seconds:.1f} s")
    return "\n".join(lines)
