"""Keep freed host memory for reuse on CPU-only runs, instead of returning it to the system.

glibc serves blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh
``mmap`` and unmaps them on ``free``, so every CPU step the kernel maps, faults in and zeroes
the same gigabytes again (Llama 3 debug, batch 8 x 2048: ~500,000-625,000 minor faults per
step; a large matmul 25-35% slower into fresh memory). Raised mmap and trim thresholds keep
the blocks: ~33,000 faults per step, the step 0.89x the time (``tools/bench/step_profile.py``),
about the same peak resident memory (3.4-3.6 GiB), held until exit. Linux glibc CPU runs
only; ``training.reuse_host_memory = false`` turns it off, and torch's
``THP_MEM_ALLOC_ENABLE=1`` leaves it off (together: a large matmul ~10x slower here).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "reuse_host_memory"]

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


def reuse_host_memory() -> bool:
    """Make glibc's ``malloc`` keep freed blocks (process-wide, idempotent); ``False``, with
    nothing changed, without glibc or under torch's huge-page allocation."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
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
    logger.info(
        "host memory: freed blocks under %d MiB are kept for reuse (glibc mmap and trim "
        "thresholds raised; training.reuse_host_memory = false keeps the defaults)",
        threshold >> 20,
    )
    return True
