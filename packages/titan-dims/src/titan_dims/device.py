"""Which device this process computes on, and which collective backend goes with it: the
accelerator from ``torch.accelerator`` and the backend from torch's device-to-backend table
(no vendor named here), CPU with gloo where there is no accelerator."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["DEVICE_ENV_VAR", "default_backend", "detect_device_type", "device_module"]

DEVICE_ENV_VAR = "TITAN_DEVICE"
"""Set to a device type (e.g. ``cpu``) to override detection, e.g. to test on CPU on a GPU host."""


def detect_device_type() -> str:
    """The device type to compute on: ``$TITAN_DEVICE`` if set, else the current
    accelerator's type (``cuda``, ``xpu``, ...), else ``cpu``."""
    override = os.environ.get(DEVICE_ENV_VAR, "").strip()
    if override:
        _check_device_type(override, source=f"${DEVICE_ENV_VAR}")
        return override
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return accelerator.type
    return "cpu"


def device_module(device_type: str):
    """The ``torch.<device_type>`` module (memory stats, synchronize, set_device, ...)."""
    _check_device_type(device_type, source="device_type")
    return getattr(torch, device_type)


def default_backend(device_type: str | None = None, *, cpu_collectives: bool = False) -> str:
    """The process-group backend for ``device_type`` (detected if ``None``).

    With ``cpu_collectives=True`` on an accelerator, the result names a gloo backend for CPU
    tensors beside the accelerator's, e.g. ``"cpu:gloo,cuda:nccl"``: asynchronous
    checkpointing and fault tolerance send CPU tensors through it.
    """
    device_type = device_type or detect_device_type()
    table = dist.Backend.default_device_backend_map
    backend = table.get(device_type)
    if backend is None or backend == "fake":
        raise ValueError(
            f"No collective backend is known for device type {device_type!r}; known: "
            f"{', '.join(f'{d} -> {b}' for d, b in sorted(table.items()) if b != 'fake')}. "
            "Pass backend= explicitly."
        )
    if cpu_collectives and device_type != "cpu":
        return f"cpu:{table['cpu']},{device_type}:{backend}"
    return backend


def _check_device_type(device_type: str, *, source: str) -> None:
    if device_type == "cpu":
        return
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "is_available"):
        raise ValueError(
            f"{source}={device_type!r} is not a torch device type; use cpu, or an accelerator "
            "torch knows (cuda, xpu, mps, ...)."
        )
