"""Expert parallelism against one process: every rank feeds its own tokens through an MoE
layer whose experts are sharded over all ranks, and compares with the same layer run
unsharded on all ranks' tokens concatenated (each rank computes that reference itself).
Rank 0 writes ``{case: [max errors]}`` to ``<out_dir>/losses.json`` (max over ranks):
output, expert-weight gradients (``full_tensor``), the other gradients summed over ranks,
token counts summed over ranks.

Run: torchrun --nproc-per-node N moe_expert_parallel.py OUT_DIR CASE [CASE ...]
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from titan_dims import ParallelDims, init_distributed
from titan_models import ModelConfigError
from titan_models.moe import MoE, MoEArgs
from titan_models.parallel import apply_expert_parallel

DIM, HIDDEN, SEQS_PER_RANK, SEQ = 16, 32, 2, 6

# case -> MoEArgs fields (and how the layer is run)
CASES = {
    "grouped_mm": {"top_k": 2, "score_func": "sigmoid", "route_norm": True},
    "fallback": {"top_k": 2, "use_grouped_mm": False, "n_expert_groups": 4, "n_limited_groups": 2},
    # Every token goes to experts 0 and 1 (rank 0's): the other ranks receive nothing.
    "skewed": {"top_k": 2, "num_shared_experts": 0},
    "checkpointed": {"top_k": 3, "score_func": "sigmoid", "aux_loss_alpha": 0.01},
}


def build(fields: dict) -> MoE:
    moe = MoE(MoEArgs(num_experts=8, **fields), dim=DIM, hidden_dim=HIDDEN)
    torch.manual_seed(0)
    moe.init_weights(init_std=0.1)
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 1.0)
    return moe


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def compare(case: str) -> list[float]:
    fields = CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = build(fields), build(fields)
    if case == "skewed":
        for moe in (reference, sharded):
            moe.expert_bias[:2] = 10.0
    apply_expert_parallel(sharded, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    # Gradients are summed over ranks here; each rank's balance loss averages its own
    # sequences, so 1/world of it on each sums to the reference's average over all of them.
    sharded.aux_loss_grad_scale = 1 / world
    torch.manual_seed(1)
    x = torch.randn(world * SEQS_PER_RANK, SEQ, DIM)
    grad = torch.randn_like(x)
    reference(x).backward(grad)
    mine = slice(rank * SEQS_PER_RANK, (rank + 1) * SEQS_PER_RANK)
    local_x = x[mine].clone().requires_grad_()
    if case == "checkpointed":
        out = checkpoint(sharded, local_x, use_reentrant=False)
    else:
        out = sharded(local_x)
    out.backward(grad[mine])
    with torch.no_grad():
        errors = [max_error(out, reference(x)[mine])]
    for param, ref in zip(sharded.parameters(), reference.parameters(), strict=True):
        grad_of = param.grad
        if isinstance(grad_of, DTensor):
            grad_of = grad_of.full_tensor()
        else:  # each rank's own tokens: the data-parallel sum
            dist.all_reduce(grad_of)
        errors.append(max_error(grad_of, ref.grad))
    counts = sharded.tokens_per_expert.clone()
    dist.all_reduce(counts)
    errors.append(max_error(counts, reference.tokens_per_expert))
    return errors


def with_fsdp() -> list[float]:
    """EP over ``ep`` = 2 with FSDP2 as the DeepSeek-V3 plan applies it (experts over
    ``dp_shard_mod_ep``, the rest over ``dp_shard_cp``), every rank's gradient averaged over
    all ranks: the experts' FSDP divides by ``fsdp_gradient_divide_factor`` with sum-only
    collectives (gloo has no PREMUL_SUM). Gradients times world size equal the reference's."""
    world = dist.get_world_size()
    dims = ParallelDims(world_size=world, dp_shard=world, ep=2, device_type="cpu")
    fields = CASES["grouped_mm"]
    reference, sharded = build(fields), build(fields)
    apply_expert_parallel(sharded, dims.get_mesh("ep"))
    experts_mesh = dims.get_mesh("dp_shard_mod_ep")
    fully_shard(sharded.experts, mesh=experts_mesh)
    fully_shard(sharded, mesh=dims.get_mesh("dp_shard_cp"))
    sharded.experts.set_gradient_divide_factor(dims.fsdp_gradient_divide_factor)
    # Sum-only collectives (pre/post division) where there is a collective: torch 2.13
    # divides twice on a one-rank mesh with them (its copy path and the post-division).
    sharded.experts.set_force_sum_reduction_for_comms(experts_mesh.size() > 1)
    torch.manual_seed(1)
    x = torch.randn(world * SEQS_PER_RANK, SEQ, DIM)
    grad = torch.randn_like(x)
    reference(x).backward(grad)
    mine = slice(dist.get_rank() * SEQS_PER_RANK, (dist.get_rank() + 1) * SEQS_PER_RANK)
    out = sharded(x[mine])
    out.backward(grad[mine])
    with torch.no_grad():
        errors = [max_error(out, reference(x)[mine])]
    for param, ref in zip(sharded.parameters(), reference.parameters(), strict=True):
        errors.append(max_error(param.grad.full_tensor() * world, ref.grad))
    return errors


def reshard_checkpoint(out_dir: Path) -> list[float]:
    """Save at ep = world size with DCP; load into an unsharded layer (ep 1) and, on 4 ranks,
    at ep 2: the weights come back equal."""
    world = dist.get_world_size()
    original = build(CASES["grouped_mm"])
    with torch.no_grad():
        original.expert_bias.copy_(torch.arange(8.0))
    sharded = build(CASES["grouped_mm"])
    sharded.load_state_dict(original.state_dict())
    apply_expert_parallel(sharded, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    path = out_dir / "ckpt"
    dcp.save(sharded.state_dict(), checkpoint_id=path)
    targets = [MoE(MoEArgs(num_experts=8, top_k=2), dim=DIM, hidden_dim=HIDDEN)]
    if world == 4:
        two_d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
        at_ep2 = MoE(MoEArgs(num_experts=8, top_k=2), dim=DIM, hidden_dim=HIDDEN)
        apply_expert_parallel(at_ep2, two_d["ep"])
        targets.append(at_ep2)
    errors = []
    for target in targets:
        state = target.state_dict()
        dcp.load(state, checkpoint_id=path)
        target.load_state_dict(state)
        for name, value in target.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            errors.append(max_error(full, original.state_dict()[name]))
    return errors


def from_meta() -> list[float]:
    """Built on the meta device, sharded, then materialized and initialized as a trainer
    does: local shards of E / ep experts, buffers zeroed, and a forward + backward runs."""
    world = dist.get_world_size()
    with torch.device("meta"):
        moe = MoE(MoEArgs(num_experts=2 * world, top_k=2), dim=DIM, hidden_dim=HIDDEN)
    apply_expert_parallel(moe, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    moe.to_empty(device="cpu")
    moe.init_weights(0.02, buffer_device=torch.device("cpu"))
    local = moe.experts.w1.to_local()
    moe(torch.randn(2, SEQ, DIM)).sum().backward()
    failures = float(tuple(local.shape) != (2, DIM, HIDDEN))
    failures += float(moe.expert_bias.abs().sum() != 0)
    failures += float(not 0.01 < local.std().item() < 0.03)
    failures += float(moe.experts.w1.grad is None)
    return [failures]


def refusals() -> list[float]:
    """num_experts not divisible by ep, and a model without MoE layers: one ModelConfigError
    each, and nothing sharded."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    moe = MoE(MoEArgs(num_experts=world + 1), dim=DIM, hidden_dim=HIDDEN)
    failures = 0.0
    for model, words in ((moe, "num_experts"), (torch.nn.Linear(2, 2), "has none")):
        try:
            apply_expert_parallel(model, mesh)
            failures += 1
        except ModelConfigError as error:
            failures += words not in str(error)
    failures += isinstance(moe.experts.w1, DTensor)
    return [failures]


class HostReads(TorchDispatchMode):
    """Counts the host reads of tensor values within it (a device-to-host sync on an
    accelerator): ``.item()``/``int()``/``bool()`` (``_local_scalar_dense``), copies to the
    host, ``repeat_interleave`` without ``output_size`` and ``nonzero`` (both read a size);
    and ``.tolist()``, which a CPU tensor answers without dispatching an op."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __enter__(self):
        original = self._tolist = torch.Tensor.tolist

        def tolist(tensor: torch.Tensor):
            self.count += 1
            return original(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        sized = func == aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if sized or func in (aten._local_scalar_dense.default, aten.nonzero.default):
            self.count += 1
        elif func == aten._to_copy.default and kwargs.get("device") == torch.device("cpu"):
            self.count += args[0].device.type != "cpu"
        return func(*args, **kwargs)


def host_reads() -> list[float]:
    """Host reads in one expert-parallel forward of the grouped-mm layer (whose own code
    reads nothing on the host): the one copy of both split lists."""
    world = dist.get_world_size()
    moe = build(CASES["grouped_mm"])
    apply_expert_parallel(moe, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)))
    x = torch.randn(SEQS_PER_RANK, SEQ, DIM)
    moe(x)  # the first call probes grouped mm (host reads of its own)
    with HostReads() as reads:
        moe(x)
    return [float(reads.count)]


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed(device_type="cpu")
    results = {}
    for case in sys.argv[2:]:
        if case == "reshard":
            errors = reshard_checkpoint(out_dir)
        elif case == "meta":
            errors = from_meta()
        elif case == "fsdp":
            errors = with_fsdp()
        elif case == "refusals":
            errors = refusals()
        elif case == "host_reads":
            errors = host_reads()
        else:
            errors = compare(case)
        result = torch.tensor(errors, dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        results[case] = result.tolist()
    if dist.get_rank() == 0:
        (out_dir / "losses.json").write_text(json.dumps(results))
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown: with torch 2.13, a gloo group still referenced
    # somewhere and freed during finalization now and then aborts the process after all its
    # work is done ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
