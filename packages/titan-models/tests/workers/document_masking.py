"""Train the tiny Llama 3 on packed windows with document masking under each named layout;
rank 0 writes ``{layout: [loss per step]}`` to ``<out_dir>/losses.json``. ``single`` is one
process (rank 0 alone, no collectives) with masking; ``single_unmasked`` without.

Run: torchrun --nproc-per-node 2 document_masking.py OUT_DIR LAYOUT [LAYOUT ...]
"""

from __future__ import annotations

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
from titan_models import ParallelizeConfig, PipelineConfig
from titan_models.documents import DocumentMasking
from titan_models.llama3 import Llama3, parallelize_llama, pipeline_llama

EOS = 0
MASKING = DocumentMasking(EOS)

# name -> (ParallelDims degrees, ParallelizeConfig fields, PipelineConfig fields or None)
LAYOUTS = {
    "fsdp_ac": ({"dp_shard": 2}, {"activation_checkpoint": {"mode": "full"}}, None),
    "fsdp_ac_op": (
        {"dp_shard": 2},
        {"activation_checkpoint": {"mode": "selective", "selective_option": "op"}},
        None,
    ),
    "tp": ({"tp": 2, "dp_shard": 1}, {}, None),
    "pp_1f1b": ({"pp": 2, "dp_shard": 1}, {}, {"schedule": "1F1B"}),
}


def packed_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """tiny.batches() with an EOS every few tokens: several documents per window."""
    inputs, labels = tiny.batches()
    generator = torch.Generator().manual_seed(2)
    ends = torch.rand(inputs.shape, generator=generator) < 0.15
    return inputs.masked_fill(ends, EOS), labels


def _n_layers(layout: str) -> int:
    return 4 if layout.startswith("pp") else 2


def train_single(n_layers: int, *, masked: bool) -> list[float]:
    model = Llama3(tiny.tiny_args(n_layers))
    model.load_state_dict(tiny.reference_state_dict(n_layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=tiny.LR)
    inputs, labels = packed_batches()
    losses = []
    for step in range(tiny.STEPS):
        x = inputs[step]
        kwargs = MASKING.forward_kwargs(x) if masked else {}
        loss = tiny.cross_entropy(model(x, **kwargs), labels[step])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train(layout: str) -> list[float]:
    degrees, overrides, pipeline = LAYOUTS[layout]
    dims = ParallelDims(world_size=dist.get_world_size(), device_type="cpu", **degrees)
    config = ParallelizeConfig(**{"param_dtype": "float32", **overrides})
    n_layers = _n_layers(layout)
    with torch.device("meta"):
        model = Llama3(tiny.tiny_args(n_layers))
    rows = tiny.BATCH // dims.dp_degree
    start = dims.dp_rank() * rows if dims.dp_enabled else 0
    if pipeline is None:
        parallelize_llama(model, dims, config, seq_len=tiny.SEQ)
        parts = [model]
    else:
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
    full = tiny.reference_state_dict(n_layers)
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights()
        mine = set(part.state_dict())
        set_model_state_dict(
            part,
            {k: v for k, v in full.items() if k in mine},
            options=StateDictOptions(full_state_dict=True),
        )
    optimizer = torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=tiny.LR)
    inputs, labels = packed_batches()
    losses = []
    for step in range(tiny.STEPS):
        x = inputs[step, start : start + rows]
        y = labels[step, start : start + rows]
        kwargs = MASKING.forward_kwargs(x)
        if pipeline is None:
            logits = model(x, **kwargs)
            with loss_parallel() if isinstance(logits, DTensor) else torch.enable_grad():
                loss = tiny.cross_entropy(logits, y)
                loss.backward()
            value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        else:
            loss = pipe.step(x, y, **kwargs)
            value = torch.zeros(()) if loss is None else loss
            value = value.detach().clone()
            dist.all_reduce(value, group=dims.get_mesh("pp").get_group())
        optimizer.step()
        optimizer.zero_grad()
        value = value.detach().clone()
        if dims.dp_enabled:
            dist.all_reduce(value, op=dist.ReduceOp.AVG, group=dims.get_mesh("dp_cp").get_group())
        losses.append(value.item())
    return losses


def main() -> None:
    out_dir = Path(sys.argv[1])
    init_distributed(device_type="cpu")
    results = {}
    for layout in sys.argv[2:]:
        results[layout] = train(layout)
    if dist.get_rank() == 0:
        for n_layers in (2, 4):
            results[f"single{n_layers}"] = train_single(n_layers, masked=True)
            results[f"single{n_layers}_unmasked"] = train_single(n_layers, masked=False)
        (out_dir / "losses.json").write_text(json.dumps(results))
    gc.collect()  # free FSDP state (it holds gloo work) while the group exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown (pytorch/pytorch#179291, as parallel_train.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
