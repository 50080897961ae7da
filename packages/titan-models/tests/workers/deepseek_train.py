"""Train a tiny DeepSeek-V3 for a few steps under each named layout, with the experts' bias
update after every step (over ``dp_cp``, as titan-train does); rank 0 writes
``{layout: [loss per step]}`` to ``<out_dir>/losses.json``, plus ``"<layout>.grad_norms"``
(the global gradient norm of each step), ``"<layout>.bias"``: per
MoE layer of rank 0's stages, the sum of |expert_bias| after the last step, and
``"<layout>.load"``: the last step's load metrics and ``counted/<layer>``, the tokens the
last step routed in each layer (summed over dp x cp).

The single-process references are the same function with the layouts ``single`` and
``single_5`` (world 1; 3 and 5 blocks).

Run: torchrun --nproc-per-node N deepseek_train.py OUT_DIR LAYOUT [LAYOUT ...]
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
from titan_models.deepseek_v3 import (
    DeepSeekV3,
    DeepSeekV3Args,
    parallelize_deepseek_v3,
    pipeline_deepseek_v3,
)
from titan_models.moe import ExpertBalancer

BATCH, SEQ, STEPS, LR = 4, 32, 3, 3e-3

# name -> (ParallelDims degrees, ParallelizeConfig fields, PipelineConfig fields or None)
LAYOUTS = {
    "single": ({}, {}, None),
    "single_5": ({}, {}, None),  # the 5-block model the pipelines split
    "fsdp": ({"dp_shard": 2}, {}, None),
    "ep": ({"dp_shard": 2, "ep": 2}, {}, None),
    "ep_ac": ({"dp_shard": 2, "ep": 2}, {"activation_checkpoint": {"mode": "full"}}, None),
    "tp": ({"tp": 2, "dp_shard": 1}, {}, None),
    # Per-block compile (inductor, counting its calls): MoE blocks with graph breaks.
    "ep_compile": (
        {"dp_shard": 2, "ep": 2},
        {"compile": True, "compile_backend": tiny.COUNTING_BACKEND},
        None,
    ),
    "cp": ({"cp": 2, "dp_shard": 1}, {}, None),
    "pp": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "1F1B"}),
    # Four ranks.
    "ep_fsdp": ({"dp_shard": 4, "ep": 2}, {}, None),
    "ep_tp": ({"dp_shard": 2, "ep": 2, "tp": 2}, {}, None),
    "ep_pp": ({"dp_shard": 2, "ep": 2, "pp": 2}, {}, {"schedule": "1F1B"}),
    "hsdp_ep": ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, {}, None),
}


EXPERT_SHAPES: dict[str, dict[str, list[int]]] = {}
"""Per layout: this rank's local expert weight shapes (``tiny.expert_shapes``) after
parallelizing, before FSDP gathers anything."""


def n_layers_of(layout: str) -> int:
    """3 blocks (1 dense, 2 MoE); 5 for the pipelines (2 stages) and their reference."""
    return 5 if LAYOUTS[layout][2] is not None or layout == "single_5" else 3


def tiny_args(n_layers: int, q_lora_rank: int = 0) -> DeepSeekV3Args:
    """dim 64, one dense block then MoE blocks of 4 routed experts (top 2) and a shared one,
    4 heads of latent attention; vocab 256. A fast bias update (0.05) so that the bias moves
    the routing within the few steps."""
    return DeepSeekV3Args(
        vocab_size=256,
        dim=64,
        inter_dim=128,
        moe_inter_dim=32,
        n_layers=n_layers,
        n_dense_layers=1,
        n_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        n_activated_experts=2,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_seq_len=SEQ,
        load_balance_coeff=0.05,
    )


def reference_state_dict(n_layers: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = DeepSeekV3(tiny_args(n_layers))
    model.init_weights()
    return model.state_dict()


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (STEPS, BATCH, SEQ + 1), generator=generator)
    return tokens[..., :-1], tokens[..., 1:]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _build(layout: str, dims: ParallelDims, rows: int) -> tuple[list[torch.nn.Module], object]:
    _, overrides, pipeline = LAYOUTS[layout]
    config = ParallelizeConfig(**{"param_dtype": "float32", **overrides})
    n_layers = n_layers_of(layout)
    with torch.device("meta"):
        model = DeepSeekV3(tiny_args(n_layers))
    pipe = None
    if pipeline is None:
        parts = [parallelize_deepseek_v3(model, dims, config, seq_len=SEQ)]
    else:
        pipe = pipeline_deepseek_v3(
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
    full = reference_state_dict(n_layers)
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(buffer_device=torch.device("cpu"))
        mine = set(part.state_dict())
        set_model_state_dict(
            part,
            {k: v for k, v in full.items() if k in mine},
            options=StateDictOptions(full_state_dict=True),
        )
    return parts, pipe


def _grad_norm(parts: list[torch.nn.Module], dims: ParallelDims) -> float:
    """The global gradient norm (every parameter's full gradient once; stages summed over
    ``pp``): AdamW hides a wrongly scaled gradient, the norm does not."""
    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        for param in part.parameters():
            grad = param.grad
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            total += grad.double().pow(2).sum()
    if dims.pp_enabled:
        dist.all_reduce(total, group=dims.get_mesh("pp").get_group())
    return total.sqrt().item()


def train(layout: str) -> tuple[list[float], list[float], dict[str, float], dict[str, float]]:
    degrees = LAYOUTS[layout][0]
    world = 1 if layout.startswith("single") else dist.get_world_size()
    dims = ParallelDims(world_size=world, device_type="cpu", **degrees)
    rows = BATCH // dims.dp_degree
    start = dims.dp_rank() * rows if dims.dp_enabled else 0
    parts, pipe = _build(layout, dims, rows)
    EXPERT_SHAPES[layout] = tiny.expert_shapes(parts)
    group = dims.get_mesh("dp_cp") if "dp_cp" in dims.layout.names else None
    balancer = ExpertBalancer(parts, group)
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=LR)
    inputs, labels = batches()
    losses, grad_norms = [], []
    for step in range(STEPS):
        x, y = inputs[step, start : start + rows], labels[step, start : start + rows]
        cp_batch = context_parallel_batch(x, y, parallel_dims=dims, config=ParallelizeConfig())
        parallel_logits = dims.tp_enabled
        with cp_batch as (x, y), loss_parallel() if parallel_logits else contextlib.nullcontext():
            if pipe is None:
                loss = cross_entropy(parts[0](x), y)
                loss.backward()
            else:
                loss = pipe.step(x, y)
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        if pipe is not None:
            value = torch.zeros(()) if value is None else value.detach().clone()
            dist.all_reduce(value, group=dims.get_mesh("pp").get_group())
        grad_norms.append(_grad_norm(parts, dims))
        optimizer.step()
        optimizer.zero_grad()
        balancer()
        value = value.detach().clone()
        if dims.dp_cp_enabled:
            dist.all_reduce(value, group=dims.get_mesh("dp_cp").get_group())
            value /= dims.dp_degree * dims.cp
        losses.append(value.item())
    bias = {
        name: float(layer.expert_bias.abs().sum())
        for name, layer in zip(balancer.names, balancer.layers, strict=True)
    }
    # Tokens the last step routed, per MoE layer, summed over dp x cp: BATCH x SEQ x top-k.
    counted = dict(zip(balancer.names, balancer.last_counts.sum(dim=1).tolist(), strict=True))
    load = {**balancer.metrics(), **{f"counted/{k}": v for k, v in counted.items()}}
    return losses, grad_norms, bias, load


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed(device_type="cpu")
    tiny.register_counting_backend()
    results = {}
    for layout in sys.argv[2:]:
        compiled_before = tiny.COMPILED["calls"]
        losses, grad_norms, bias, load = train(layout)
        results[f"{layout}.compiled_calls"] = tiny.COMPILED["calls"] - compiled_before
        results[layout] = losses
        results[f"{layout}.grad_norms"] = grad_norms
        results[f"{layout}.bias"] = bias
        results[f"{layout}.load"] = load
        results[f"{layout}.expert_shapes"] = EXPERT_SHAPES[layout]
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
