"""Keep freed host memory for reuse on CPU-only runs, instead of returning it to the system,
and keep glibc's small-block caches from splitting it.

glibc serves blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh
``mmap`` and unmaps them on ``free``, so every CPU step the kernel maps, faults in and zeroes
the same gigabytes again (Llama 3 debug, batch 8 x 2048: ~500,000-625,000 minor faults per
step; a large matmul 25-35% slower into fresh memory). Raised mmap and trim thresholds keep
the blocks: ~33,000 faults per step, the step 0.89x the time (``tools/bench/step_profile.py``),
about the same peak resident memory (3.4-3.6 GiB), held until exit. Linux glibc CPU runs
only; ``training.reuse_host_memory = false`` turns it off, and torch's
``THP_MEM_ALLOC_ENABLE=1`` leaves it off (together: a large matmul ~10x slower here).

glibc also keeps freed small blocks (under ~1 KiB) in per-thread caches and fast bins, out
of reach of their free neighbours. The runtime's small C++ objects (tensors, autograd nodes)
freed there keep the freed tensor blocks around them from merging, so a later, larger
tensor does not fit and the heap grows: 2-31% of a run's growth, by no rule a tensor-level
estimate can follow (``tools/bench/estimate_accuracy.py --replay-real``). ``GLIBC_TUNABLES`` with
``glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0`` turns both caches off, so freed small
blocks merge at once: 2-28% less resident memory, throughput the same or higher (the
titan-train README has both tables). glibc reads it only when a process starts, so
``restart_early`` starts the ``titan-train`` command again in place (``execve``: the same
process and arguments) with it in the environment before torch is imported, ``settle``
corrects that once the configuration is read, and the launcher starts its ranks with it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import NoReturn

__all__ = [
    "MMAP_THRESHOLD",
    "SMALL_BLOCK_CACHES",
    "TRIM_THRESHOLD",
    "allocator_environment",
    "launch_environment",
    "restart_early",
    "reuse_host_memory",
    "settle",
]

logger = logging.getLogger("titan_train")

# mallopt's parameter numbers (malloc.h), stable across glibc versions.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 30
"""Blocks below 1 GiB come from the heap (reused after ``free``); larger ones are mapped."""
TRIM_THRESHOLD = (1 << 31) - 1
"""Free memory at the heap's top kept, up to 2 GiB, before any is returned to the system."""
_CAPPED_MMAP_THRESHOLD = 32 << 20
# glibc releases that cap the mmap threshold at HEAP_MAX_SIZE / 2 refuse a larger value.


SMALL_BLOCK_CACHES = ("glibc.malloc.tcache_count", "glibc.malloc.mxfast")
"""The glibc tunables ``allocator_environment`` sets to 0: the per-thread cache, fast bins."""


def _glibc() -> bool:
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def allocator_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with glibc's small-block caches turned off in
    ``GLIBC_TUNABLES`` (``SMALL_BLOCK_CACHES`` at 0), appended to what it already holds; a
    tunable of those the environment already sets keeps its value."""
    env = dict(os.environ if environ is None else environ)
    current = env.get("GLIBC_TUNABLES", "")
    named = {item.partition("=")[0] for item in current.split(":")}
    added = [f"{name}=0" for name in SMALL_BLOCK_CACHES if name not in named]
    if added:
        env["GLIBC_TUNABLES"] = ":".join([current, *added] if current else added)
    return env


_DECIDED = "TITAN_TRAIN_SMALL_BLOCK_CACHES"
"""Set by a start of ``titan-train`` that decided glibc's caches: ``off:`` and the
``GLIBC_TUNABLES`` it found (to restore them), or ``kept``."""


def _accelerator_present() -> bool:
    """Whether this host may compute on an accelerator, decided without importing torch:
    ``TITAN_DEVICE`` (``titan_dims.detect_device_type``'s override) names one, or torch is not
    a CPU-only build and a device node of NVIDIA, AMD, Habana or (for an XPU build) Intel
    GPUs exists."""
    import glob
    from importlib.metadata import PackageNotFoundError, version

    override = os.environ.get("TITAN_DEVICE", "").strip()
    if override:
        return override != "cpu"
    try:
        build = version("torch")
    except PackageNotFoundError:
        return True  # unknown: decide after the import
    if build.endswith("+cpu"):
        return False
    nodes = ["/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/kfd", "/dev/accel/*", "/dev/hl[0-9]*"]
    if "xpu" in build:
        nodes.append("/dev/dri/renderD*")
    return any(glob.glob(pattern) for pattern in nodes)


def _restart(env: dict[str, str]) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def _can_change() -> bool:
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0")
    return _glibc() and not thp and bool(sys.executable)


def restart_early() -> None:
    """Start the ``titan-train`` command again in its place (``os.execve``: the same process
    id, interpreter and arguments) with glibc's small-block caches off
    (``allocator_environment``) where this host certainly trains on the CPU; called first
    thing, before torch is imported, so it costs one interpreter start. Nothing happens where
    a start already decided (``TITAN_TRAIN_SMALL_BLOCK_CACHES``), the environment names both
    tunables itself, glibc is not the C library or ``THP_MEM_ALLOC_ENABLE`` is set
    (``reuse_host_memory`` changes nothing then either). ``settle`` corrects the choice once
    the configuration is read."""
    if _DECIDED in os.environ or not _can_change() or _accelerator_present():
        return
    if allocator_environment().get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES"):
        _restart(_decided(dict(os.environ), off=True))


def _as_found(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what a start of ``titan-train`` changed in it."""
    env = dict(env)
    decided = env.pop(_DECIDED, "")
    if decided.startswith("off:"):
        env.pop("GLIBC_TUNABLES", None)
        if decided != "off:":
            env["GLIBC_TUNABLES"] = decided.removeprefix("off:")
    return env


def _decided(env: dict[str, str], off: bool) -> dict[str, str]:
    """``env`` as found, with the caches ``off`` or as it had them, and the decision noted."""
    found = _as_found(env)
    if not off:
        return {**found, _DECIDED: "kept"}
    return {**allocator_environment(found), _DECIDED: "off:" + found.get("GLIBC_TUNABLES", "")}


def settle(wanted: Callable[[], bool | None]) -> None:
    """Make glibc's small-block caches what the run wants (``wanted()``: a CPU run with
    ``training.reuse_host_memory``), starting the command again in its place where they are
    not: off where ``restart_early`` could not tell the device, or back as the environment had
    them where it turned them off and the run turns out not to want that. ``wanted()`` is
    asked only where a restart could follow, and ``None`` from it (not known: a configuration
    that fails to read) leaves the process as it is; call this before anything is written."""
    decided = os.environ.get(_DECIDED)
    if decided == "kept" or not _can_change():
        return
    if decided is None:
        env = allocator_environment()
        if env.get("GLIBC_TUNABLES") == os.environ.get("GLIBC_TUNABLES") or not wanted():
            return  # the user's own values, or not wanted (or not known): glibc stays
    elif wanted() is not False:
        return  # off, as wanted (or not known)
    _restart(_decided(dict(os.environ), off=decided is None))


def launch_environment(wanted: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) for ranks the launcher starts, their caches
    decided (``wanted``: a CPU run with ``training.reuse_host_memory``), so that no rank
    needs to start again."""
    return _decided(dict(os.environ if environ is None else environ), off=wanted)


def reuse_host_memory() -> bool:
    """Make glibc's ``malloc`` keep freed blocks (process-wide, idempotent); ``False``, with
    nothing changed, without glibc or under torch's huge-page allocation."""
    if not _glibc():
        logger.debug("host memory: not glibc; the system allocator's defaults stay")
        return False
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "0") not in ("", "0"):
        logger.info("host memory: THP_MEM_ALLOC_ENABLE is set; glibc's defaults stay")
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    threshold = MMAP_THRESHOLD
    if not mallopt(_M_MMAP_THRESHOLD, threshold):
        threshold = _CAPPED_MMAP_THRESHOLD
        if not mallopt(_M_MMAP_THRESHOLD, threshold):
            return False
    if not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        return False
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    off = all(f"{name}=0" in tunables.split(":") for name in SMALL_BLOCK_CACHES)
    logger.info(
        "host memory: freed blocks under %d MiB are kept for reuse (glibc mmap and trim "
        "thresholds raised), small-block caches %s (GLIBC_TUNABLES=%s); "
        "training.reuse_host_memory = false keeps glibc's defaults",
        threshold >> 20,
        "off" if off else "on",
        tunables,
    )
    return True
