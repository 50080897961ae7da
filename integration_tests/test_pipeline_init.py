"""Pipeline stages initialize different weights (issue 18, F5). Every rank used to seed the
same generator, so two stages running the same sequence of init ops (with pp 3, the middle
stage and the last: neither has the embedding) drew identical blocks (correlation 1.0
between layers 2 and 4). Each stage now seeds ``seed + pp rank``. Checked on the weights a
real 3-stage run saves after one step at learning rate 0 (its initial weights)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_no_two_blocks_of_a_three_stage_pipeline_start_alike(tmp_path):
    command = [
        sys.executable, "-m", "titan_train.cli", "--nproc-per-node", "3",
        "--job.dump_folder", str(tmp_path),
        "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.pipeline_parallel_degree", "3",
        "--training.steps", "1", "--optimizer.lr", "0", "--lr_scheduler.warmup_steps", "1",
        "--training.seq_len", "64", "--training.local_batch_size", "3",
        "--checkpoint.interval", "1", "--metrics.no_enable_tensorboard",
    ]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = tmp_path / "checkpoint" / "step-1"
    metadata = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    names = [k for k in metadata if k.startswith("layers.") and k.endswith("attention.wq.weight")]
    assert len(names) == 6  # debugmodel: 6 blocks, 2 per stage
    weights = {name: torch.empty(metadata[name].size) for name in names}
    dcp.load(weights, checkpoint_id=str(step), no_dist=True)
    flat = torch.stack([weights[name].flatten() for name in sorted(names)])
    correlation = torch.corrcoef(flat) - torch.eye(len(names))
    assert correlation.abs().max() < 0.1, correlation
