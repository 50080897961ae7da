"""What runs out: a process's memory beyond the bytes its tensors hold at once (``peak``),
modelled from the same recording of the step's allocations and frees, in order:

- **glibc's heap (CPU).** c10 takes every CPU tensor from ``posix_memalign``, and
  ``titan-train`` makes glibc keep freed blocks, its small-block caches off
  (``titan_train.trainer.host_memory``). A
  freed block is reused only by a request that fits it (or it merged with free neighbours),
  so where a step's allocations do not fit the holes earlier ones left, the heap grows.
  ``glibc_high_water`` replays the allocations on glibc itself in a fresh small process
  (reserved, not touched) in the order ``two_steps`` gives a real run's first two steps.
- **gloo's collective buffers (CPU).** ``ProcessGroupGloo`` stages collectives in tensors
  of its own: an all-gather gathers into a flat output in one of the group's 2 worker
  threads, a reduce-scatter clones its input in the caller. ``gloo_buffers`` names them per
  collective; a worker's blocks are replayed from a thread (so an arena) of its own. glibc
  2.36 does not reuse a just-freed block for the same aligned size again: six 16 MiB
  all-gathers on 2 ranks grow resident memory by ~an output each, in the replay too.
- **The runtime's own heap (CPU).** ``RUNTIME_HEAP``, a measured constant.
- **FSDP's fragmentation (CPU).** ``FSDP_FRAGMENTATION``: a measured share of the replayed
  heap, added where the rank shards parameters with FSDP.
- **The CUDA caching allocator.** ``cuda_reserved_peak`` replays the recording on a model
  of it (``torch.cuda.max_memory_reserved``); untested on a GPU.

Not modelled one by one: the runtime's small allocations (C++ tensor and autograd objects
made between the tensors' blocks). With glibc's small-block caches on they split freed
blocks, 2-31% of a run's growth by no rule on the tensors (``tools/bench/estimate_accuracy.py
--replay-real`` replays a real run's every allocation); with them off, as ``titan-train``
runs, freed small blocks merge at once and the tensors' blocks alone land near the real
growth, except under FSDP (``FSDP_FRAGMENTATION``). Nor, a few MiB each, OMP threads'
arenas, gloo's transport buffers; nor NCCL's buffers, the CUDA context.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# The runtime's own heap: defined beside the memory check, which counts it too.
from titan_train.trainer.memory_fit import RUNTIME_HEAP

__all__ = [
    "FSDP_FRAGMENTATION",
    "GLOO_THREADS",
    "RUNTIME_HEAP",
    "GlooBlock",
    "cuda_reserved_peak",
    "glibc_high_water",
    "gloo_buffers",
    "two_steps",
]

GLOO_THREADS = 2
"""Worker threads of each torch ``ProcessGroupGloo`` (its ``Options.threads`` default)."""

FSDP_FRAGMENTATION = 1 / 8
"""What a CPU rank sharding parameters with FSDP holds beyond its tensors' replayed heap, as
a share of that heap. Each of FSDP's gathers and reduce-scatters allocates and frees blocks
of a whole layer's size (its output, gloo's flat buffer and copies), and the runtime's small
allocations made between them keep freed blocks from serving the next one: a ~100M model's
4-rank FSDP ranks, traced (``tools/bench/estimate_accuracy.py --replay-real``), replay to
1508-1587 MiB with every allocation and to 1313-1418 with their tensor blocks alone, under
10 MiB of small objects live at the peak. Which blocks they spoil follows the objects' exact
sizes and order, not the tensors', so the estimate adds a measured share instead: the FSDP
ranks of the debug and ~100M models, 2 and 4 per run, held 1-24% more than their tensors'
replay (one process, full AC and TP: within 3%). One eighth was chosen on the README's
accuracy rows, then checked on batch and sequence sizes it was not chosen on."""


@dataclass(frozen=True)
class GlooBlock:
    """The key of a block gloo allocates for a collective: ``thread`` (0: the caller, 1 and up:
    a worker), and a number of its own."""

    thread: int
    number: int


def gloo_buffers(func: Any, args: tuple) -> tuple[str, int, int]:
    """``(group, worker-thread bytes, caller bytes)`` that ``ProcessGroupGloo`` allocates and
    frees within one collective on CPU tensors (``("", 0, 0)`` for other ops), per
    ``ProcessGroupGloo.cpp``: all-gathers a flat output (worker), reduce-scatters a clone of
    the input (caller; gloo's ring all-reduce of it adds no such block: measured);
    all-reduce is in place. TP's functional collectives reach the same ops."""
    namespace = getattr(func, "namespace", "")
    if namespace not in ("c10d", "_c10d_functional"):
        return "", 0, 0
    name = func.__name__.split(".")[0]
    if namespace == "_c10d_functional":
        inputs = args[0] if isinstance(args[0], list | tuple) else [args[0]]
        size = sum(_bytes(t) for t in inputs)
        if name.startswith("all_gather_into_tensor"):
            return str(args[2]), size * int(args[1]), 0
        if name.startswith("reduce_scatter_tensor"):
            return str(args[3]), 0, size
        return "", 0, 0
    if name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
        outputs = args[0] if isinstance(args[0], list | tuple) else [args[0]]
        return _group_name(args[2]), sum(_bytes(t) for t in outputs), 0
    if name == "allgather_":
        return _group_name(args[2]), sum(_bytes(t) for ts in args[0] for t in ts), 0
    if name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
        inputs = args[1] if isinstance(args[1], list | tuple) else [args[1]]
        return _group_name(args[2]), 0, sum(_bytes(t) for t in inputs)
    return "", 0, 0


def _bytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


def _group_name(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.ProcessGroup.unbox(group).group_name)
    except (AttributeError, RuntimeError, TypeError):
        return "default"


def glibc_high_water(events: list[tuple[object, int]]) -> int | None:
    """How far glibc's heap grows serving ``events`` with c10's ``posix_memalign``/``free``
    under ``host_memory``'s thresholds and environment, in a fresh process (``mallinfo2``,
    all arenas; pages reserved, not touched), a ``GlooBlock`` worker's blocks from a thread
    of their own;
    ``None`` without Linux glibc 2.33+ or when the process fails."""
    import platform
    import struct
    import subprocess
    import sys
    from pathlib import Path

    from titan_train.trainer.host_memory import (
        _CAPPED_MMAP_THRESHOLD,
        MMAP_THRESHOLD,
        TRIM_THRESHOLD,
        allocator_environment,
    )

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    data = b"".join(
        struct.pack("<qqq", number, nbytes, _thread(key))
        for (number, nbytes), (key, _) in zip(_numbered(events), events, strict=True)
    )
    try:
        done = subprocess.run(
            # -I -S: no site packages, no torch: the heap starts as small as Python's.
            [sys.executable, "-I", "-S", str(Path(__file__).with_name("_replay.py")),
             str(MMAP_THRESHOLD), str(_CAPPED_MMAP_THRESHOLD), str(TRIM_THRESHOLD)],
            input=data, capture_output=True, check=True, timeout=300,
            env=allocator_environment(),  # glibc's small-block caches as titan-train sets them
        )  # fmt: skip
        return int(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _numbered(events: list[tuple[object, int]]) -> Iterable[tuple[int, int]]:
    numbers: dict[object, int] = {}
    for key, nbytes in events:
        yield numbers.setdefault(key, len(numbers)), nbytes


def _unwrap(key: object) -> object:
    while isinstance(key, tuple) and key and key[0] == "second":
        key = key[1]
    return key


def _thread(key: object) -> int:
    key = _unwrap(key)
    return key.thread if isinstance(key, GlooBlock) else 0


def two_steps(
    resident: list[tuple[int, int]],
    update: list[tuple[int, int]],
    step: list[tuple[int, int]],
) -> list[tuple[int, int]]:
    """A real run's first two steps of allocations from the recordings ``resident``, ``update``
    (creating the optimizer state) and ``step``, the second step's keys made distinct."""
    update_kept = _left_allocated(update)
    temporaries = [(key, n) for key, n in update if key not in update_kept]
    grads = _left_allocated(step)
    second = [(("second", key), n) for key, n in step]
    return [
        *resident,
        *step,
        *update,
        *((key, 0) for key in grads),  # zero_grad(set_to_none=True)
        *second,
        *((("second", key), n) for key, n in temporaries),
    ]


def _left_allocated(events: list[tuple[int, int]]) -> set:
    live: set = set()
    for key, nbytes in events:
        if nbytes > 0:
            live.add(key)
        else:
            live.discard(key)
    return live


_BLOCK = 512  # torch's CUDA caching allocator: every block a multiple of 512 bytes
_SMALL = 1 << 20  # blocks up to 1 MiB come from the small pool, in 2 MiB segments
_SMALL_SEGMENT = 2 << 20
_LARGE_SEGMENT = 20 << 20  # larger blocks under 10 MiB: 20 MiB segments
_MIN_LARGE = 10 << 20  # from 10 MiB: a segment of the block's size, rounded to 2 MiB
_ROUND_LARGE = 2 << 20


def cuda_reserved_peak(events: Iterable[tuple[object, int]]) -> int:
    """The most bytes torch's CUDA caching allocator would hold reserved serving ``events``,
    by its documented default policy (512-byte rounding; small <= 1 MiB and large pools;
    best fit, split when 512 bytes / over 1 MiB remain; new segments of 2 MiB, 20 MiB under
    10 MiB, else rounded to 2 MiB; freed blocks merge and stay reserved). Not run on a GPU;
    no expandable segments, one stream."""
    free = {True: _FreeBlocks(), False: _FreeBlocks()}
    events = [(k, n) for k, n in events if not isinstance(_unwrap(k), GlooBlock)]  # no gloo
    held: dict[object, tuple[int, int, bool]] = {}
    reserved = high = 0
    next_segment = 0
    for key, nbytes in events:
        if key in held:
            address, size, small = held.pop(key)
            free[small].add(address, size)
        if nbytes <= 0:
            continue
        size = max(_BLOCK, -(-nbytes // _BLOCK) * _BLOCK)
        small = size <= _SMALL
        found = free[small].best_fit(size)
        if found is None:
            segment = (
                _SMALL_SEGMENT if small
                else _LARGE_SEGMENT if size < _MIN_LARGE
                else -(-size // _ROUND_LARGE) * _ROUND_LARGE
            )  # fmt: skip
            reserved += segment
            high = max(high, reserved)
            found = (next_segment, segment)
            next_segment += 1 << 48  # segments are never adjacent: blocks merge within one
        address, block = found
        left = block - size
        if (left >= _BLOCK) if small else (left > _SMALL):
            free[small].add(address + size, left)
        else:
            size = block
        held[key] = (address, size, small)
    return high


class _FreeBlocks:
    """Free blocks by address, merged with free neighbours, found best-fit by size."""

    def __init__(self) -> None:
        self.by_size: list[tuple[int, int]] = []
        self.starts: dict[int, int] = {}
        self.ends: dict[int, int] = {}

    def _remove(self, address: int) -> int:
        size = self.starts.pop(address)
        del self.ends[address + size]
        del self.by_size[bisect.bisect_left(self.by_size, (size, address))]
        return size

    def add(self, address: int, size: int) -> None:
        if address + size in self.starts:
            size += self._remove(address + size)
        if address in self.ends:
            before = self.ends[address]
            size += self._remove(before)
            address = before
        self.starts[address] = size
        self.ends[address + size] = address
        bisect.insort(self.by_size, (size, address))

    def best_fit(self, size: int) -> tuple[int, int] | None:
        """The smallest free block of at least ``size`` bytes, taken out: (address, size)."""
        index = bisect.bisect_left(self.by_size, (size, -1))
        if index == len(self.by_size):
            return None
        block, address = self.by_size[index]
        self._remove(address)
        return address, block
