"""Checkpoint save and load times of titan-ckpt, next to a raw write of the same bytes.

Starts ``--nproc`` gloo ranks under torchrun, shards a stack of square Linear layers of about
``--size-mb`` MiB (fp32, the whole state) with FSDP2, and measures in the same run:

- raw: every rank writes its shard bytes to one file and fsyncs (the storage's speed);
- dcp.save alone: torch's DCP save of the same state, without the manager (the baseline);
- sync: ``save()`` with async_mode=disabled (DCP write + commit: manifest with sha256);
- async: time ``save()`` blocks training with async_mode=async, and time until committed;
- pinned: the same for async_mode=async_with_pinned_mem (writer process; the first save, which
  starts that process, is reported separately);
- load: ``load()`` of the newest step, with size checks (and once with checksums).

    python tools/bench/ckpt_save_load.py                   # 1024 MiB at world size 2
    python tools/bench/ckpt_save_load.py --size-mb 256 --nproc 2 --dir /tmp/ckpt-bench

Numbers print on rank 0; the folder is deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

DIM = 2048  # one Linear(DIM, DIM) weight = 16 MiB of fp32


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> int:
    directory = args.dir or tempfile.mkdtemp(prefix="titan-ckpt-bench-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(args.nproc), "--master-port", str(port),
        __file__, "--worker", "--size-mb", str(args.size_mb), "--dir", directory,
    ]  # fmt: skip
    try:
        return subprocess.run(cmd, env={**os.environ, "PYTHONWARNINGS": "ignore"}).returncode
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from titan_ckpt import CheckpointConfig, CheckpointManager

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layers = max(1, round(args.size_mb / (DIM * DIM * 4 / 2**20)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    local = [p.to_local() for p in model.parameters()]
    local_bytes = sum(t.numel() * t.element_size() for t in local)
    total = torch.tensor([local_bytes], dtype=torch.int64)
    dist.all_reduce(total)
    total_bytes = int(total)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def raw_write() -> None:
        path = os.path.join(args.dir, f"raw-{rank}.bin")
        with open(path, "wb") as f:
            for t in local:  # the tensor's bytes, without a copy and without numpy
                t = t.contiguous()
                f.write((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
            f.flush()
            os.fsync(f.fileno())

    def manager(mode: str, name: str) -> CheckpointManager:
        config = CheckpointConfig(
            enable=True, folder=os.path.join(args.dir, name), interval=1, keep_latest_k=0,
            async_mode=mode,
        )  # fmt: skip
        return CheckpointManager(config, model_parts=[model])

    def bare_dcp() -> None:
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(args.dir, "bare"))

    results: dict[str, float] = {"raw write": timed(raw_write), "dcp.save alone": timed(bare_dcp)}
    sync = manager("disabled", "sync")
    results["sync save"] = timed(lambda: sync.save(1))

    for mode, name in (("async", "async"), ("async_with_pinned_mem", "pinned")):
        mgr = manager(mode, name)
        for step in (1, 2):  # the first pinned save starts the writer process
            dist.barrier()
            start = time.perf_counter()
            mgr.save(step)
            mgr.maybe_wait_for_staging()
            blocked = time.perf_counter() - start
            mgr.wait()
            dist.barrier()
            results[f"{name} save {step}: blocked"] = blocked
            results[f"{name} save {step}: until committed"] = time.perf_counter() - start
        mgr.close()

    results["load"] = timed(lambda: sync.load())
    results["load + checksums"] = timed(lambda: sync.load(verify_checksums=True))
    sync.close()

    blocked = torch.tensor([results["async save 2: blocked"], results["pinned save 2: blocked"]])
    dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
    results["async save 2: blocked"], results["pinned save 2: blocked"] = blocked.tolist()
    if rank == 0:
        gib = total_bytes / 2**30
        print(f"\nstate {total_bytes / 2**20:.0f} MiB over {world} ranks ({layers} layers)")
        print(f"{'measure':34s} {'seconds':>8s} {'GiB/s':>7s} {'raw/t':>7s}")
        raw = results["raw write"]
        for key, sec in results.items():
            if "blocked" in key:  # time training waited, not a transfer: no rate
                print(f"{key:34s} {sec:8.3f} {'-':>7s} {'-':>7s}")
            else:
                print(f"{key:34s} {sec:8.3f} {gib / sec:7.2f} {raw / sec:7.2f}")
        ratio = results["async save 2: blocked"] / results["sync save"]
        print(f"\nasync blocking / sync save: {ratio:.1%} (goal < 10%)")
        ratio = results["pinned save 2: blocked"] / results["sync save"]
        print(f"pinned blocking / sync save: {ratio:.1%} (goal < 10%)")
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = parse()
    if arguments.worker:
        worker(arguments)
    else:
        sys.exit(launch(arguments))
