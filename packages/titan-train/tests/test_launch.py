"""titan-train's launcher flags (``titan_train.launch``): the torchrun command line they
become, and every bad value refused with one message and exit 2 before any work, an
unreachable rendezvous endpoint included (a real socket probe, no torch agent started).
The runs themselves are integration tests: ``integration_tests/test_restarts.py`` (kills and
restarts) and ``integration_tests/test_multinode.py`` (two launchers, c10d rendezvous)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from titan_train.cli import main
from titan_train.errors import ConfigError
from titan_train.launch import (
    SHARED_STORE_VARIABLE,
    LaunchOptions,
    check_restartable,
    pop_launch_options,
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_flags_are_taken_out_of_the_command_line_in_both_spellings():
    argv = [
        "--nproc-per-node=2", "--training.steps", "3", "--nnodes", "2", "--node_rank", "1",
        "--rdzv-endpoint", "node0:29500", "--rdzv_id=job7", "--max-restarts", "3",
        "--rdzv-timeout", "2.5",
    ]  # fmt: skip
    options, rest = pop_launch_options(argv)
    assert rest == ["--training.steps", "3"]
    assert options == LaunchOptions(
        nproc_per_node=2,
        nnodes=2,
        node_rank=1,
        rdzv_endpoint="node0:29500",
        rdzv_id="job7",
        max_restarts=3,
        rdzv_timeout=2.5,
    )
    assert options.world_size == 4


def test_one_node_stays_standalone_and_restarts_ask_the_agent():
    assert LaunchOptions(nproc_per_node=2).torchrun_args() == [
        "--standalone", "--nproc-per-node", "2",
    ]  # fmt: skip
    restarting = LaunchOptions(max_restarts=2)
    assert restarting.launches  # one process, but the agent must watch it to restart it
    assert restarting.torchrun_args() == [
        "--standalone", "--nproc-per-node", "1", "--max-restarts", "2",
    ]  # fmt: skip
    assert not LaunchOptions().launches
    assert LaunchOptions().torchrun_env() == {SHARED_STORE_VARIABLE: "1"}


def test_nodes_meet_through_c10d_and_node_0_hosts_the_store():
    def args(rank):
        options = LaunchOptions(
            nproc_per_node=4, nnodes=2, node_rank=rank, rdzv_endpoint="[fd00::1]:29500"
        )
        return options.torchrun_args()

    assert args(0) == [
        "--nproc-per-node", "4", "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "[fd00::1]:29500", "--rdzv-id", "titan-train",
        "--rdzv-conf", "is_host=1",
    ]  # fmt: skip
    assert args(1)[-1] == "is_host=0"
    assert "--node-rank" not in args(1)  # torchrun ignores it under c10d, with a warning


BAD = [
    (["--nnodes", "0"], "--nnodes needs a whole number >= 1, got '0'"),
    (["--nnodes", "1:4"], "elastic ranges like 1:4 are not supported"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (
        ["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
        "--node-rank 2 is out of range for --nnodes 2: node ranks are 0 to 1",
    ),
    (["--node-rank", "-1"], "--node-rank needs a whole number >= 0, got '-1'"),
    (["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0' is not HOST:PORT"),
    (["--rdzv-endpoint", "node0:70000"], "is not HOST:PORT"),
    (["--rdzv-endpoint", ":29500"], "is not HOST:PORT"),
    (["--rdzv-endpoint", "no.such.host.invalid:29500"], "'no.such.host.invalid' cannot be res"),
    (["--max-restarts", "-1"], "--max-restarts needs a whole number >= 0, got '-1'"),
    (["--max-restarts"], "--max-restarts needs a value (a whole number >= 0)"),
    (["--max-restarts", "--training.steps", "3"], "--max-restarts needs a value"),
    (["--rdzv-timeout", "0"], "--rdzv-timeout needs a number of seconds > 0, got '0'"),
    (["--rdzv-id", " "], "--rdzv-id needs a name"),
    (
        ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "192.0.2.1:29500"],
        "--node-rank 0 hosts the rendezvous, but 192.0.2.1",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=lambda v: str(v)[:50])
def test_bad_launcher_flags_exit_2_before_any_work(args, message, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["train", *args, "--job.dump_folder", str(out), "--training.steps", "1"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("titan-train: error: ")
    assert message in err
    assert err.count("\n") == 1  # one message, no traceback
    assert not out.exists()


def test_an_endpoint_nobody_answers_times_out_with_what_and_how_long(tmp_path, capsys):
    endpoint = f"127.0.0.1:{free_port()}"  # nobody listens there
    out = tmp_path / "out"
    args = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint]
    begin = time.monotonic()
    code = main([*args, "--rdzv-timeout", "1.5", "--job.dump_folder", str(out)])
    waited = time.monotonic() - begin
    err = capsys.readouterr().err
    assert code == 2
    assert f"The rendezvous endpoint {endpoint} did not answer within 1.5 s" in err
    assert "Start node 0 (--node-rank 0)" in err
    assert "--rdzv-timeout SECONDS" in err
    assert waited >= 1.5
    assert not out.exists()


def test_node_0_refuses_a_port_already_taken(tmp_path, capsys):
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        out = tmp_path / "out"
        args = ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"localhost:{port}"]
        code = main([*args, "--job.dump_folder", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"port {port} on this machine (node 0, which hosts the rendezvous) is already" in err
    assert not out.exists()


def test_an_endpoint_that_answers_passes_the_probe():
    with socket.create_server(("127.0.0.1", 0)) as server:
        endpoint = f"127.0.0.1:{server.getsockname()[1]}"
        options = LaunchOptions(nnodes=2, node_rank=1, rdzv_endpoint=endpoint, rdzv_timeout=5)
        options.check_rendezvous()  # returns: something listens there


def test_torchrun_restarts_with_a_shared_store_are_refused():
    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    with pytest.raises(ConfigError, match=f"Set {SHARED_STORE_VARIABLE}=1"):
        check_restartable(shared)
    check_restartable({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # a fresh store
    check_restartable({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})  # nothing to restart
    check_restartable({})  # not under torchrun


def test_help_lists_the_launcher_flags(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--max-restarts N", "--nnodes N", "--node-rank R", "--rdzv-endpoint HOST:PORT"):
        assert flag in out


def test_options_built_in_python_are_checked_too():
    with pytest.raises(ConfigError, match="nnodes=0 is not allowed"):
        LaunchOptions(nnodes=0)
    with pytest.raises(ConfigError, match="max_restarts=-1 is not allowed"):
        LaunchOptions(max_restarts=-1)
    with pytest.raises(ConfigError, match="rdzv_timeout=0 is not allowed"):
        LaunchOptions(rdzv_timeout=0)


def test_a_launched_rank_exits_with_its_status_and_everything_it_printed(capsys, tmp_path):
    """A rank started by the launcher (WORLD_SIZE > 1) leaves through ``os._exit``, skipping
    the interpreter's finalization (``titan_train.launch.exit_rank``): what it printed
    into a pipe, block-buffered, still arrives whole, and the exit status is the command's."""
    # A sitecustomize that registers an exit handler: it runs only on a finalizing exit.
    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, os, pathlib\natexit.register(pathlib.Path(os.environ['FINALIZED']).touch)\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    single = {**os.environ, "PYTHONPATH": path, "FINALIZED": str(tmp_path / "single")}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        single.pop(key, None)
    rank = {**single, "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    rank["FINALIZED"] = str(tmp_path / "rank")
    assert main(["config"]) == 0
    expected = capsys.readouterr().out
    for env in (single, rank):
        printed = subprocess.run(
            [sys.executable, "-m", "titan_train.cli", "config"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert (printed.returncode, printed.stdout) == (0, expected)
    assert len(expected) > 1000  # more than a line: lost if the buffer were not flushed
    assert (tmp_path / "single").exists()  # the probe works: a lone process finalizes
    assert not (tmp_path / "rank").exists()  # a launched rank does not

    missing = ["--prompt", "Hi", "--checkpoint.path", "/nonexistent"]
    refused = subprocess.run(
        [sys.executable, "-m", "titan_train.cli", "generate", *missing],
        env=rank,
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 2
    assert "titan-train: error: --checkpoint.path /nonexistent does not exist" in refused.stderr
