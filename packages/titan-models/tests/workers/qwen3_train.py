"""Train a tiny Qwen3 (dense with tied or untied embeddings, or MoE) for a few steps under
each named layout, with the experts' bias update after every step for the MoE model (over
``dp_cp``, as titan-train does); rank 0 writes ``{layout: [loss per step]}`` to
``<out_dir>/losses.json``, plus ``"<layout>.grad_norms"`` (the global gradient norm of each
step, before the optimizer step), ``"<layout>.tied"`` (whether the output projection
still is the embedding's parameter after parallelizing) and ``"<layout>.compiled_calls"``.

The single-process references are the same function with the layouts ``single_tied``,
``single_untied`` and ``single_moe`` (world 1).

Run: torchrun --nproc-per-node N qwen3_train.py OUT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from pathlib import Path

import tiny
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn import functional

from titan_dims import ParallelDims, init_distributed
from titan_models import ParallelizeConfig, PipelineConfig, context_parallel_batch
from titan_models.moe import ExpertBalancer
from titan_models.qwen3 import pipeline_qwen3
from titan_models.qwen3.args import Qwen3Args
from titan_models.qwen3.model import Qwen3
from titan_models.qwen3.parallelize import parallelize_qwen3

BATCH, SEQ, STEPS, LR = 4, 32, 3, 3e-3
_AC_FULL = {"activation_checkpoint": {"mode": "full"}}
_AC_OP = {"activation_checkpoint": {"mode": "selective", "selective_option": "op"}}

# name -> (model, ParallelDims degrees, ParallelizeConfig fields, PipelineConfig or None)
LAYOUTS = {
    "single_tied": ("tied", {}, {}, None),
    "single_untied": ("untied", {}, {}, None),
    "single_moe": ("moe", {}, {}, None),
    # Two ranks.
    "fsdp_tied": ("tied", {"dp_shard": 2}, {}, None),
    "fsdp_untied": ("untied", {"dp_shard": 2}, {}, None),
    "ddp_tied": ("tied", {"dp_replicate": 2, "dp_shard": 1}, {}, None),
    "fsdp_ac_tied": ("tied", {"dp_shard": 2}, _AC_FULL, None),
    # Per-block compile (inductor, counting its calls): dense blocks whole (fullgraph).
    "fsdp_compile_tied": (
        "tied",
        {"dp_shard": 2},
        {"compile": True, "compile_backend": tiny.COUNTING_BACKEND},
        None,
    ),
    "tp_tied": ("tied", {"tp": 2, "dp_shard": 1}, {}, None),
    "tp_untied": ("untied", {"tp": 2, "dp_shard": 1}, {}, None),
    "tp_replicated_logits_tied": ("tied", {"tp": 2, "dp_shard": 1}, {"loss_parallel": False}, None),
    "cp_tied": ("tied", {"cp": 2, "dp_shard": 1}, _AC_OP, None),
    "cp_ring_untied": ("untied", {"cp": 2, "dp_shard": 1}, {"cp_attention": "titan_ring"}, None),
    "pp_untied": ("untied", {"pp": 2, "dp_shard": 1}, {}, {"schedule": "1F1B"}),
    "pp_tied": ("tied", {"pp": 2, "dp_shard": 1}, {}, {"schedule": "1F1B"}),
    "ep_moe": ("moe", {"dp_shard": 2, "ep": 2}, {}, None),
    "tp_moe": ("moe", {"tp": 2, "dp_shard": 1}, {}, None),
    # Four ranks.
    "hsdp_tied": ("tied", {"dp_replicate": 2, "dp_shard": 2}, {}, None),
    "fsdp_tp_tied": ("tied", {"dp_shard": 2, "tp": 2}, _AC_FULL, None),
    "fsdp_tp_untied": ("untied", {"dp_shard": 2, "tp": 2}, {}, None),
    "pp_fsdp_untied": ("untied", {"pp": 2, "dp_shard": 2}, {}, {"schedule": "1F1B"}),
    "pp_fsdp_tied": ("tied", {"pp": 2, "dp_shard": 2}, {}, {"schedule": "GPipe"}),
    "pp_tp_tied": ("tied", {"pp": 2, "tp": 2, "dp_shard": 1}, {}, {"schedule": "1F1B"}),
    "ep_fsdp_moe": ("moe", {"dp_shard": 4, "ep": 2}, {}, None),
    "ep_tp_moe": ("moe", {"dp_shard": 2, "ep": 2, "tp": 2}, {}, None),
    # Experts split over tp, then sharded over dp_shard (2-D DTensors), recomputed by AC.
    "fsdp_tp_moe": ("moe", {"dp_shard": 2, "tp": 2}, _AC_FULL, None),
    "ep_pp_moe": ("moe", {"dp_shard": 2, "ep": 2, "pp": 2}, {}, {"schedule": "1F1B"}),
}


def tiny_args(kind: str) -> Qwen3Args:
    """dim 64, 2 blocks, 4 query / 2 key-value heads of 16 channels (n_heads x head_dim is
    not dim), vocab 256; ``moe``: MoE blocks of 4 experts (top 2) and a fast bias update
    (0.05) so that the bias moves the routing within the few steps."""
    fields: dict = dict(
        dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96,
        vocab_size=256, max_seq_len=SEQ, enable_weight_tying=kind == "tied",
    )  # fmt: skip
    if kind == "moe":
        fields.update(
            moe_enabled=True, moe_inter_dim=32, num_experts=4, top_k=2, load_balance_coeff=0.05
        )
    return Qwen3Args(**fields)


def reference_state_dict(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Qwen3(tiny_args(kind))
    model.init_weights()
    return model.state_dict()


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    """The same random batch every step, so that the loss falls within the few steps."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=generator).expand(STEPS, -1, -1)
    return tokens[..., :-1], tokens[..., 1:]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _build(layout: str, dims: ParallelDims, rows: int) -> tuple[list[torch.nn.Module], object]:
    kind, _, overrides, pipeline = LAYOUTS[layout]
    config = ParallelizeConfig(**{"param_dtype": "float32", **overrides})
    with torch.device("meta"):
        model = Qwen3(tiny_args(kind))
    pipe = None
    if pipeline is None:
        parts = [parallelize_qwen3(model, dims, config, seq_len=SEQ)]
    else:
        pipe = pipeline_qwen3(
            model,
            dims,
            PipelineConfig(**pipeline),
            config,
            local_batch_size=rows,
            loss_fn=cross_entropy,
            device="cpu",
            seq_len=SEQ,
        )
        parts = pipe.model_parts
    full = reference_state_dict(kind)
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(buffer_device=torch.device("cpu"))
        mine = set(part.state_dict())
        set_model_state_dict(
            part,
            {k: v for k, v in full.items() if k in mine},
            options=StateDictOptions(full_state_dict=True),
        )
    if pipe is not None:
        pipe.sync_tied_weights()
    return parts, pipe


def _grad_norm(parts: list[torch.nn.Module], dims: ParallelDims, pipe) -> float:
    """The global gradient norm (every parameter's full gradient once, a tied weight once,
    also when the pipeline holds it at both ends; stages summed over ``pp``): AdamW hides a
    wrongly scaled gradient, the norm does not."""
    total = torch.zeros((), dtype=torch.float64)
    mirrored = {id(p) for p in pipe.mirrored_parameters} if pipe is not None else set()
    for part in parts:
        for param in part.parameters():
            if id(param) in mirrored:
                continue
            grad = param.grad
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            total += grad.double().pow(2).sum()
    if dims.pp_enabled:
        dist.all_reduce(total, group=dims.get_mesh("pp").get_group())
    return total.sqrt().item()


def _loss_of_step(parts, pipe, dims, x, y) -> torch.Tensor:
    cp_batch = context_parallel_batch(x, y, parallel_dims=dims, config=ParallelizeConfig())
    with cp_batch as (x, y), loss_parallel() if dims.tp_enabled else contextlib.nullcontext():
        if pipe is None:
            loss = cross_entropy(parts[0](x), y)
            loss.backward()
        else:
            loss = pipe.step(x, y)
            pipe.sync_tied_grads()
    value = loss.full_tensor() if isinstance(loss, DTensor) else loss
    if pipe is not None:
        value = torch.zeros(()) if value is None else value.detach().clone()
        dist.all_reduce(value, group=dims.get_mesh("pp").get_group())
    value = value.detach().clone()
    if dims.dp_cp_enabled:
        dist.all_reduce(value, group=dims.get_mesh("dp_cp").get_group())
        value /= dims.dp_degree * dims.cp
    return value


def train(layout: str) -> dict[str, object]:
    _, degrees, _, _ = LAYOUTS[layout]
    world = 1 if layout.startswith("single") else dist.get_world_size()
    dims = ParallelDims(world_size=world, device_type="cpu", **degrees)
    rows = BATCH // dims.dp_degree
    start = dims.dp_rank() * rows if dims.dp_enabled else 0
    parts, pipe = _build(layout, dims, rows)
    # Before the first step (FSDP would show its own shards).
    shapes = tiny.expert_shapes(parts)
    ends = (parts[0].tok_embeddings, parts[0].output)
    tied = None not in ends and ends[1].weight is ends[0].weight
    group = dims.get_mesh("dp_cp") if "dp_cp" in dims.layout.names else None
    balancer = ExpertBalancer(parts, group)
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=LR)
    inputs, labels = batches()
    losses, grad_norms = [], []
    for step in range(STEPS):
        x, y = inputs[step, start : start + rows], labels[step, start : start + rows]
        value = _loss_of_step(parts, pipe, dims, x, y)
        grad_norms.append(_grad_norm(parts, dims, pipe))
        optimizer.step()
        optimizer.zero_grad()
        if balancer.layers:
            balancer()
        losses.append(value.item())
    return {
        layout: losses,
        f"{layout}.grad_norms": grad_norms,
        f"{layout}.tied": tied,
        f"{layout}.expert_shapes": shapes,
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed(device_type="cpu")
    results: dict[str, object] = {}
    tiny.register_counting_backend()
    for layout in sys.argv[2:]:
        compiled_before = tiny.COMPILED["calls"]
        results.update(train(layout))
        results[f"{layout}.compiled_calls"] = tiny.COMPILED["calls"] - compiled_before
    if dist.get_rank() == 0:
        (out_dir / "losses.json").write_text(json.dumps(results))
    gc.collect()  # free FSDP state (it holds gloo work) while the group exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown (see workers/parallel_train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
