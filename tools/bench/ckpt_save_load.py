"""Checkpoint save and load times of titan-ckpt, next to a raw write of the same bytes.

Starts ``--nproc`` gloo ranks under torchrun, shards a stack of square Linear layers of about
``--size-mb`` MiB (fp32, the whole state) with FSDP2, and measures in the same run:

- raw: every rank writes its shard bytes to one file and fsyncs (the storage's speed);
- dcp.save alone: torch's DCP save of the same state, without the manager (the baseline);
- sync: ``save()`` with async_mode=disabled (DCP write + commit: manifest with checksums,
  ``--checksum``'s algorithm);
- async: time ``save()`` blocks training with async_mode=async, and time until committed;
- pinned: the same for async_mode=async_with_pinned_mem (writer process; the first save, which
  starts that process, is reported separately);
- load: ``load()`` of the newest step, with size checks (and once with checksums);
- side by side, ``--reps`` interleaved repetitions: a plain ``dcp.save`` (no hashing; what
  torchtitan's save does) vs the manager's synchronous save (checksums computed while
  writing, commit marker), with the ratio; the read-back hash a commit used to add; load with
  ``verify_checksums`` off vs on, with the ratio; async blocking time vs a sync save.

    python tools/bench/ckpt_save_load.py                   # 1024 MiB at world size 2
    python tools/bench/ckpt_save_load.py --size-mb 256 --nproc 2 --dir /tmp/ckpt-bench

``--targets`` measures only issue 14's integrity targets, on a Llama 3 model (titan_models)
with its AdamW state, FSDP2-sharded (``tools/bench/ckpt_targets.py``):

    python tools/bench/ckpt_save_load.py --targets --reps 5 --dir /dev/shm/ckpt-bench

Numbers print on rank 0; the folder is deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

DIM = 2048  # one Linear(DIM, DIM) weight = 16 MiB of fp32


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-mb", type=float, default=1024, help="state size in MiB (default 1024)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--dir",
        default=None,
        help="where to write: a new temporary folder is made inside it (default: in the "
        "system's temporary directory), and only that folder is removed afterwards",
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    p.add_argument("--reps", type=int, default=5, help="side-by-side repetitions (default 5)")
    p.add_argument(
        "--targets",
        action="store_true",
        help="only the integrity targets, on a Llama 3 + AdamW state (see ckpt_targets.py)",
    )
    p.add_argument("--llama-dim", type=int, default=512, help="--targets: model width (512)")
    p.add_argument("--llama-layers", type=int, default=6, help="--targets: blocks (6)")
    p.add_argument(
        "--checksum",
        default="auto",
        choices=("auto", "xxh3_128", "sha256"),
        help="--targets: checkpoint.checksum of the integrity-on saves (default auto)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> int:
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    # Always a folder of our own: --keep aside, it is removed afterwards, with nothing else.
    directory = tempfile.mkdtemp(prefix="titan-ckpt-bench-", dir=args.dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(args.nproc), "--master-port", str(port),
        __file__, "--worker", "--size-mb", str(args.size_mb), "--dir", directory,
        "--reps", str(args.reps), "--llama-dim", str(args.llama_dim),
        "--llama-layers", str(args.llama_layers), "--checksum", args.checksum,
        *(["--targets"] if args.targets else []),
    ]  # fmt: skip
    try:
        return subprocess.run(cmd, env={**os.environ, "PYTHONWARNINGS": "ignore"}).returncode
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if args.targets:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ckpt_targets import run_targets

        run_targets(args)
        dist.destroy_process_group()
        return
    bench = Bench(args)
    results = bench.single_runs()
    side = bench.side_by_side()
    bench.sync.close()
    blocked = torch.tensor([results["async save 2: blocked"], results["pinned save 2: blocked"]])
    dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
    results["async save 2: blocked"], results["pinned save 2: blocked"] = blocked.tolist()
    if bench.rank == 0:
        bench.report(results, side)
    dist.destroy_process_group()


class Bench:
    """The sharded model, its managers, and the measurements (every rank runs each)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        self.args, self.dist = args, dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.layers = max(1, round(args.size_mb / (DIM * DIM * 4 / 2**20)))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(DIM, DIM, bias=False) for _ in range(self.layers)])
        for layer in model:
            fully_shard(layer)
        self.model = fully_shard(model)
        self.local = [p.to_local() for p in model.parameters()]
        total = torch.tensor([sum(t.numel() * t.element_size() for t in self.local)])
        dist.all_reduce(total)
        self.total_bytes = int(total)
        self.sync = self.manager("disabled", "sync")

    def timed(self, fn) -> float:
        self.dist.barrier()
        start = time.perf_counter()
        fn()
        self.dist.barrier()
        return time.perf_counter() - start

    def manager(self, mode: str, name: str):
        from titan_ckpt import CheckpointConfig, CheckpointManager

        config = CheckpointConfig(
            enable=True, folder=os.path.join(self.args.dir, name), interval=1, keep_latest_k=0,
            async_mode=mode,
        )  # fmt: skip
        return CheckpointManager(config, model_parts=[self.model])

    def raw_write(self) -> None:
        path = os.path.join(self.args.dir, f"raw-{self.rank}.bin")
        with open(path, "wb") as f:
            for t in self.local:  # the tensor's bytes, without a copy and without numpy
                t = t.contiguous()
                f.write((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
            f.flush()
            os.fsync(f.fileno())

    def plain_dcp(self, name: str, *, hashing: bool = False) -> None:
        """torch's DCP save of the same state, no manager and no hashing (torchtitan's save);
        ``hashing``: through titan's writer, which hashes while writing (and nothing else)."""
        import torch.distributed.checkpoint as dcp

        from titan_ckpt.formats.hashing import HashingFileSystemWriter

        path = os.path.join(self.args.dir, name)
        writer = HashingFileSystemWriter(path) if hashing else None
        dcp.save(self.model.state_dict(), checkpoint_id=path, storage_writer=writer)

    def single_runs(self) -> dict[str, float]:
        results = {"raw write": self.timed(self.raw_write)}
        results["dcp.save alone"] = self.timed(lambda: self.plain_dcp("bare"))
        results["sync save"] = self.timed(lambda: self.sync.save(1))
        for mode, name in (("async", "async"), ("async_with_pinned_mem", "pinned")):
            mgr = self.manager(mode, name)
            for step in (1, 2):  # the first pinned save starts the writer process
                self.dist.barrier()
                start = time.perf_counter()
                mgr.save(step)
                mgr.maybe_wait_for_staging()
                blocked = time.perf_counter() - start
                mgr.wait()
                self.dist.barrier()
                results[f"{name} save {step}: blocked"] = blocked
                results[f"{name} save {step}: until committed"] = time.perf_counter() - start
            mgr.close()
        results["load"] = self.timed(lambda: self.sync.load())
        results["load + checksums"] = self.timed(lambda: self.sync.load(verify_checksums=True))
        return results

    def side_by_side(self) -> dict[str, list[float]]:
        """``--reps`` interleaved pairs (the order alternating): a plain DCP save vs the
        manager's synchronous save (checksums while writing, commit marker); the read-back hash
        an earlier commit did on top; load with checksum verification off vs on."""
        from titan_ckpt import LocalStorage
        from titan_ckpt.layout import hash_files, step_dir

        storage, out = LocalStorage(), {}
        folder = os.path.join(self.args.dir, "sync")
        pairs = {
            "plain dcp.save": lambda i: self.plain_dcp(f"plain-{i}"),
            "dcp.save, hashing writer": lambda i: self.plain_dcp(f"hashing-{i}", hashing=True),
            "sync save, hashing": lambda i: self.sync.save(100 + i, force=True),
        }
        for i in range(self.args.reps):
            for key in list(pairs) if i % 2 == 0 else list(pairs)[::-1]:
                out.setdefault(key, []).append(self.timed(lambda key=key, i=i: pairs[key](i)))
            mine = f"__{self.rank}_"
            directory = step_dir(storage, folder, 100 + i)
            out.setdefault("read-back hash (before)", []).append(
                self.timed(lambda d=directory, m=mine: hash_files(storage, d, prefix=m))
            )
            self.dist.barrier()
            if self.rank == 0:  # keep the disk footprint at one state per kind
                shutil.rmtree(os.path.join(self.args.dir, f"plain-{i}"))
                shutil.rmtree(os.path.join(self.args.dir, f"hashing-{i}"))
                if i:
                    shutil.rmtree(step_dir(storage, folder, 100 + i - 1))
        loads = {
            "load, checksums off": lambda: self.sync.load(verify_checksums=False),
            "load, checksums on": lambda: self.sync.load(verify_checksums=True),
        }
        for i in range(self.args.reps):
            for key in sorted(loads, reverse=i % 2 == 1):
                out.setdefault(key, []).append(self.timed(loads[key]))
        return out

    def report(self, results: dict[str, float], side: dict[str, list[float]]) -> None:
        gib = self.total_bytes / 2**30
        mib = self.total_bytes / 2**20
        print(f"\nstate {mib:.0f} MiB over {self.world} ranks ({self.layers} layers)")
        print(f"{'measure':34s} {'seconds':>8s} {'GiB/s':>7s} {'raw/t':>7s}")
        raw = results["raw write"]
        for key, sec in results.items():
            if "blocked" in key:  # time training waited, not a transfer: no rate
                print(f"{key:34s} {sec:8.3f} {'-':>7s} {'-':>7s}")
            else:
                print(f"{key:34s} {sec:8.3f} {gib / sec:7.2f} {raw / sec:7.2f}")
        med = {k: statistics.median(v) for k, v in side.items()}
        print(f"\nside by side, {self.args.reps} interleaved repetitions (seconds):")
        print(f"{'measure':28s} {'median':>8s} {'min':>8s} {'max':>8s}")
        for key, values in side.items():
            print(f"{key:28s} {med[key]:8.3f} {min(values):8.3f} {max(values):8.3f}")
        ratio = med["sync save, hashing"] / med["plain dcp.save"]
        print(f"\nsync save with integrity / plain dcp.save: {ratio:.2f}x (goal <= 1.1x)")
        ratio = med["dcp.save, hashing writer"] / med["plain dcp.save"]
        print(f"dcp.save, hashing writer / plain dcp.save: {ratio:.2f}x (the hashing alone)")
        before = med["sync save, hashing"] + med["read-back hash (before)"]
        before /= med["plain dcp.save"]
        print(f"  (a save that read its files back to hash them: ~{before:.2f}x)")
        for name in ("async", "pinned"):
            ratio = results[f"{name} save 2: blocked"] / med["sync save, hashing"]
            print(f"{name} save: training blocked / sync save: {ratio:.1%} (goal < 10%)")
        ratio = med["load, checksums on"] / med["load, checksums off"]
        print(f"load with checksums / without: {ratio:.2f}x (goal <= 1.2x)")


if __name__ == "__main__":
    arguments = parse()
    if arguments.worker:
        worker(arguments)
    else:
        sys.exit(launch(arguments))
