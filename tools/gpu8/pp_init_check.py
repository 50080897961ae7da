"""Pipeline stages start with different weights (issue 18, F5): read the ``wq`` weight of
every block from a checkpoint written after one step at learning rate 0 (the initial
weights) and fail when two blocks correlate (|r| >= 0.1). On CUDA, DTensor's generator is
synchronised across the world, which CPU tests cannot show.

    python tools/gpu8/pp_init_check.py CHECKPOINT_STEP_DIR
"""

from __future__ import annotations

import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader


def main(step_dir: str) -> int:
    metadata = FileSystemReader(step_dir).read_metadata().state_dict_metadata
    names = sorted(
        (k for k in metadata if k.startswith("layers.") and k.endswith("attention.wq.weight")),
        key=lambda k: int(k.split(".")[1]),
    )
    weights = {name: torch.empty(metadata[name].size) for name in names}
    dcp.load(weights, checkpoint_id=step_dir, no_dist=True)
    flat = torch.stack([weights[name].flatten().float() for name in names])
    correlation = (torch.corrcoef(flat) - torch.eye(len(names))).abs()
    worst = correlation.max().item()
    i, j = divmod(int(correlation.argmax()), len(names))
    print(f"{len(names)} blocks; largest |correlation| {worst:.4f} ({names[i]} vs {names[j]})")
    if worst >= 0.1:
        print("FAILED: two blocks started with (nearly) the same weights")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
