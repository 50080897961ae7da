"""``next_batches``: batches reach the run's device with their values; on an accelerator
through pinned host memory by non-blocking copies (device-gated: skipped on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_train import next_batches

ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None


def batches(n: int):
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 50, (2, 8), generator=generator), torch.randint(0, 50, (2, 8)))
        for _ in range(n)
    ]


class _Copies(TorchDispatchMode):
    """Every ``_to_copy`` as (source pinned, non_blocking, target device type)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[bool, bool, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.ops.aten._to_copy.default and "device" in kwargs:
            device = torch.device(kwargs["device"])
            self.copies.append((args[0].is_pinned(), bool(kwargs.get("non_blocking")), device.type))
        return func(*args, **kwargs)


def test_cpu_batches_come_as_they_are():
    source = batches(3)
    out, waited = next_batches(iter(source), 2, torch.device("cpu"))
    assert len(out) == 2
    assert waited >= 0
    for (inputs, labels), (x, y) in zip(out, source, strict=False):
        assert torch.equal(inputs, x)
        assert torch.equal(labels, y)
        assert inputs.device.type == "cpu"


@pytest.mark.skipif(ACCELERATOR is None, reason="needs an accelerator")
def test_accelerator_batches_are_pinned_and_copied_without_blocking():
    device = torch.device(ACCELERATOR.type, torch.accelerator.current_device_index())
    source = batches(2)
    with _Copies() as seen:
        out, _ = next_batches(iter(source), 2, device)
    torch.accelerator.synchronize()
    assert seen.copies == [(True, True, ACCELERATOR.type)] * 4
    for (inputs, labels), (x, y) in zip(out, source, strict=True):
        assert torch.equal(inputs.cpu(), x)
        assert torch.equal(labels.cpu(), y)
