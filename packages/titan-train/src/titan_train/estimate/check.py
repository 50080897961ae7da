"""Measure the real memory peak of a training run's steps, to check ``titan-train estimate``.

``measure_real_peak(config)`` runs in a process of a real, initialized process group (gloo
on CPU): it builds the run with ``titan_train.trainer.build`` (real tensors, real initialization),
trains two steps with ``titan_train.trainer.step.train_step`` and returns the most bytes the CPU
allocator held at once, read from the allocator itself: torch's profiler with
``profile_memory=True`` records every allocation and free c10's CPU allocator makes while
it runs (``[memory]`` events with signed sizes), so the running sum of those from before
the model is built to after the second step is the memory the run allocated, and its
maximum is the peak. This shares nothing with the estimator (no fake tensors, no
MemTracker): it is what the allocator saw. It counts what the run allocates besides the
model too (the dataloader's buffers, a few KiB to MiB).

``spawn_real_peaks(argvs, nproc)`` starts ``nproc`` gloo ranks on this machine which run
each command line of ``argvs`` in turn (parsed as ``titan-train`` does), and returns each
run's peak per rank.
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from titan_train.config import JobConfig
from titan_train.launch import destroy_group, exit_rank

__all__ = ["measure_real_peak", "spawn_real_peaks"]


def measure_real_peak(config: JobConfig) -> int:
    """The CPU allocator's peak (bytes) over building ``config``'s run and two steps of it,
    in this rank of the initialized process group."""
    from titan_train.preflight import World, preflight
    from titan_train.trainer.build import build, close
    from titan_train.trainer.step import next_batches, train_step

    device = torch.device("cpu")
    plan = preflight(config, World.current(device))
    # A run measured before in this process may still hold tensors in reference cycles; freed
    # inside this window, they would count as negative bytes here (the allocator reports the
    # free of any block allocated while a profiler was on).
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = build(config, plan)
        try:
            for _ in range(2):
                batches, _ = next_batches(run.batches, plan.batches.accumulation_steps, device)
                train_step(run, batches)
                del batches
        finally:
            close(run)
    return _allocator_peak(prof)


def _allocator_peak(prof: Any) -> int:
    """The running maximum of the allocator's live bytes, from its ``[memory]`` events."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _rank_main(rank: int, nproc: int, port: int, argvs: list[list[str]], out: Any) -> None:
    from titan_train.config import parse_job_config

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    try:
        for index, argv in enumerate(argvs):
            with tempfile.TemporaryDirectory() as folder:
                config = parse_job_config(
                    [*argv, "--job.dump_folder", folder, "--checkpoint.no-enable"]
                )
                out.put((index, rank, measure_real_peak(config)))
    finally:
        destroy_group()
    # A plain return would free the gloo group torch's caches still hold during the
    # interpreter's finalization, which now and then aborts the process (see ``exit_rank``)
    # and fails the spawn. The queue is a pipe written without a feeder thread: everything
    # put has been written by now.
    exit_rank(0)


def spawn_real_peaks(argvs: list[list[str]], nproc: int) -> list[list[int]]:
    """Per command line of ``argvs``, each rank's real peak (bytes) of ``titan-train ARGV``
    on ``nproc`` gloo ranks (one job runs them all, one after another)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(
        _rank_main, args=(nproc, port, argvs, out), nprocs=nproc, start_method="spawn"
    )
    peaks = {}
    for _ in range(nproc * len(argvs)):
        index, rank, peak = out.get()
        peaks[index, rank] = peak
    return [[peaks[i, r] for r in range(nproc)] for i in range(len(argvs))]
