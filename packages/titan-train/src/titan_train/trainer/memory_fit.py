"""Refuse a run that cannot fit in memory before anything is allocated or written.

A floor, not an estimate: the least a run's model state needs (fp32 weights and gradients,
the optimizer's moments, over the ranks that shard them; embeddings left out, their size
follows the tokenizer) plus, on the CPU, what each rank's process holds before building
(this process's resident memory, shared pages left out) and ``RUNTIME_HEAP``. Activations
only add to it, so a run refused here cannot fit on this host however launched; one that
passes may still run out (``titan-train estimate`` predicts the rest, in seconds to
minutes). This is arithmetic and a few ``/proc`` reads, so it runs in preflight, in the
launcher before any rank starts, and in each rank; ``--training.no_memory_check`` skips it.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from dataclasses import dataclass

import torch

from titan_train.config import ConfigError, JobConfig

__all__ = [
    "RUNTIME_HEAP",
    "HostMemory",
    "check_launch_fits",
    "check_memory_fits",
    "host_memory",
    "model_state_bytes",
]

logger = logging.getLogger("titan_train")

GIB = 1 << 30

RUNTIME_HEAP = 17 << 20
"""A training process's heap besides tensors (data loader, tokenizer, optimizer and FSDP
state, BLAS buffers): glibc's bytes in use after two steps less the tensors, 17 MiB for the
Llama 3 debug model and a ~100M one alike (torch 2.13, CPU), so the runtime's, not the
model's. ``titan-train estimate`` counts it in ``host_overhead`` too."""

# Bytes per parameter of what an optimizer keeps (its moments), all in fp32.
_OPTIMIZER_STATE_BYTES = {"Adam": 8, "AdamW": 8}


def model_state_bytes(config: JobConfig, n_params: int) -> int:
    """Bytes of fp32 weights, gradients and optimizer moments for ``n_params`` parameters."""
    optimizer = _OPTIMIZER_STATE_BYTES.get(config.optimizer.name, 0)
    if config.optimizer.name == "SGD" and config.optimizer.momentum > 0:
        optimizer = 4
    return n_params * (4 + 4 + optimizer)


@dataclass(frozen=True)
class HostMemory:
    """The memory processes on this host can still have, and what limits it."""

    available: int
    """Bytes, the smallest of the limits below."""
    source: str
    """Which limit that is, in words."""


def host_memory() -> HostMemory | None:
    """What a new process can have: ``MemAvailable`` capped by the cgroup limit (v2, v1) and
    ``ulimit -v``/``-d``; ``None`` where none can be read (not Linux)."""
    limits: list[tuple[int, str]] = []
    meminfo = _read("/proc/meminfo")
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            limits.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (v1 + "limit_in_bytes", v1 + "usage_in_bytes"),
    ):
        limit, usage = _read(limit_file), _read(usage_file)
        if limit and usage and limit.strip().isdigit() and int(limit) < 1 << 60:
            limits.append((int(limit) - int(usage), f"the cgroup limit ({limit_file})"))
    for name, rlimit in (("ulimit -v", resource.RLIMIT_AS), ("ulimit -d", resource.RLIMIT_DATA)):
        soft = resource.getrlimit(rlimit)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append((soft, f"{name} (per process)"))
    if not limits:
        return None
    available, source = min(limits)
    return HostMemory(max(available, 0), source)


def check_memory_fits(
    config: JobConfig,
    n_params: int,
    *,
    shards: int,
    local_ranks: int,
    device: torch.device,
    started: bool,
) -> None:
    """Raise ``ConfigError`` when ``local_ranks`` ranks here, each with ``1/shards`` of the
    state of ``n_params`` (no embeddings), cannot fit; ``started``: the ranks' processes
    exist (a rank's preflight, not the launcher's), their memory no longer available."""
    if not config.training.memory_check:
        return
    state = math.ceil(model_state_bytes(config, n_params) / shards)
    what = (
        f"{n_params / 1e9:.2f}B parameters x {model_state_bytes(config, 1)} bytes (fp32 "
        f"weights, gradients, {config.optimizer.name} state)"
        + (f" / {shards} shards" if shards > 1 else "")
    )
    if device.type == "cpu" or config.parallelize.cpu_offload:
        host = host_memory()
        if host is None:
            logger.debug("memory check: this host's free memory cannot be read; skipped")
            return
        # A rank not started yet will hold what this process holds, and its runtime's heap.
        process = _resident_bytes() + RUNTIME_HEAP if device.type == "cpu" and not started else 0
        need = local_ranks * (state + process)
        if need <= host.available:
            return
        per_rank = f"{what} = {state / GIB:.1f} GiB"
        if process:
            per_rank += (
                f", plus {process / GIB:.2f} GiB a process holds before building and "
                "its runtime's heap"
            )
        fits = _what_fits(host.available // local_ranks - process, state, shards, local_ranks)
        raise ConfigError(
            f"This run cannot fit in host memory: {local_ranks} rank(s) on this host need at "
            f"least {need / GIB:.1f} GiB before any activation ({per_rank}, each), and "
            f"{host.source} leaves {host.available / GIB:.1f} GiB. {fits} "
            "(--training.no_memory_check starts it anyway)."
        )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if state > free:
            raise ConfigError(
                f"This run cannot fit in {device} memory: each rank needs at least "
                f"{state / GIB:.1f} GiB for its model state ({what}) and the device has "
                f"{free / GIB:.1f} GiB free. "
                f"{_what_fits(free, state, shards, local_ranks)} "
                "(--training.no_memory_check starts it anyway)."
            )


def check_launch_fits(
    config: JobConfig, *, world_size: int, local_ranks: int, device: torch.device
) -> None:
    """The launcher's second look: when ``local_ranks`` CPU processes alone take over half
    the host, the floor says too little (activations count many times over), so rank 0's
    step is estimated (``peak_resident``, seconds) and the run refused with ``ConfigError``
    when ``local_ranks`` of them cannot fit."""
    if not config.training.memory_check or device.type != "cpu" or local_ranks < 2:
        return
    host = host_memory()
    if host is None:
        return
    process = _resident_bytes() + RUNTIME_HEAP
    if 2 * local_ranks * process <= host.available:
        return
    from titan_train.estimate import estimate_memory

    step = estimate_memory(config, world_size=world_size, rank=0).peak_resident
    per_rank = process + step
    if local_ranks * per_rank <= host.available:
        return
    raise ConfigError(
        f"This run cannot fit in host memory: {local_ranks} rank(s) on this host need about "
        f"{local_ranks * per_rank / GIB:.1f} GiB ({process / GIB:.2f} GiB a process holds "
        f"before building and {step / GIB:.2f} GiB for rank 0's step, titan-train estimate's "
        f"peak_resident, each), and {host.source} leaves {host.available / GIB:.1f} GiB. "
        f"Start at most {max(host.available // per_rank, 1)} rank(s) per host (--nproc-per-node), "
        "lower training.local_batch_size or turn on activation checkpointing "
        "(--training.no_memory_check starts it anyway)."
    )


def _what_fits(budget: int, state: int, shards: int, local_ranks: int) -> str:
    if budget <= 0:
        return (
            f"Even the processes alone do not fit: start fewer ranks per host (now "
            f"{local_ranks}, --nproc-per-node) or free memory"
        )
    needed = math.ceil(state * shards / budget)
    return (
        f"It fits with the model state sharded {needed}-way or more (more ranks, across hosts: "
        "--parallelism.data_parallel_shard_degree), a smaller model, or CPU offload on an "
        "accelerator"
    )


def _resident_bytes() -> int:
    """This process's resident memory of its own: shared pages (libtorch's code, mapped
    files) are left out, since every rank on the host maps the same ones."""
    statm = _read("/proc/self/statm")
    if not statm:
        return 0
    resident, shared = (int(field) for field in statm.split()[1:3])
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
