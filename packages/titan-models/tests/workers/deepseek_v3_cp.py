"""Multi-head latent attention under context parallel (``cp_attention="titan"``) against
the same attention on the whole sequence, forward and backward, with YaRN (its softmax
scale) and without. Rank 0 writes ``{case: [max |out diff|, max relative grad diff]}`` to
``<out_dir>/losses.json``.

Run: torchrun --nproc-per-node 2 deepseek_v3_cp.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.deepseek_v3.model import MultiHeadLatentAttention, yarn_rope_table
from titan_models.parallel.context_parallel import apply_context_parallel
from titan_models.parallel.cp_sharding import context_parallel_shard


def case(max_seq_len: int, cp_mesh) -> list[float]:
    args = DeepSeekV3Args(
        dim=32,
        n_heads=4,
        q_lora_rank=8,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,  # not the query/key head size (16), as in DeepSeek-V3 (128 vs 192)
        max_seq_len=max_seq_len,
        original_seq_len=32,
        n_layers=1,
        n_dense_layers=1,
    )
    rope = yarn_rope_table(args)
    torch.manual_seed(0)
    whole = MultiHeadLatentAttention(args)
    sharded = MultiHeadLatentAttention(args)
    sharded.load_state_dict(whole.state_dict())
    apply_context_parallel([sharded], cp_mesh, "titan")
    x = torch.randn(2, 32, 32)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    expected = whole(x, rope)
    expected.square().sum().backward()
    out = sharded(context_parallel_shard(x, rank, cp), rope)
    out.square().sum().backward()
    grads = [p.grad for p in sharded.parameters()]
    for grad in grads:
        dist.all_reduce(grad, group=cp_mesh.get_group())  # each rank saw its tokens only
    out_diff = (out - context_parallel_shard(expected, rank, cp)).abs().max().item()
    grad_diff = max(  # relative to each gradient's largest entry
        ((g - p.grad).abs().max() / p.grad.abs().max()).item()
        for g, p in zip(grads, whole.parameters(), strict=True)
    )
    return [out_diff, grad_diff]


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    results = {"plain": case(32, mesh), "yarn": case(64, mesh)}
    if dist.get_rank() == 0:
        (out_dir / "losses.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
