"""Worker for test_gloo.py, run under torchrun: builds the real mesh of each layout given
and reports, per rank, every named group as torch sees it and as an all-reduce sees it."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titan_dims import ParallelDims, init_distributed


def main() -> None:
    layouts = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    report = []
    for degrees in layouts:
        dims = ParallelDims(world_size=world_size, **degrees)
        assert dims.world_mesh.device_type == "cpu"  # detected, not configured
        entry = {"degrees": degrees, "groups": {}, "members": {}, "rank_sum": {}, "local": {}}
        for name in dims.layout.names:
            mesh = dims.get_mesh(name)
            group = mesh.get_group()
            one_hot = torch.zeros(world_size)
            one_hot[rank] = 1
            dist.all_reduce(one_hot, group=group)
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=group)
            entry["groups"][name] = mesh.mesh.flatten().tolist()
            entry["members"][name] = one_hot.nonzero().flatten().tolist()
            entry["rank_sum"][name] = int(total.item())
            entry["local"][name] = mesh.get_local_rank()
        entry["dp_rank"] = dims.dp_rank()
        report.append(entry)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
