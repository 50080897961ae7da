"""Data parallelism over a model's blocks: FSDP2 (or HSDP, given a 2-D mesh) and DDP, and the
per-device choice of FSDP's compute dtype."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from titan_models.parallel.config import ParallelizeConfig

__all__ = [
    "apply_ddp",
    "apply_fsdp",
    "auto_param_dtype",
    "cpu_has_fast_bf16",
    "resolve_param_dtype",
]


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU has bf16 matmul instructions (AVX512-BF16 or AMX). Without them a bf16
    matmul runs hundreds of times slower than fp32."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def auto_param_dtype(device_type: str, cpu_fast_bf16: bool) -> torch.dtype:
    """What ``param_dtype="auto"`` means: bfloat16 on accelerators (any ``device_type`` but
    ``cpu``) and on CPUs with bf16 instructions (``cpu_fast_bf16``), float32 on other CPUs."""
    if device_type != "cpu" or cpu_fast_bf16:
        return torch.bfloat16
    return torch.float32


def resolve_param_dtype(
    name: str, device_type: str, *, cpu_fast_bf16: bool | None = None
) -> torch.dtype:
    """The dtype ``param_dtype=name`` means on ``device_type`` (see :func:`auto_param_dtype`);
    ``cpu_fast_bf16`` defaults to asking this machine's CPU (:func:`cpu_has_fast_bf16`)."""
    if name == "auto":
        if cpu_fast_bf16 is None:
            cpu_fast_bf16 = device_type == "cpu" and cpu_has_fast_bf16()
        return auto_param_dtype(device_type, cpu_fast_bf16)
    return getattr(torch, name)


def apply_fsdp(
    model: nn.Module,
    blocks: nn.ModuleDict,
    mesh: DeviceMesh,
    config: ParallelizeConfig,
    *,
    device_type: str,
    pipeline: bool = False,
) -> None:
    """Shard each block and then the root (embedding, final norm and output) over ``mesh``:
    FSDP on a 1-D mesh, HSDP (replicate x shard) on a 2-D one."""
    param_dtype = resolve_param_dtype(config.param_dtype, device_type)
    reduce_dtype = getattr(torch, config.reduce_dtype)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # A block's floating inputs are the hidden states, already in the compute dtype (the
    # embedding computed them so), and the RoPE table, which must stay fp32: cast, its
    # angles lose three digits (errors ~1e-3 in rotated queries and keys), and the cast
    # runs again in every block of every step.
    block_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    kwargs: dict = {"mesh": mesh, "mp_policy": mp}
    if config.cpu_offload:
        # Pinned host memory speeds up copies to an accelerator; there is none on CPU.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    reshard = {"always": True, "never": False, "default": not pipeline}
    reshard_blocks = reshard[config.reshard_after_forward]
    names = list(blocks.keys())
    for name in names:
        # The last block's parameters are needed again first in backward: keeping them
        # gathered saves an all-gather for the price of one block's memory.
        last = name == names[-1] and config.reshard_after_forward == "default"
        fully_shard(
            blocks[name],
            reshard_after_forward=reshard_blocks and not last,
            **{**kwargs, "mp_policy": block_mp},
        )
    fully_shard(model, reshard_after_forward=reshard_blocks, **kwargs)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate ``model`` over ``mesh`` with gradient all-reduce (composable DDP)."""
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh, bucket_cap_mb=100)
