"""How close ``titan-train estimate`` comes to what real runs need: the debug model and a
~100M-parameter Llama 3 (dim 768, 14 blocks, 12 heads, the shipped 2,048-token vocabulary;
102M parameters), in one process, with full activation checkpointing, on 2 and 4 gloo
ranks with FSDP, 2 with TP, 2 with PP, and a mixture-of-experts model on 2 ranks with EP.

Measured, per rank: the process's peak resident growth (``titan_train.estimate.check``:
``VmHWM`` at the end of step 2, reset just before the model is built, less file-backed and
shared pages, less the anonymous memory held before the build; each run a fresh job, as
``titan-train`` runs it, glibc keeping freed blocks). Estimated: ``peak_resident`` of
``titan_train.estimate.estimate_memory`` for the same command line and rank, in this
process. The estimate's ``peak`` (the tensors' live bytes) is shown beside it.

    python tools/bench/estimate_accuracy.py                  # everything (~15 min, 2 cores)
    python tools/bench/estimate_accuracy.py --model debug --layouts "1 process" "2-rank FSDP"
    python tools/bench/estimate_accuracy.py --gloo-alone 16 4 1   # gloo's buffers, alone
    python tools/bench/estimate_accuracy.py --model 100M --replay-real   # see below
    python tools/bench/estimate_accuracy.py --replay-real --layouts "4-rank FSDP"

``--gloo-alone MiB...``: six all-gathers of that many MiB per rank on 2 gloo ranks (glibc's
thresholds as ``titan-train`` sets them), each rank's resident growth (``RssAnon``) against
the estimate's replay of the same calls (``titan_train.estimate.host``).

``--replay-real``: each rank of each layout (by default the one-process ones), traced: its
resident growth, its every allocation from the build on (``malloc/trace.c``, preloaded,
compiled here with ``cc``; Linux glibc only) replayed on glibc (``malloc/replay.c``, each
traced thread from a thread of its own), then its aligned allocations alone (c10's tensor
blocks, what the estimate replays), and the estimate. Where every allocation replayed lands
near the measured growth and the tensor blocks alone fall as short as the estimate, what it
misses is the runtime's small allocations between the blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys

from titan_models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan_train.config import parse_job_config
from titan_train.estimate import estimate_memory
from titan_train.estimate.check import ranks_environment, spawn_real
from titan_train.trainer.host_memory import allocator_environment

FLAVOR_100M = "bench100M"
_NO_FSDP = ["--parallelism.data_parallel_shard_degree", "1"]
LAYOUTS = {
    "1 process": (1, []),
    "1 process, full AC": (1, ["--parallelize.activation_checkpoint.mode", "full"]),
    "2-rank FSDP": (2, ["--parallelism.data_parallel_shard_degree", "2"]),
    "4-rank FSDP": (4, ["--parallelism.data_parallel_shard_degree", "4"]),
    "2-rank TP": (2, ["--parallelism.tensor_parallel_degree", "2", *_NO_FSDP]),
    "2-rank PP": (2, ["--parallelism.pipeline_parallel_degree", "2", *_NO_FSDP]),
    "2-rank EP (MoE)": (2, ["--model.name", "deepseek_v3",
                            "--parallelism.expert_parallel_degree", "2",
                            "--parallelism.data_parallel_shard_degree", "2"]),
}  # fmt: skip


def register_100m() -> None:
    """A ~100M flavor, registered in this process (and in each rank: spawned ranks import this
    module, whose import registers it)."""
    LLAMA3_FLAVORS.setdefault(
        FLAVOR_100M, Llama3Args(dim=768, n_layers=14, n_heads=12, vocab_size=2048)
    )


register_100m()


def command(flavor: str, seq: int, batch: int, layout: str) -> list[str] | None:
    """``titan-train``'s arguments for ``flavor`` in ``layout`` (two steps); None where the
    layout names its own model (the MoE one) and ``flavor`` is not the debug one."""
    extra = LAYOUTS[layout][1]
    if "--model.name" in extra and flavor != "debugmodel":
        return None  # the MoE model's debug flavor only
    flavor_args = [] if "--model.name" in extra else ["--model.flavor", flavor]
    return [
        *flavor_args, "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
        "--training.steps", "2", "--lr_scheduler.warmup_steps", "1",
        "--metrics.no_enable_tensorboard", *extra,
    ]  # fmt: skip


def compare(flavor: str, seq: int, batch: int, layouts: list[str]) -> list[dict]:
    """Estimate and measured peak resident growth per layout and rank."""
    rows = []
    for name in layouts:
        world, extra = LAYOUTS[name]
        argv = command(flavor, seq, batch, name)
        if argv is None:
            continue
        real = spawn_real([argv], world)[0]
        for rank in range(world):
            estimate = estimate_memory(parse_job_config(argv), world_size=world, rank=rank)
            measured = real[rank]["resident"]
            rows.append(
                {
                    "model": flavor if "--model.name" not in extra else "deepseek_v3 debug",
                    "layout": name,
                    "rank": rank,
                    "live_mib": round(estimate.peak / 2**20, 1),
                    "estimate_mib": round(estimate.peak_resident / 2**20, 1),
                    "measured_mib": round(measured / 2**20, 1),
                    "error_pct": round(100 * (estimate.peak_resident - measured) / measured, 1),
                    "step_simulated": estimate.step_simulated,
                    "estimate_s": estimate.seconds,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"RssAnon:\s+(\d+)", f.read()).group(1)) << 10


def _gloo_rank(rank: int, port: int, nbytes: int, calls: int, out: object) -> None:
    import torch
    import torch.distributed as dist

    from titan_train.trainer.host_memory import reuse_host_memory

    reuse_host_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    shard, full = torch.ones(nbytes // 4), torch.empty(2 * nbytes // 4)
    dist.barrier()
    before = _rss_anon()
    for _ in range(calls):
        dist.all_gather_into_tensor(full, shard)
    dist.barrier()
    out.put((rank, _rss_anon() - before))
    dist.destroy_process_group()


def gloo_alone(mib: float, calls: int = 6) -> dict:
    """``calls`` all-gathers of ``mib`` MiB per rank on 2 gloo ranks: each rank's resident
    growth, and the replay's (each call's flat output in a worker thread, as the estimate
    records it)."""
    import torch.multiprocessing as mp

    from titan_train.estimate.host import GLOO_THREADS, GlooBlock, glibc_high_water

    nbytes = int(mib * 2**20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    with ranks_environment([]):  # glibc's caches as titan-train's ranks start
        mp.start_processes(_gloo_rank, args=(port, nbytes, calls, out), nprocs=2)
    measured = dict(out.get() for _ in range(2))
    blocks = [GlooBlock(1 + call % GLOO_THREADS, call) for call in range(calls)]
    replay = glibc_high_water([e for b in blocks for e in ((b, 2 * nbytes), (b, 0))])
    return {
        "all_gather_mib": mib,
        "calls": calls,
        "measured_mib": [round(measured[r] / 2**20, 1) for r in range(2)],
        "replay_mib": None if replay is None else round(replay / 2**20, 1),
    }


def _build_malloc_tracer(folder: str) -> tuple[str, str]:
    """Compile ``malloc/trace.c`` (an LD_PRELOAD library) and ``malloc/replay.c`` into
    ``folder`` with the system's C compiler; their paths."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).with_name("malloc")
    shim, replayer = os.path.join(folder, "trace.so"), os.path.join(folder, "replay")
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", shim, here / "trace.c", "-lpthread"],
                   check=True)  # fmt: skip
    subprocess.run(["cc", "-O2", "-o", replayer, here / "replay.c", "-lpthread"], check=True)
    return shim, replayer


def _traced_rank(rank: int, nproc: int, port: int, argv: list[str], prefix: str, out) -> None:
    """``check.spawn_real``'s rank (``measure_real``: build, two steps, close), every
    allocation from the build to the close recorded into ``prefix.RANK`` by the preloaded
    ``trace.c``; puts ``(rank, {"resident": ...})``."""
    import ctypes

    import titan_train.trainer.build as building
    from titan_train.estimate import check

    shim = ctypes.CDLL(os.environ["LD_PRELOAD"])
    build, close = building.build, building.close

    def traced_build(*args: object, **kwargs: object) -> object:
        shim.trace_start(f"{prefix}.{rank}".encode())  # where measure_real's window opens
        return build(*args, **kwargs)

    def traced_close(*args: object, **kwargs: object) -> object:
        try:
            return close(*args, **kwargs)
        finally:
            shim.trace_stop()  # before the rank exits: every thread's records written

    building.build, building.close = traced_build, traced_close
    check._rank_main(rank, nproc, port, argv, False, out)


def replay_real(flavor: str, seq: int, batch: int, layout: str) -> list[dict]:
    """Each rank of ``flavor`` in ``layout``, traced: its resident growth, every allocation
    replayed on glibc (each traced thread from a thread of its own), its tensor blocks alone
    (what the estimate replays), and the estimate: what the estimate misses that is not in
    the tensors."""
    import subprocess
    import tempfile

    import torch.multiprocessing as mp

    world, extra = LAYOUTS[layout]
    argv = command(flavor, seq, batch, layout)
    assert argv is not None
    rows = []
    with tempfile.TemporaryDirectory() as folder, socket.socket() as s:
        shim, replayer = _build_malloc_tracer(folder)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        out = mp.get_context("spawn").SimpleQueue()
        prefix = os.path.join(folder, "trace")
        with ranks_environment(argv):  # glibc's caches as titan-train's ranks start
            os.environ["LD_PRELOAD"] = shim  # the ranks' processes only: this one is running
            mp.start_processes(_traced_rank, args=(world, port, argv, prefix, out),
                               nprocs=world, start_method="spawn")  # fmt: skip
        measured = {rank: result["resident"] for rank, result in (out.get() for _ in range(world))}
        mib = 2**20
        for rank in range(world):
            replayed = {
                which: float(subprocess.run([replayer, f"{prefix}.{rank}", which], check=True,
                                            capture_output=True, text=True,
                                            env=allocator_environment()).stdout)
                for which in ("all", "aligned")
            }  # fmt: skip
            estimate = estimate_memory(parse_job_config(argv), world_size=world, rank=rank)
            rows.append(
                {
                    "model": flavor if "--model.name" not in extra else "deepseek_v3 debug",
                    "layout": layout,
                    "rank": rank,
                    "measured_resident_mib": round(measured[rank] / mib, 1),
                    "every_allocation_replayed_mib": replayed["all"],
                    "tensor_blocks_replayed_mib": replayed["aligned"],
                    "estimate_mib": round(estimate.peak_resident / mib, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["debug", "100M", "both"], default="both")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--gloo-alone", nargs="+", type=float, metavar="MIB")
    parser.add_argument("--replay-real", action="store_true")
    args = parser.parse_args()
    if args.replay_real:
        layouts = args.layouts if "--layouts" in sys.argv else ["1 process", "1 process, full AC"]
        for flavor in {"debug": ["debugmodel"], "100M": [FLAVOR_100M]}.get(
            args.model, ["debugmodel", FLAVOR_100M]
        ):
            for layout in layouts:
                if command(flavor, args.seq, args.batch, layout) is not None:
                    replay_real(flavor, args.seq, args.batch, layout)
        return
    if args.gloo_alone:
        for mib in args.gloo_alone:
            print(json.dumps(gloo_alone(mib)), flush=True)
        return
    flavors = {"debug": ["debugmodel"], "100M": [FLAVOR_100M]}.get(
        args.model, ["debugmodel", FLAVOR_100M]
    )
    rows = [r for flavor in flavors for r in compare(flavor, args.seq, args.batch, args.layouts)]
    print(
        "\n| model | layout | rank | tensors' peak (MiB) | estimate: peak resident (MiB) "
        "| measured resident growth (MiB) | error |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['layout']} | {r['rank']} | {r['live_mib']} | "
            f"{r['estimate_mib']} | {r['measured_mib']} | {r['error_pct']:+.1f}% |"
        )


if __name__ == "__main__":
    main()
