"""titan_train.trainer.host_memory: freed host blocks are reused, so a repeated large allocation no
longer faults its pages in again. Each case runs in its own process (the setting is
process-wide and cannot be undone)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from titan_train.config import parse_job_config

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the setting applies to glibc's malloc only",
)

# Allocates, fills and frees a 64 MiB tensor (16,384 pages of 4 KiB) five times, as a
# training step does with its activations, and prints the minor page faults of the later
# four rounds.
_PROBE = """
import json, resource, sys, torch
from titan_train.trainer.host_memory import reuse_host_memory
applied = reuse_host_memory() if sys.argv[1] == "on" else None
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(16 << 20)
    block.fill_(1.0)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults[1:]}))
"""


def _probe(mode: str, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_a_reused_block_is_not_faulted_in_again():
    default, reused = _probe("off"), _probe("on")
    # glibc's default maps a block this size afresh each time: every page faults again.
    assert min(default["faults"]) > 16_000, default
    assert reused["applied"] is True
    # Kept for reuse: at most one round (while the heap first grows) pays, the rest none.
    assert max(sorted(reused["faults"])[:3]) < 100, reused
    assert sum(reused["faults"]) < 0.3 * sum(default["faults"]), (default, reused)


@glibc_only
def test_torchs_huge_page_allocation_keeps_glibcs_defaults():
    # Both together made a large matmul ~10x slower on this machine kind.
    assert _probe("on", THP_MEM_ALLOC_ENABLE="1")["applied"] is False


def test_the_key_is_on_by_default_and_can_be_turned_off():
    assert parse_job_config([]).training.reuse_host_memory is True
    off = parse_job_config(["--training.no_reuse_host_memory"])
    assert off.training.reuse_host_memory is False


_LIBRARY_RUN = """
import json, resource, sys
import torch
from titan_train import run
from titan_train.config import parse_job_config
run(parse_job_config(sys.argv[1:]))
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.empty(16 << 20)
    block.fill_(1.0)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults[1:]}))
"""


@glibc_only
def test_a_program_calling_run_keeps_its_own_allocator(tmp_path):
    # The key is on by default, but only the titan-train command applies it to its process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _LIBRARY_RUN,
            "--training.steps",
            "1",
            "--training.seq_len",
            "32",
            "--training.local_batch_size",
            "1",
            "--job.dump_folder",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    faults = json.loads(out.stdout.strip().splitlines()[-1])["faults"]
    assert min(faults) > 16_000, faults
