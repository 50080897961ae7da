"""Train the tiny Llama 3 for a few steps under each named parallel layout; rank 0 writes
``{layout: [loss per step]}`` to ``<out_dir>/losses.json``, plus ``"<layout>.<what>"`` entries
for what some layouts observe (compiled calls, dtypes).

Run: torchrun --nproc-per-node N parallel_train.py OUT_DIR LAYOUT [LAYOUT ...]
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

from titan_dims import ParallelDims, init_distributed
from titan_models import ParallelizeConfig, PipelineConfig, context_parallel_batch
from titan_models.llama3 import Llama3, parallelize_llama, pipeline_llama
from titan_models.llama3.model import CausalAttention
from titan_models.parallel import (
    ContextParallelAttention,
    RingContextParallelAttention,
    context_parallel_shard,
)

_AC_OP = {"activation_checkpoint": {"mode": "selective", "selective_option": "op"}}
_AC_FULL = {"activation_checkpoint": {"mode": "full"}}

# name -> (ParallelDims degrees, ParallelizeConfig fields, PipelineConfig fields or None)
LAYOUTS = {
    "fsdp": ({"dp_shard": 2}, {}, None),
    "fsdp_ac_op": ({"dp_shard": 2}, _AC_OP, None),
    "fsdp_offload": ({"dp_shard": 2}, {"cpu_offload": True}, None),
    "fsdp_compile": (
        {"dp_shard": 2},
        {"compile": True, "compile_backend": tiny.COUNTING_BACKEND},
        None,
    ),
    # bf16 compute, fp32 master weights and gradient reduction.
    "fsdp_bf16": ({"dp_shard": 2}, {"param_dtype": "bfloat16", "reduce_dtype": "float32"}, None),
    "ddp": ({"dp_replicate": 2, "dp_shard": 1}, {}, None),
    "tp": ({"tp": 2, "dp_shard": 1}, {}, None),
    "tp_replicated_logits": ({"tp": 2, "dp_shard": 1}, {"loss_parallel": False}, None),
    "hsdp": ({"dp_replicate": 2, "dp_shard": 2}, {}, None),
    "fsdp_tp": ({"dp_shard": 2, "tp": 2}, _AC_FULL, None),
    # Pipelines run the 4-block model: interleaved schedules put 2 stages on each rank.
    "pp_gpipe": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "GPipe"}),
    "pp_1f1b": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "1F1B"}),
    "pp_interleaved_1f1b": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "Interleaved1F1B"}),
    "pp_interleaved_zb": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "InterleavedZeroBubble"}),
    "pp_zbv": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "ZBVZeroBubble"}),
    # One stage per rank (layers_per_stage=2), 1F1B order written out by hand.
    "pp_csv": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "CSV", "layers_per_stage": 2}),
    "pp_fsdp": ({"pp": 2, "dp_shard": 2}, {}, {"schedule": "1F1B"}),
    "pp_tp_loss_parallel": ({"pp": 2, "tp": 2, "dp_shard": 1}, {}, {"schedule": "1F1B"}),
    "cp": ({"cp": 2, "dp_shard": 1}, {}, None),
    "cp_ring": ({"cp": 2, "dp_shard": 1}, {"cp_attention": "titan_ring"}, None),
    "fsdp_cp_ring": ({"dp_shard": 2, "cp": 2}, {"cp_attention": "titan_ring"}, None),
    "fsdp_cp": ({"dp_shard": 2, "cp": 2}, _AC_OP, None),
    "tp_cp": ({"tp": 2, "cp": 2, "dp_shard": 1}, {}, None),
    "pp_tp": (
        {"pp": 2, "tp": 2, "dp_shard": 1},
        {"loss_parallel": False},
        {"schedule": "Interleaved1F1B"},
    ),
}


# Rows: pipeline ranks; cells: <stage>F<microbatch> forward, <stage>B<microbatch> backward.
CSV_1F1B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"


def _load_reference(model: torch.nn.Module, n_layers: int) -> None:
    """Materialize and overwrite the random init with the reference weights: the full state
    dict is sharded into whatever DTensors the plan made (keys of absent stages ignored)."""
    model.to_empty(device="cpu")
    model.init_weights()
    full = tiny.reference_state_dict(n_layers)
    mine = set(model.state_dict())
    set_model_state_dict(
        model,
        {k: v for k, v in full.items() if k in mine},
        options=StateDictOptions(full_state_dict=True),
    )


def train(layout: str, out_dir: Path, observed: dict[str, list]) -> list[float]:
    """Per-step losses of ``layout``; what it observed goes to ``observed`` (see ``main``)."""
    degrees, overrides, pipeline = LAYOUTS[layout]
    dims = ParallelDims(world_size=dist.get_world_size(), device_type="cpu", **degrees)
    config = ParallelizeConfig(**{"param_dtype": "float32", **overrides})
    n_layers = 4 if pipeline is not None else 2
    with torch.device("meta"):
        model = Llama3(tiny.tiny_args(n_layers))
    shards = dims.dp_degree
    rows = tiny.BATCH // shards
    start = dims.dp_rank() * rows if dims.dp_enabled else 0

    if pipeline is None:
        parallelize_llama(model, dims, config, seq_len=tiny.SEQ)
        parts = [model]
    else:
        if pipeline["schedule"] == "CSV":
            csv = out_dir / f"schedule_rank{dist.get_rank()}.csv"
            csv.write_text(CSV_1F1B)
            pipeline = {**pipeline, "schedule_csv": str(csv)}
        pipe = pipeline_llama(
            model,
            dims,
            PipelineConfig(**pipeline),
            config,
            local_batch_size=rows,
            loss_fn=tiny.cross_entropy,
            device="cpu",
            seq_len=tiny.SEQ,
        )
        parts = pipe.model_parts
    for part in parts:
        _load_reference(part, n_layers)
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=tiny.LR)
    # The dtype every block computes in: the output of its feed-forward.
    activation_dtypes = set()
    blocks = [block for part in parts for block in part.layers.values()]
    rope_dtypes = set()
    for block in blocks:
        block.feed_forward.register_forward_hook(
            lambda module, args, out: activation_dtypes.add(str(out.dtype))
        )
        block.attention.register_forward_pre_hook(
            lambda module, args: rope_dtypes.add(str(args[1].dtype))
        )
    compiled_before = tiny.COMPILED["calls"]

    inputs, labels = tiny.batches()
    losses = []
    for step in range(tiny.STEPS):
        x = inputs[step, start : start + rows]
        y = labels[step, start : start + rows]
        # Under context parallel: this rank's share of the sequence, as a trainer does it.
        cp_batch = context_parallel_batch(x, y, parallel_dims=dims, config=config)
        if pipeline is None:
            with cp_batch as (x, y):
                logits = model(x)
                parallel_loss = isinstance(logits, DTensor)
                with loss_parallel() if parallel_loss else contextlib.nullcontext():
                    loss = tiny.cross_entropy(logits, y)
                    loss.backward()
            value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        else:
            # The last stage's loss_fn sees vocab-sharded DTensor logits under TP.
            with (
                cp_batch as (x, y),
                loss_parallel() if dims.tp_enabled else contextlib.nullcontext(),
            ):
                loss = pipe.step(x, y)
            # Only the last stage's rank has the loss: sum over the pipeline group.
            value = torch.zeros(()) if loss is None else loss
            value = value.detach().clone()
            dist.all_reduce(value, group=dims.get_mesh("pp").get_group())
        grad_dtypes = {str(p.grad.dtype) for part in parts for p in part.parameters()}
        optimizer.step()
        optimizer.zero_grad()
        value = value.detach().clone()
        if dims.dp_cp_enabled:
            # Each dp x cp rank holds the same number of tokens: the mean of their means.
            dist.all_reduce(value, group=dims.get_mesh("dp_cp").get_group())
            value /= dims.dp_degree * dims.cp
        losses.append(value.item())
    observed["activation_dtypes"] = sorted(activation_dtypes)
    observed["rope_dtypes"] = sorted(rope_dtypes)
    observed["param_dtypes"] = sorted({str(p.dtype) for part in parts for p in part.parameters()})
    observed["grad_dtypes"] = sorted(grad_dtypes)
    observed["compiled_calls"] = [tiny.COMPILED["calls"] - compiled_before]
    observed["inner_attention"] = sorted(
        {type(block.attention.inner_attention).__name__ for block in blocks}
    )
    return losses


def cp_attention_errors(attention_cls: type = ContextParallelAttention) -> list[float]:
    """Max |difference| of output, dq, dk, dv between context-parallel attention (cp = world)
    and plain causal attention of the whole sequence, with GQA (4 query, 2 kv heads)."""
    dims = ParallelDims(
        world_size=dist.get_world_size(), cp=dist.get_world_size(), device_type="cpu"
    )
    cp_mesh = dims.get_mesh("cp")
    rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    generator = torch.Generator().manual_seed(5)
    q, k, v, grad = (
        torch.randn(2, h, 32, 16, generator=generator, dtype=torch.float64) for h in (4, 2, 2, 4)
    )
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = CausalAttention()(*full)
    reference.backward(grad)
    local = [context_parallel_shard(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    out = attention_cls(cp_mesh)(*local)
    out.backward(context_parallel_shard(grad, rank, cp, dim=2))
    errors = [(out - context_parallel_shard(reference, rank, cp, dim=2)).abs().max()]
    for mine, ref in zip(local, full, strict=True):
        errors.append((mine.grad - context_parallel_shard(ref.grad, rank, cp, dim=2)).abs().max())
    result = torch.stack(errors)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return result.tolist()


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed(device_type="cpu")
    tiny.register_counting_backend()
    results = {}
    for layout in sys.argv[2:]:
        if layout == "cp_attention":
            results[layout] = cp_attention_errors()
            continue
        if layout == "cp_ring_attention":
            results[layout] = cp_attention_errors(RingContextParallelAttention)
            continue
        observed = {}
        results[layout] = train(layout, out_dir, observed)
        results.update({f"{layout}.{what}": value for what, value in observed.items()})
    if dist.get_rank() == 0:
        (out_dir / "losses.json").write_text(json.dumps(results))
    gc.collect()  # free FSDP state (it holds gloo work) while the group exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown: with torch 2.13, a gloo group still referenced
    # somewhere and freed during finalization now and then aborts the process after all its
    # work is done ("terminate called without an active exception"; pytorch/pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
