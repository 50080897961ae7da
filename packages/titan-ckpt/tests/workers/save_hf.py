"""Two FSDP2 ranks export the last save as a sharded Hugging Face folder, then a fresh
FSDP2 model loads it back with ``initial_load_in_hf``.

Usage: save_hf.py OUT_DIR KIND SHARD_BYTES, KIND ``mlp`` (the tiny MLP, a streaming renaming
adapter), ``pp`` (the same MLP as two pipeline stages of two FSDP2 ranks each: 4 ranks,
stage 0 holds layers 0 and 2, stage 1 layer 4, with their own names) or ``llama3``
(titan-models' tiny Llama 3 and its adapter). The HF folder is
OUT_DIR/run/step-3/hf. Each rank reports whether the reloaded weights equal the saved ones.
"""

from __future__ import annotations

import os
import sys

import torch
from common import (
    StreamingRenamingAdapter,
    finish,
    full_params,
    init,
    llama3_args,
    make_llama3,
    make_model,
    shard,
    write_result,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from titan_ckpt import CheckpointConfig, CheckpointManager


def build(kind: str, seed: int):
    if kind == "mlp":
        return shard(make_model(seed=seed)), StreamingRenamingAdapter()
    if kind == "pp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        stage = make_model(seed=seed)
        keep = ("0", "2") if mesh.get_local_rank("pp") == 0 else ("4",)
        for name in list(stage._modules):
            if name not in keep:
                del stage._modules[name]  # as a pipeline split does: the others' names stay
        for layer in stage:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
        return stage, StreamingRenamingAdapter()
    from titan_models.llama3 import Llama3StateDictAdapter

    model = make_llama3(seed)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    return model, Llama3StateDictAdapter(llama3_args())


def main() -> None:
    init()
    out, kind, shard_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, adapter = build(kind, seed=0)
    saved = full_params(model)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=os.path.join(out, "run"), last_save_in_hf=True,
                         hf_max_shard_size=shard_bytes),
        model_parts=[model],
        state_dict_adapter=adapter,
    )  # fmt: skip
    manager.save(3, last_step=True)
    manager.close()

    fresh, adapter = build(kind, seed=5)
    with torch.no_grad():  # norms start at 1 whatever the seed: move every weight away
        for p in fresh.parameters():
            p.add_(1.0)
    before = full_params(fresh)
    loader = CheckpointManager(
        CheckpointConfig(enable=True, folder=os.path.join(out, "fresh"),
                         initial_load_path=os.path.join(out, "run", "step-3", "hf"),
                         initial_load_in_hf=True),
        model_parts=[fresh],
        state_dict_adapter=adapter,
    )  # fmt: skip
    loaded = bool(loader.load())
    loader.close()
    after = full_params(fresh)
    local = {k: p.to_local().numel() for k, p in fresh.named_parameters()}
    write_result(
        f"hf-{kind}",
        {
            "loaded": loaded,
            "keys": sorted(saved),
            "fresh_differed": sorted(k for k in saved if before[k] != saved[k]),
            "not_restored": sorted(k for k in saved if after[k] != saved[k]),
            "local_numel": sum(local.values()),
            "full_numel": sum(len(v) for v in saved.values()),
        },
    )
    del model, fresh, manager, loader


if __name__ == "__main__":
    main()
    finish()
