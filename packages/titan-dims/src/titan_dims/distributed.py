"""Start ``torch.distributed`` from torchrun's environment, with explicit timeouts.

``init_distributed()`` reads the variables ``torchrun`` sets (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), binds this process to its accelerator (if any),
picks the backend for the device and initializes the default process group. Run as a plain
``python script.py`` it starts a one-rank group, so the same script works both ways.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from titan_dims.device import default_backend, detect_device_type
from titan_dims.errors import DistributedEnvError

__all__ = [
    "DistributedEnv",
    "DistributedEnvError",
    "init_distributed",
    "local_device_index",
    "set_collective_timeout",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class DistributedEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    """Global rank, 0 to world_size - 1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node; selects the accelerator."""
    local_world_size: int
    """Processes on this node."""
    launched: bool
    """Whether a launcher (torchrun, SLURM via torchrun) set the variables."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistributedEnv:
        """Read torchrun's variables; none at all means a single, unlaunched process."""
        env = os.environ if environ is None else environ
        present = [v for v in _TORCHRUN_VARS if v in env]
        if not present:
            return cls(rank=0, world_size=1, local_rank=0, local_world_size=1, launched=False)
        missing = [v for v in _TORCHRUN_VARS if v not in env]
        if missing:
            raise DistributedEnvError(
                f"Found {', '.join(present)} but not {', '.join(missing)} in the environment. "
                "Launch with torchrun (which sets all of them), or set every one of "
                f"{', '.join(_TORCHRUN_VARS)}."
            )
        values = {}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            try:
                values[var] = int(env[var])
            except ValueError:
                raise DistributedEnvError(
                    f"{var}={env[var]!r} in the environment is not a whole number."
                ) from None
        world_size = values["WORLD_SIZE"]
        local_world_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
        if world_size < 1 or not 0 <= values["RANK"] < world_size:
            raise DistributedEnvError(
                f"RANK={values['RANK']} and WORLD_SIZE={world_size} are inconsistent: "
                "RANK must lie in [0, WORLD_SIZE)."
            )
        return cls(
            rank=values["RANK"],
            world_size=world_size,
            local_rank=values["LOCAL_RANK"],
            local_world_size=local_world_size,
            launched=True,
        )


def local_device_index(local_rank: int, visible_devices: int) -> int:
    """The accelerator index of the process with ``local_rank``: its local rank, modulo the
    devices it can see. A launcher that gives each process its own device
    (``CUDA_VISIBLE_DEVICES`` of one GPU, e.g. SLURM ``--gpus-per-task=1``) leaves every
    process one visible device, index 0, whatever its local rank."""
    if visible_devices < 1:
        raise DistributedEnvError(
            f"LOCAL_RANK={local_rank} asks for an accelerator, but none is visible to this "
            "process; check CUDA_VISIBLE_DEVICES (or its equivalent), or set TITAN_DEVICE=cpu."
        )
    return local_rank % visible_devices


def init_distributed(
    *,
    device_type: str | None = None,
    backend: str | None = None,
    timeout: timedelta = timedelta(minutes=5),
    cpu_collectives: bool = False,
    environ: Mapping[str, str] | None = None,
) -> torch.device:
    """Initialize the default process group for this process and return its device (only the
    device when a group exists). ``device_type`` is detected when ``None``; ``backend`` defaults
    to the device's (gloo on CPU), plus gloo for CPU tensors with ``cpu_collectives``;
    ``timeout`` bounds every collective and the rendezvous, so a lost peer fails instead of
    hanging; ``environ`` defaults to ``os.environ``."""
    env = DistributedEnv.from_environ(environ)
    device_type = device_type or detect_device_type()
    device = torch.device(device_type)
    if device_type != "cpu":
        index = local_device_index(env.local_rank, torch.accelerator.device_count())
        device = torch.device(device_type, index)
        torch.accelerator.set_device_index(index)
    if dist.is_initialized():
        return device
    backend = backend or default_backend(device_type, cpu_collectives=cpu_collectives)
    if env.launched:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
    else:
        # A plain `python script.py`: a one-rank group on an in-memory store, so code that
        # builds meshes and runs collectives works unchanged without a launcher.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return device


def set_collective_timeout(timeout: timedelta, groups=None) -> None:
    """Change the timeout of the default group and of ``groups`` (process groups, or device
    meshes whose every group is changed).

    Typical use: a long timeout while the first step compiles and warms up, then a short
    one, so that a hung rank fails the job in seconds instead of minutes.
    """
    from torch.distributed.device_mesh import DeviceMesh

    targets = [None]
    for item in groups or ():
        targets.extend(item.get_all_groups() if isinstance(item, DeviceMesh) else [item])
    for group in targets:
        dist.distributed_c10d._set_pg_timeout(timeout, group)
