"""titan_train.trainer.host_memory: freed host blocks are reused, so a repeated large allocation no
longer faults its pages in again; glibc's small-block caches are off in the command's
process, which starts itself again for that (same process, same arguments). Each case runs
in its own process (the settings are process-wide and cannot be undone)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from titan_train.config import parse_job_config
from titan_train.trainer.host_memory import _DECIDED, allocator_environment, launch_environment

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


def test_the_small_block_caches_go_off_beside_what_the_environment_sets():
    added = "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"
    assert allocator_environment({})["GLIBC_TUNABLES"] == added
    theirs = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"}
    assert allocator_environment(theirs) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{added}",
        "HOME": "/h",
    }
    # A value the user chose for one of them stays; only the other is added.
    chosen = allocator_environment({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"})
    assert chosen["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=7:glibc.malloc.mxfast=0"


# Each start of this program prints a line; the restarts keep the process and its arguments.
_STARTS = """
import json, os, sys
from titan_train.trainer import host_memory
print(json.dumps({"pid": os.getpid(), "tunables": os.environ.get("GLIBC_TUNABLES")}))
host_memory.restart_early()
host_memory.settle(lambda: {"wanted": True, "not": False}.get(sys.argv[1]))
"""


def _starts(wanted: str, **env: str) -> list[dict]:
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", _DECIDED)}
    out = subprocess.run(
        [sys.executable, "-c", _STARTS, wanted],
        capture_output=True,
        text=True,
        check=True,
        # TITAN_DEVICE=cpu: a CPU run, decided before torch is imported on any host.
        env={**base, "TITAN_DEVICE": "cpu", **env},
    )
    return [json.loads(line) for line in out.stdout.splitlines()]


@glibc_only
def test_a_cpu_run_starts_once_more_with_the_caches_off():
    first, second = _starts("wanted")
    assert first["pid"] == second["pid"]
    assert first["tunables"] is None
    assert second["tunables"] == "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"


@glibc_only
def test_a_run_that_does_not_want_them_off_ends_with_the_environment_it_had():
    # Turned off before the configuration is read, then back once it says no.
    starts = _starts("not", GLIBC_TUNABLES="glibc.malloc.arena_max=2")
    assert [s["tunables"] for s in starts] == [
        "glibc.malloc.arena_max=2",
        "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0",
        "glibc.malloc.arena_max=2",
    ]
    assert len({s["pid"] for s in starts}) == 1


@glibc_only
@pytest.mark.parametrize(
    "env",
    [
        {"GLIBC_TUNABLES": "glibc.malloc.mxfast=64:glibc.malloc.tcache_count=7"},
        {"THP_MEM_ALLOC_ENABLE": "1"},
        {"TITAN_DEVICE": "cuda"},  # an accelerator run: settle asks, and it is not wanted
    ],
)
def test_no_restart_where_the_user_decided_or_nothing_would_change(env):
    assert len(_starts("not", **env)) == 1


@glibc_only
def test_a_configuration_that_does_not_read_causes_no_second_restart():
    # Its error comes from the run's own reading, at once, with the caches as they are.
    starts = _starts("unreadable")
    assert len(starts) == 2
    assert starts[1]["tunables"] == "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"


# A program of the user's own that calls the command's main() with its own arguments; its
# first line runs again if anything starts the process again.
_CALLER = """
import sys
print("program started", flush=True)
from titan_train.cli import main
sys.exit(main())
"""


@glibc_only
def test_a_program_calling_main_is_never_started_again(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", _DECIDED)}
    env = {k: v for k, v in env.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    program = tmp_path / "program.py"
    program.write_text(_CALLER)
    command = [
        sys.executable, str(program), "--training.steps", "1", "--training.seq_len", "32",
        "--training.local_batch_size", "1", "--checkpoint.no_enable",
        "--metrics.no_enable_tensorboard", "--job.dump_folder", str(tmp_path / "out"),
    ]  # fmt: skip
    out = subprocess.run(
        command, capture_output=True, text=True, env={**env, "TITAN_DEVICE": "cpu"}, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("program started") == 1
    assert "small-block caches on" in out.stdout + out.stderr  # glibc as the program started


def test_the_launcher_starts_its_ranks_decided():
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", _DECIDED)}
    wanted = launch_environment(True, base)
    assert wanted["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"
    assert wanted[_DECIDED] == "off:"
    assert launch_environment(False, base)[_DECIDED] == "kept"
    assert "GLIBC_TUNABLES" not in launch_environment(False, base)
    # A launcher that started itself with them off gives ranks that want them on what it found.
    restarted = {**base, "GLIBC_TUNABLES": "a=1:" + wanted["GLIBC_TUNABLES"], _DECIDED: "off:a=1"}
    assert launch_environment(False, restarted)["GLIBC_TUNABLES"] == "a=1"
    assert launch_environment(True, restarted)[_DECIDED] == "off:a=1"


@glibc_only
def test_the_command_trains_with_the_caches_off_and_says_so_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", _DECIDED)}
    env = {k: v for k, v in env.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    command = [
        sys.executable, "-m", "titan_train.cli", "--training.steps", "1",
        "--training.seq_len", "32", "--training.local_batch_size", "1",
        "--checkpoint.no_enable", "--metrics.no_enable_tensorboard",
        "--job.dump_folder", str(tmp_path),
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    said = out.stdout + out.stderr
    assert said.count("small-block caches off (GLIBC_TUNABLES=glibc.malloc.tcache_count=0") == 1
    assert said.count("llama3 debugmodel: 6,163,712 parameters") == 1, said  # logged once


def test_the_command_module_imports_without_torch_and_the_package_names_resolve():
    # The restart costs an interpreter start only while nothing before it imports torch.
    probe = (
        "import sys, titan_train.cli; print('torch' in sys.modules); "
        "import titan_train, titan_train.generate.cli, titan_train.preflight, types; "
        "values = [getattr(titan_train, n) for n in titan_train.__all__]; "
        "print(sorted(n for n, v in zip(titan_train.__all__, values) "
        "if isinstance(v, types.ModuleType)), callable(titan_train.generate), "
        "callable(titan_train.preflight))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    # Every exported name is its object, the functions named as their modules included.
    assert out.stdout.split("\n")[:2] == ["False", "[] True True"]
