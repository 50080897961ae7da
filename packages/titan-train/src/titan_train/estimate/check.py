"""Measure what a real training run needs of memory, to check ``titan-train estimate``.

``measure_real(config)`` runs in a real initialized process group (gloo on CPU), builds the
run with ``titan_train.trainer.build``, trains two steps with ``train_step`` and returns, in
bytes:

- ``resident``: the peak resident growth, what runs out on the CPU: ``VmHWM`` at the end
  (reset by ``/proc/self/clear_refs`` before the model is built) less the file and shared
  pages at the end (libraries, which only grow during a run) less ``RssAnon`` before the
  build. On an accelerator: ``torch.cuda.max_memory_reserved`` (untested, no GPU here).
- ``live`` (``live=True``): the most bytes c10's CPU allocator had live at once, from the
  profiler's memory events, the number ``peak`` models (the profiler adds a few MiB to
  ``resident``).

As the command does, a CPU run's ranks start with glibc's small-block caches off and first
make glibc keep freed blocks (``titan_train.trainer.host_memory``). Nothing is shared with
the estimator.
``spawn_real(argvs, nproc)`` runs each command line as its own ``nproc``-rank gloo job (a
fresh process per run: one run's grown heap would hide the next's) and returns each run's
measurements per rank.
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from titan_train.config import JobConfig
from titan_train.launch import destroy_group, exit_rank

__all__ = ["measure_real", "proc_status", "spawn_real"]


def proc_status() -> dict[str, int]:
    """This process's ``/proc/self/status`` memory lines (``VmHWM``, ``RssAnon``, ...), bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0]) * 1024
    return fields


def _reset_high_water_mark() -> None:
    """Reset ``VmHWM`` to the present resident size (Linux 4.0+: ``clear_refs`` value 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_real(config: JobConfig, *, live: bool = False) -> dict[str, int]:
    """``resident`` (and ``live``): see the module's docstring; in this rank of the
    initialized process group, over building ``config``'s run and two steps of it."""
    from titan_dims import detect_device_type
    from titan_train.preflight import World, preflight
    from titan_train.trainer.build import build, close
    from titan_train.trainer.host_memory import reuse_host_memory
    from titan_train.trainer.step import next_batches, train_step

    kind = detect_device_type()
    device = torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)) if kind != "cpu" else None)
    if kind == "cpu" and config.training.reuse_host_memory:
        reuse_host_memory()
    plan = preflight(config, World.current(device))
    # What earlier work in this process left in reference cycles is freed now, not inside
    # the window (it would count as negative bytes for the profiler).
    gc.collect()
    if kind != "cpu":
        torch.cuda.reset_peak_memory_stats(device)
    _reset_high_water_mark()
    before = proc_status()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if live else None
    if prof is not None:
        prof.__enter__()
    try:
        run = build(config, plan)
        try:
            for _ in range(2):
                batches, _ = next_batches(run.batches, plan.batches.accumulation_steps, device)
                train_step(run, batches)
                del batches
        finally:
            close(run)
        after = proc_status()
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    if kind == "cpu":
        shared = after.get("RssFile", 0) + after.get("RssShmem", 0)
        resident = after["VmHWM"] - shared - before["RssAnon"]
    else:
        resident = torch.cuda.max_memory_reserved(device)
    out = {"resident": resident}
    if prof is not None:
        out["live"] = _allocator_peak(prof)
    return out


def _allocator_peak(prof: Any) -> int:
    """The running maximum of the allocator's live bytes, from its ``[memory]`` events."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _rank_main(rank: int, nproc: int, port: int, argv: list[str], live: bool, out: Any) -> None:
    from titan_train.config import parse_job_config

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_RANK=str(rank),
    )
    # As torchrun starts each rank (OMP_NUM_THREADS=1) and as one process of the command
    # runs (torch's default threads), so the threads' arenas are the real ones.
    if nproc > 1:
        torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    try:
        with tempfile.TemporaryDirectory() as folder:
            config = parse_job_config(
                [*argv, "--job.dump_folder", folder, "--checkpoint.no-enable"]
            )
            out.put((rank, measure_real(config, live=live)))
    finally:
        destroy_group()
    # A plain return's finalization can abort on the cached gloo group (``exit_rank``); the
    # queue is a pipe written without a feeder thread, so everything put is written by now.
    exit_rank(0)


@contextlib.contextmanager
def ranks_environment(argv: list[str]) -> Iterator[None]:
    """This process's environment, while it starts ranks, as ``titan-train``'s launcher gives
    them for ``argv`` (glibc's small-block caches: ``host_memory.launch_environment``)."""
    from titan_dims import detect_device_type
    from titan_train.config import parse_job_config
    from titan_train.trainer.host_memory import launch_environment

    wanted = parse_job_config(argv).training.reuse_host_memory and detect_device_type() == "cpu"
    before = dict(os.environ)
    os.environ.update(launch_environment(wanted))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)


def spawn_real(
    argvs: list[list[str]], nproc: int, *, live: bool = False
) -> list[list[dict[str, int]]]:
    """Per command line of ``argvs``, each rank's ``measure_real`` of ``titan-train ARGV``
    on ``nproc`` gloo ranks: one fresh job per command line."""
    results = []
    for argv in argvs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        with ranks_environment(argv):
            mp.start_processes(
                _rank_main, args=(nproc, port, argv, live, out), nprocs=nproc, start_method="spawn"
            )
        per_rank = dict(out.get() for _ in range(nproc))
        results.append([per_rank[r] for r in range(nproc)])
    return results
