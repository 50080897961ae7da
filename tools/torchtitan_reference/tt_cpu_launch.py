"""Run torchtitan 6204cdff9 (July 2025) on CPU with gloo, without editing its source.

Launch from the root of an extracted torchtitan checkout, in place of ``-m torchtitan.train``:

    torchrun --nproc-per-node N path/to/tt_cpu_launch.py --job.config_file ... [overrides]
    python path/to/tt_cpu_launch.py ...   # one process: sets the torchrun env itself

Patches, applied before torchtitan is imported:
1. device detection: torchtitan/tools/utils.py computes ``device_type, device_module`` at import
   from ``torch._utils._get_available_device_type() or "cuda"``; that function returns "cpu"
   while torchtitan imports (restored afterwards), so every ``from torchtitan.tools.utils import
   device_type`` copy is "cpu" and init_distributed picks gloo (Backend.default_device_backend_map).
2. ``torch.distributed.barrier``: non-integer ``device_ids`` are dropped (torchtitan passes
   ``[torch.cpu.current_device()] == ['cpu']``, which gloo rejects).
3. CPU stand-ins for the memory-monitor calls that ``torch.cpu`` lacks (get_device_name,
   get_device_properties, memory_stats, reset_peak_memory_stats, empty_cache): the "peak" is
   the process's peak RSS (ru_maxrss), which cannot be reset.
"""

import os
import platform
import resource
import runpy
import sys

import torch
import torch._utils
import torch.distributed as dist

sys.path.insert(0, os.getcwd())  # the torchtitan checkout (a script's sys.path[0] is its folder)

# One process without torchrun: the env:// rendezvous that torchtitan expects.
for key, value in {
    "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517",
}.items():  # fmt: skip
    os.environ.setdefault(key, value)


# 3. memory-monitor stand-ins (only what torch.cpu lacks)
def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _CpuProperties:
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name = platform.processor() or "cpu"


_STANDINS = {
    "get_device_name": lambda device=None: _CpuProperties.name,
    "get_device_properties": lambda device=None: _CpuProperties(),
    "memory_stats": lambda device=None: {
        "active_bytes.all.peak": _peak_rss_bytes(),
        "reserved_bytes.all.peak": _peak_rss_bytes(),
        "num_alloc_retries": 0,
        "num_ooms": 0,
    },
    "reset_peak_memory_stats": lambda device=None: None,
    "empty_cache": lambda: None,
}
for name, function in _STANDINS.items():
    if not hasattr(torch.cpu, name):
        setattr(torch.cpu, name, function)

# 2. barrier without non-integer device_ids
_barrier = dist.barrier


def _cpu_barrier(group=None, async_op=False, device_ids=None):
    if device_ids is not None:
        device_ids = [d for d in device_ids if isinstance(d, int)] or None
    return _barrier(group=group, async_op=async_op, device_ids=device_ids)


dist.barrier = _cpu_barrier

# 1. device detection -> "cpu" while torchtitan imports
_detect = torch._utils._get_available_device_type
torch._utils._get_available_device_type = lambda: "cpu"
try:
    import torchtitan.tools.utils as _tt_utils  # imports all of torchtitan (models, experiments)
    import torchtitan.train  # noqa: F401
finally:
    torch._utils._get_available_device_type = _detect
assert _tt_utils.device_type == "cpu", _tt_utils.device_type

sys.argv[0] = "torchtitan.train"
runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
