"""Two "nodes" on one machine: two ``titan-train --nnodes 2 --node-rank R --rdzv-endpoint
localhost:PORT --nproc-per-node 2`` launchers meet through torch's c10d rendezvous and train
one 4-rank HSDP job (data_parallel_replicate 2 across the nodes x data_parallel_shard 2 inside
each), with the same losses as the same job from one 4-process launcher. Both nodes share one
dump folder, as nodes of a cluster share checkpoint storage: the final checkpoint holds one
file per rank, each written by its own rank, and one commit.

4 processes on a 2-core machine: the tiniest run (3 steps, 32 tokens per rank), yet ~60 s
alone (two 4-process runs, five start-ups of torch): marked ``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 3
HSDP = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "32",
    "--training.local_batch_size", "1",
    "--parallelism.data_parallel_replicate_degree", "2",
    "--parallelism.data_parallel_shard_degree", "2",
    "--parallelize.param_dtype", "float32",
    "--metrics.log_freq", "1",
    "--metrics.no-enable-tensorboard",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "titan_train.cli", *args]
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def finish(processes: list[subprocess.Popen], timeout: float = 400) -> None:
    """Wait for every launcher; on a failure or timeout, kill them all (and their ranks)."""
    errors = []
    try:
        for process in processes:
            _, stderr = process.communicate(timeout=timeout)
            if process.returncode != 0:
                errors.append(f"{process.args[3:]} exited {process.returncode}:\n{stderr[-6000:]}")
    except subprocess.TimeoutExpired:
        errors.append(f"no finish in {timeout} s")
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.communicate()
    if errors:
        pytest.fail("\n".join(errors))


def losses(folder: Path) -> dict[int, float]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


@pytest.mark.slow
@pytest.mark.full  # the launcher's rendezvous; CI launches through it in every multi-rank run
def test_two_nodes_over_c10d_train_like_one_launcher(tmp_path):
    single = tmp_path / "single"
    finish([start("--nproc-per-node", "4", "--job.dump_folder", str(single), *HSDP)])

    nodes = tmp_path / "nodes"  # one folder for both: shared checkpoint storage
    endpoint = f"localhost:{free_port()}"
    node = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint]
    node += ["--rdzv-id", "two-nodes", "--job.dump_folder", str(nodes), *HSDP]
    launchers = [start("--node-rank", str(rank), *node) for rank in (0, 1)]
    finish(launchers)

    reference = losses(single)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert losses(nodes) == pytest.approx(reference, rel=1e-6)
    step = nodes / "checkpoint" / f"step-{STEPS}"
    manifest = json.loads((step / "titan-commit.json").read_text())
    assert manifest["world_size"] == 4
    assert sorted(p.name for p in step.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
