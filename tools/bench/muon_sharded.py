"""Muon on FSDP2-sharded matrices: gather every matrix on every rank, or spread the matrices.

Starts ``--nproc`` gloo ranks under torchrun; each holds ``Shard(0)`` slices of ``--matrices``
fp32 matrices of ``--rows`` x ``--cols`` (fixed random gradients) and times two ways of one
Muon step, interleaved ``--reps`` times:

- gather: every rank all-gathers each update matrix (``full_tensor()``), runs torch's
  Newton-Schulz on all of them and keeps its own rows (titan-optim's path for layouts other
  than a 1-D ``Shard(0)``);
- spread (titan-optim's ``Muon`` on FSDP2 shards): matrix i belongs to rank i mod N; all
  matrices are gathered to their owners at once, each rank orthogonalises its own share, then
  the rows are scattered back (the work is divided, the bytes moved are about the same).

Both keep torch.optim.Muon's momentum and LR arithmetic on the local shard; the run checks
that they give identical parameters.

    python tools/bench/muon_sharded.py                        # 2 ranks, 24 matrices 256 x 256
    python tools/bench/muon_sharded.py --nproc 4 --rows 512 --cols 512 --matrices 16

Numbers print on rank 0 (ms per step, median of the repetitions).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--matrices", type=int, default=24, help="matrices (default 24)")
    p.add_argument("--rows", type=int, default=256, help="rows per matrix (default 256)")
    p.add_argument("--cols", type=int, default=256, help="columns per matrix (default 256)")
    p.add_argument("--reps", type=int, default=5, help="timed steps of each way (default 5)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc-per-node", str(args.nproc), "--master-port", str(port), __file__, "--worker",
        "--matrices", str(args.matrices), "--rows", str(args.rows), "--cols", str(args.cols),
        "--reps", str(args.reps),
    ]  # fmt: skip
    return subprocess.run(cmd, env={**os.environ, "PYTHONWARNINGS": "ignore"}).returncode


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.optim._muon import _adjust_lr

    from titan_optim import Muon
    from titan_optim.muon import orthogonalize

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    shape = (args.rows, args.cols)
    weights = [torch.randn(shape, generator=g) * 0.02 for _ in range(args.matrices)]
    grads = [torch.randn(shape, generator=g) for _ in range(args.matrices)]

    def params() -> list[torch.nn.Parameter]:
        out = []
        for w, gr in zip(weights, grads, strict=True):
            p = torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)], src_data_rank=None))
            p.grad = distribute_tensor(gr, mesh, [Shard(0)], src_data_rank=None)
            out.append(p)
        return out

    kwargs = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}

    @torch.no_grad()
    def gather_step(ps: list[torch.nn.Parameter], bufs: list[torch.Tensor]) -> None:
        # Muon.step with each matrix gathered and iterated on every rank (titan's path for
        # layouts it does not spread).
        group = opt.param_groups[0]
        for p, buf in zip(ps, bufs, strict=True):
            buf.lerp_(p.grad, 1 - kwargs["momentum"])
            update = orthogonalize(p.grad.lerp(buf, kwargs["momentum"]), group)
            p.mul_(1 - kwargs["lr"] * kwargs["weight_decay"])
            p.add_(update, alpha=-_adjust_lr(kwargs["lr"], None, p.shape))

    times: dict[str, list[float]] = {"gather": [], "spread": []}
    gather_ps, spread_ps = params(), params()
    opt = Muon(spread_ps, **kwargs)
    bufs = [torch.zeros_like(p.grad) for p in gather_ps]
    for rep in range(args.reps + 1):  # the first of each is warm-up
        for name in ("gather", "spread"):
            dist.barrier()
            start = time.perf_counter()
            gather_step(gather_ps, bufs) if name == "gather" else opt.step()
            dist.barrier()
            if rep:
                times[name].append(time.perf_counter() - start)
    diff = max(
        (a.to_local() - b.to_local()).abs().max().item()
        for a, b in zip(gather_ps, spread_ps, strict=True)
    )
    if rank == 0:
        gather, spread = (statistics.median(times[k]) * 1e3 for k in ("gather", "spread"))
        print(
            f"Muon step, {args.matrices} matrices {args.rows} x {args.cols} fp32 (Shard(0) over "
            f"{world} gloo ranks, {torch.get_num_threads()} thread(s) each), torch "
            f"{torch.__version__}, median of {args.reps}"
        )
        print(f"{'way':<10}{'ms/step':>10}")
        print(f"{'gather':<10}{gather:>10.1f}")
        print(f"{'spread':<10}{spread:>10.1f}")
        print(f"spread / gather: {spread / gather:.2f}; max parameter difference {diff:.1e}")
    dist.destroy_process_group()


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
