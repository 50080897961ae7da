"""Worker of test_init_layouts: build each case's model through the trainer's own model path
(preflight, then build's ``_build_model``: parallelize or pipeline split, allocate,
initialize from ``training.seed``) on this world's ranks, gather the full parameters and
buffers (``full_tensor``; pipeline stages merged on rank 0) and save them from rank 0 to
``OUT/<case>.pt`` for the test to compare with one process.

    torchrun --nproc-per-node N init_layouts.py OUT CASE [CASE ...]
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_models import init
from titan_models.init import parameter_name
from titan_train import JobConfig, World, preflight
from titan_train.trainer.build import _build_model
from titan_train.trainer.step import cross_entropy_loss

VOCAB = 512
SEED = 7
BLOCK_VALUES = 3000
"""Values a generator draws (``titan_models.init.BLOCK_VALUES``, 2^20, would draw every debug
model parameter in one block): 11 rows of 256 values, one expert of 65,536, so shards
start and end inside blocks."""

DEGREES = ("data_parallel_shard", "tensor_parallel", "pipeline_parallel", "expert_parallel")
# case -> (model name, the DEGREES, activation checkpoint mode)
CASES = {
    "llama3-fsdp-ac": ("llama3", (2, 1, 1, 1), "full"),
    "llama3-tp": ("llama3", (1, 2, 1, 1), "none"),
    "llama3-pp": ("llama3", (1, 1, 2, 1), "none"),
    "llama3-fsdp-tp": ("llama3", (2, 2, 1, 1), "none"),
    "deepseek_v3-fsdp-ep": ("deepseek_v3", (2, 1, 1, 2), "none"),
    "deepseek_v3-tp": ("deepseek_v3", (1, 2, 1, 1), "none"),
    "deepseek_v3-pp": ("deepseek_v3", (1, 1, 2, 1), "none"),
    "deepseek_v3-fsdp-tp-ep": ("deepseek_v3", (2, 2, 1, 2), "none"),
    "deepseek_v3-pp-fsdp-ep": ("deepseek_v3", (2, 1, 2, 2), "none"),
    "qwen3-pp": ("qwen3", (1, 1, 2, 1), "none"),
}
ONE_PROCESS = (1, 1, 1, 1)


def job_config(model: str, degrees: tuple[int, ...], ac_mode: str, dump: str) -> JobConfig:
    """The debug model of ``model`` with ``degrees``, small batches, seed ``SEED``."""
    config = JobConfig()
    config.model.name = model
    config.job.dump_folder = dump
    config.training.seed = SEED
    config.training.seq_len = 64
    config.training.local_batch_size = 4
    config.training.memory_check = False
    config.parallelize.activation_checkpoint.mode = ac_mode
    for name, degree in zip(DEGREES, degrees, strict=True):
        setattr(config.parallelism, f"{name}_degree", degree)
    return config


def full_state(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers, whole (collectives over each DTensor's mesh)."""
    state = {}
    for part in parts:
        # Every name of a tied weight, as a state dict has them.
        named = [*part.named_parameters(remove_duplicate=False), *part.named_buffers()]
        for name, tensor in named:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            state[parameter_name(name)] = full.detach().cpu().clone()
    return state


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2:]
    init.BLOCK_VALUES = BLOCK_VALUES
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in cases:
        model, degrees, ac_mode = CASES[case]
        with tempfile.TemporaryDirectory() as dump:
            config = job_config(model, degrees, ac_mode, dump)
            plan = preflight(config, World.current(torch.device("cpu")))
            _, parts, _ = _build_model(config, plan, VOCAB, False, cross_entropy_loss)
        states = [None] * world if rank == 0 else None
        dist.gather_object(full_state(parts), states)
        if rank == 0:
            merged: dict[str, torch.Tensor] = {}
            for state in states:
                for name, tensor in state.items():
                    # A name on two stages (the RoPE table) must hold the same values.
                    assert name not in merged or torch.equal(merged[name], tensor), name
                    merged[name] = tensor
            torch.save(merged, os.path.join(out, f"{case}.pt"))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
