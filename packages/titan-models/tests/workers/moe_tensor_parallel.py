"""Tensor parallel without expert parallel (``apply_moe_tp``) against one process: every
rank holds 1/tp of every expert's hidden dimension and its part of the sequence; the layer
is compared with the same layer run whole on the whole batch (each rank computes that
reference itself). Rank 0 writes ``{case: [max errors]}`` to ``<out_dir>/losses.json`` (max
over ranks): output, each parameter's gradient (``full_tensor`` of the split experts; the
router's as it is, summed over tp by the plan), the input's gradient, the token counts; then
``1 / tp`` minus the fraction of each expert weight this rank holds (0: a 1/tp slice).

Run: torchrun --nproc-per-node N moe_tensor_parallel.py OUT_DIR CASE [CASE ...]
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
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from titan_dims import init_distributed
from titan_models.moe import MoE, MoEArgs
from titan_models.parallel import apply_moe_tp

DIM, HIDDEN, BATCH, SEQ_PER_RANK = 16, 32, 2, 6

# case -> MoEArgs fields
CASES = {
    "grouped_mm": {"top_k": 2, "score_func": "sigmoid", "route_norm": True},
    "fallback": {"top_k": 2, "use_grouped_mm": False, "n_expert_groups": 4, "n_limited_groups": 2},
    "no_shared": {"top_k": 2, "num_shared_experts": 0},
    # The balance loss's gradient added on every rank: divided by tp. Under checkpointing.
    "aux_loss": {"top_k": 3, "score_func": "sigmoid", "aux_loss_alpha": 0.01},
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


def tp_mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def compare(case: str) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, split = build(CASES[case]), build(CASES[case])
    apply_moe_tp(split, tp_mesh())
    torch.manual_seed(1)
    x = torch.randn(BATCH, world * SEQ_PER_RANK, DIM, requires_grad=True)
    grad = torch.randn_like(x)
    reference(x).backward(grad)
    mine = slice(rank * SEQ_PER_RANK, (rank + 1) * SEQ_PER_RANK)
    local_x = x.detach()[:, mine].clone().requires_grad_()
    run = (lambda x: checkpoint(split, x, use_reentrant=False)) if case == "aux_loss" else split
    out = run(local_x)
    out.backward(grad[:, mine])
    with torch.no_grad():
        errors = [max_error(out, reference(x)[:, mine])]
    held = []
    for (name, param), ref in zip(split.named_parameters(), reference.parameters(), strict=True):
        grad_of = param.grad
        if isinstance(grad_of, DTensor):  # the split experts, and the replicated gate
            grad_of = grad_of.full_tensor()
        if "expert" in name:
            held.append(abs(1 / world - param.to_local().numel() / ref.numel()))
        errors.append(max_error(grad_of, ref.grad))
    errors.append(max_error(local_x.grad, x.grad[:, mine]))
    errors.append(max_error(split.tokens_per_expert, reference.tokens_per_expert))
    return errors + held


def reshard_checkpoint(out_dir: Path) -> list[float]:
    """Save the split layer with DCP; load it into a whole layer (one process's layout)
    and into a split one: the weights come back equal."""
    original = build(CASES["grouped_mm"])
    with torch.no_grad():
        original.expert_bias.copy_(torch.arange(8.0))
    split = build(CASES["grouped_mm"])
    split.load_state_dict(original.state_dict())
    apply_moe_tp(split, tp_mesh())
    path = out_dir / "ckpt"
    dcp.save(split.state_dict(), checkpoint_id=path)
    whole = MoE(MoEArgs(num_experts=8, top_k=2), dim=DIM, hidden_dim=HIDDEN)
    again = MoE(MoEArgs(num_experts=8, top_k=2), dim=DIM, hidden_dim=HIDDEN)
    apply_moe_tp(again, tp_mesh())
    errors = []
    for target in (whole, again):
        state = target.state_dict()
        dcp.load(state, checkpoint_id=path)
        target.load_state_dict(state)
        for name, value in target.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            errors.append(max_error(full, original.state_dict()[name]))
    return errors


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed(device_type="cpu")
    results = {}
    for case in sys.argv[2:]:
        errors = reshard_checkpoint(out_dir) if case == "reshard" else compare(case)
        result = torch.tensor(errors, dtype=torch.float64)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        results[case] = result.tolist()
    if dist.get_rank() == 0:
        (out_dir / "losses.json").write_text(json.dumps(results))
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown (see workers/moe_expert_parallel.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
