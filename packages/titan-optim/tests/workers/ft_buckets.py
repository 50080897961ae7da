"""One torchft replica group (one process) averaging gradients with another:
``ft_buckets.py LIGHTHOUSE REPLICA OUT``.

The model has fp32 and bf16 parameters and one non-contiguous gradient. Each step sets
this replica's gradients from a seed of (replica, step), then averages them through
``FTOptimizersContainer.average_gradients`` with a different bucket size: step 1 with 0
(one all-reduce per gradient), step 2 with the default 25 MiB, step 3 with 64 bytes (several
buckets); an int64 buffer registered with ``sum_over_replica_groups`` is summed with them.
Writes ``OUT`` (JSON): per step, the all-reduce calls made (gradients, then the buffer),
the averaged gradients and the summed buffer.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torchft
from torch import nn
from torch.distributed import TCPStore

from titan_optim import FTOptimizersContainer, build_optimizers

STEPS = {1: 0.0, 2: 25.0, 3: 64 / 2**20}  # step -> bucket_cap_mb


def replica_gradients(replica: int, step: int, model: nn.Module) -> list[torch.Tensor]:
    """The gradients replica ``replica`` holds at ``step`` (also computed by the test)."""
    generator = torch.Generator().manual_seed(1000 * replica + step)
    grads = []
    for param in model.parameters():
        grad = torch.randn(param.shape[::-1], generator=generator).to(param.dtype)
        grads.append(grad.t() if grad.ndim == 2 else grad)  # transposed: non-contiguous
    return grads


def replica_counts(replica: int, step: int) -> torch.Tensor:
    """The int64 buffer replica ``replica`` holds at ``step``: past fp32's and fp64's exact
    integers once summed."""
    return torch.tensor([2**60 + replica, 3 * replica + step, 2**53 + 1 + replica])


def build_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 3))
    model[1].to(torch.bfloat16)
    return model


def main(lighthouse: str, replica: int, out: str) -> None:
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(),
        min_replica_size=2,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"bucket-test-{replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        init_sync=False,
        timeout=timedelta(seconds=20),
    )
    model = build_model()
    ft = FTOptimizersContainer(build_optimizers(model), manager)
    counts = torch.zeros(3, dtype=torch.int64)  # e.g. an MoE layer's token counts
    ft.sum_over_replica_groups(lambda: [counts])
    calls: list[int] = []
    real = manager.allreduce
    manager.allreduce = lambda tensor, *a, **k: (
        calls.append(tensor.numel()) or real(tensor, *a, **k)
    )
    result = {}
    try:
        for step, cap_mb in STEPS.items():
            ft.bucket_bytes = int(cap_mb * 2**20)
            ft.zero_grad()
            for param, grad in zip(
                model.parameters(), replica_gradients(replica, step, model), strict=True
            ):
                param.grad = grad
            counts.copy_(replica_counts(replica, step))
            calls.clear()
            ft.average_gradients()
            assert manager.should_commit(), "the step did not commit"
            result[step] = {
                "allreduce_numels": list(calls),
                "grads": [p.grad.float().tolist() for p in model.parameters()],
                "contiguous": [p.grad.is_contiguous() for p in model.parameters()],
                "participants": manager.num_participants(),
                "counts": counts.tolist(),
            }
        # A committed step the inner container skips (a non-finite norm): no after-step hook
        # read the sums, so the buffer gets its local values back.
        ft.zero_grad()
        for param, grad in zip(
            model.parameters(), replica_gradients(replica, 4, model), strict=True
        ):
            param.grad = grad
        model[0].bias.grad[0] = float("nan")
        counts.copy_(replica_counts(replica, 4))
        ft.clip_grad_norm_(1.0)
        ft.step()
        result["skipped"] = {"counts": counts.tolist(), "skips": ft.optimizers.skipped_steps}
    finally:
        manager.shutdown()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
