"""Launching ranks: titan-train's launcher flags, turned into a ``torch.distributed.run``
(torchrun) command line; torch's elastic agent starts, watches and restarts the processes,
and its c10d rendezvous joins the nodes.

    titan-train --nproc-per-node 4 --max-restarts 3 ...
    titan-train --nnodes 2 --node-rank R --rdzv-endpoint node0:29500 --nproc-per-node 8 ...

With ``--nnodes N`` every node runs the command with the same ``--rdzv-endpoint`` (node 0's
address, a free port) and ``--rdzv-id``; node 0 hosts the store, the others wait up to
``--rdzv-timeout`` for it, then stop with one message (exit 2). Node k's processes are
global ranks k*nproc .. k*nproc+nproc-1, so the innermost mesh dimensions stay in a node.
``--max-restarts N`` restarts the whole group up to N times, each resuming from the newest
committed checkpoint.

A SIGTERM is passed on to the agent and every worker (each saves and stops), then
titan-train exits 143. The agent SIGKILLs workers 30 s later; set
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` to give a step and its save longer.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

from titan_train.errors import ConfigError, check_int, check_number
from titan_train.trainer.preemption import PREEMPTED_EXIT

__all__ = [
    "LAUNCH_FLAGS",
    "SHARED_STORE_VARIABLE",
    "LaunchOptions",
    "check_restartable",
    "pop_launch_options",
    "run_agent",
]

LAUNCH_FLAGS = (
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--max-restarts",
    "--rdzv-timeout",
)
"""The flags titan-train reads itself (underscores accepted too, as torchrun does)."""

_PROBE_INTERVAL_S = 0.5

SHARED_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1, torch's agent gives each rendezvous round (restart) a new TCP store: in a shared
one a restarted group reads the addresses its killed predecessor left and waits forever
(torch issue 135712; seen with gloo on torch 2.13)."""


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How many processes to start where, and how often to restart them."""

    nproc_per_node: int = 1
    """Processes on this node."""
    nnodes: int = 1
    """Nodes of the job, each running the same command."""
    node_rank: int | None = None
    """This node's rank, 0..nnodes-1; node 0 hosts the rendezvous. None: torch decides
    (the node whose address is the endpoint's host hosts it)."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous; needed with more than one node."""
    rdzv_id: str = "titan-train"
    """The job's name at the rendezvous: the same on every node, unique per job."""
    max_restarts: int = 0
    """Times torch's agent restarts the processes after a failure."""
    rdzv_timeout: float = 60.0
    """Seconds a node waits for the rendezvous endpoint to answer."""

    def __post_init__(self) -> None:
        # pop_launch_options checked the flags' spelling; these hold for any construction.
        check_int("nproc_per_node", self.nproc_per_node, minimum=1)
        check_int("nnodes", self.nnodes, minimum=1)
        check_int("max_restarts", self.max_restarts, minimum=0)
        check_number("rdzv_timeout", self.rdzv_timeout, low=0, low_open=True)
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}: "
                f"node ranks are 0 to {self.nnodes - 1}, one per node, and node 0 hosts the "
                "rendezvous at --rdzv-endpoint."
            )
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT, the same on every "
                "node: an address of node 0 that the other nodes reach and a free port there "
                "(e.g. --rdzv-endpoint node0.cluster:29500)."
            )
        if self.rdzv_endpoint is not None:
            split_endpoint(self.rdzv_endpoint)
        if not self.rdzv_id.strip():
            raise ConfigError("--rdzv-id needs a name (the same on every node of the job).")

    @property
    def world_size(self) -> int:
        """Processes in the whole job."""
        return self.nnodes * self.nproc_per_node

    @property
    def launches(self) -> bool:
        """Whether titan-train starts ranks through torch's agent (else it trains here)."""
        return (
            self.world_size > 1 or self.max_restarts > 0 or self.rdzv_endpoint is not None
        ) and "LOCAL_RANK" not in os.environ

    def torchrun_args(self) -> list[str]:
        """The launcher half of the torchrun command line: standalone on one node without an
        endpoint, else c10d rendezvous there (hosted by node 0 given the node rank)."""
        args = ["--nproc-per-node", str(self.nproc_per_node)]
        if self.max_restarts:
            args += ["--max-restarts", str(self.max_restarts)]
        if self.rdzv_endpoint is None:
            return ["--standalone", *args]
        args += ["--nnodes", str(self.nnodes), "--rdzv-backend", "c10d"]
        args += ["--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
        if self.node_rank is not None:
            args += ["--rdzv-conf", f"is_host={int(self.node_rank == 0)}"]
        return args

    def torchrun_env(self) -> dict[str, str]:
        """Environment for torch's agent: a fresh rendezvous store per restart
        (``SHARED_STORE_VARIABLE``)."""
        return {SHARED_STORE_VARIABLE: "1"}

    def check_rendezvous(self) -> None:
        """``ConfigError`` now, not after torch's timeout, when this node cannot rendezvous: the
        host does not resolve, node 0's port is taken, or no answer in ``rdzv_timeout``."""
        if self.rdzv_endpoint is None:
            return
        host, port = split_endpoint(self.rdzv_endpoint)
        addresses = _resolve(host, port, self.rdzv_endpoint)
        local = any(_is_local(address) for address in addresses)
        if self.node_rank == 0:
            if not local:
                raise ConfigError(
                    f"--node-rank 0 hosts the rendezvous, but {host} (of --rdzv-endpoint "
                    f"{self.rdzv_endpoint}) is not an address of this machine. Run node 0 on "
                    f"{host}, or point --rdzv-endpoint at this machine ({socket.gethostname()})."
                )
            _check_port_free(host, port, self.rdzv_endpoint)
        elif self.node_rank is not None or not local:
            self._wait_for_endpoint(host, port)

    def _wait_for_endpoint(self, host: str, port: int) -> None:
        deadline = time.monotonic() + self.rdzv_timeout
        last = "no answer"
        while True:
            try:
                with socket.create_connection((host, port), timeout=_PROBE_INTERVAL_S):
                    return
            except OSError as error:
                last = error.strerror or type(error).__name__
            if time.monotonic() >= deadline:
                break
            time.sleep(_PROBE_INTERVAL_S)
        raise ConfigError(
            f"The rendezvous endpoint {self.rdzv_endpoint} did not answer within "
            f"{self.rdzv_timeout:g} s (last attempt: {last}). Start node 0 (--node-rank 0) on "
            f"{host} first, with the same --rdzv-endpoint; check that port {port} of {host} "
            "is reachable from this machine (firewall, the right network interface); or wait "
            "longer with --rdzv-timeout SECONDS."
        )


def check_restartable(environ: dict[str, str] | None = None) -> None:
    """In a worker of torch's agent: ``ConfigError`` when ``--max-restarts`` > 0 with the
    agent's rendezvous store shared: the first restart would hang at start-up."""
    env = os.environ if environ is None else environ
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and restarts.isdigit() and int(restarts) > 0:
        raise ConfigError(
            f"torchrun --max-restarts {restarts} shares its rendezvous store with the workers, "
            "and a restarted group then waits forever for the addresses of the processes it "
            f"replaced (torch issue 135712). Set {SHARED_STORE_VARIABLE}=1 in torchrun's "
            "environment (tools/slurm/titan-train.sbatch does), or launch with titan-train "
            "--max-restarts, which sets it."
        )


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[IPv6]:PORT`` too) as (host, port); ``ConfigError`` otherwise."""
    host, colon, port_text = endpoint.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text) if port_text.isdigit() else -1
    if not colon or not host or not 0 < port < 2**16 or any(c.isspace() for c in host):
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT: give a host name or IP address "
            "that every node reaches and a port from 1 to 65535, e.g. node0.cluster:29500 "
            "or [fd00::1]:29500."
        )
    return host, port


def pop_launch_options(argv: list[str]) -> tuple[LaunchOptions, list[str]]:
    """The launcher flags of ``argv`` (see ``LAUNCH_FLAGS``), validated, and the rest."""
    values: dict[str, str] = {}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        flag = name.replace("_", "-")
        if flag not in LAUNCH_FLAGS:
            rest.append(arg)
            continue
        if not eq:
            value = next(it, None)
        if value is None or value.startswith("--"):
            raise ConfigError(f"{flag} needs a value ({_WANTS[flag]}).")
        values[flag] = value
    options = LaunchOptions(
        nproc_per_node=_whole(values, "--nproc-per-node", 1, 1),
        nnodes=_whole(values, "--nnodes", 1, 1),
        node_rank=_whole(values, "--node-rank", 0, None),
        rdzv_endpoint=values.get("--rdzv-endpoint"),
        rdzv_id=values.get("--rdzv-id", "titan-train"),
        max_restarts=_whole(values, "--max-restarts", 0, 0),
        rdzv_timeout=_seconds(values, "--rdzv-timeout", 60.0),
    )
    return options, rest


_WANTS = {
    "--nproc-per-node": "a whole number >= 1",
    "--nnodes": "a whole number >= 1",
    "--node-rank": "a whole number from 0 to --nnodes - 1",
    "--rdzv-endpoint": "HOST:PORT",
    "--rdzv-id": "a name",
    "--max-restarts": "a whole number >= 0",
    "--rdzv-timeout": "seconds > 0",
}


def _whole(values: dict[str, str], flag: str, minimum: int, default: int | None) -> int | None:
    if flag not in values:
        return default
    text = values[flag].strip()
    if not text.isdigit() or int(text) < minimum:
        hint = " (elastic ranges like 1:4 are not supported)" if flag == "--nnodes" else ""
        raise ConfigError(f"{flag} needs a whole number >= {minimum}, got {values[flag]!r}{hint}.")
    return int(text)


def _seconds(values: dict[str, str], flag: str, default: float) -> float:
    if flag not in values:
        return default
    try:
        seconds = float(values[flag])
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{flag} needs a number of seconds > 0, got {values[flag]!r}.")
    return seconds


def _resolve(host: str, port: int, endpoint: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint}: the host {host!r} cannot be resolved "
            f"({error.strerror}). Give a name or IP address of node 0 that this machine "
            "can resolve."
        ) from None
    return sorted({str(info[4][0]) for info in infos})


def _is_local(address: str) -> bool:
    """Whether ``address`` belongs to this machine: a socket can bind to it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


def _check_port_free(host: str, port: int, endpoint: str) -> None:
    try:
        with socket.create_server(("", port), reuse_port=False):
            pass
    except OSError as error:
        if error.errno != errno.EADDRINUSE:
            return  # let torch report anything stranger with its own words
        raise ConfigError(
            f"--rdzv-endpoint {endpoint}: port {port} on this machine (node 0, which hosts "
            "the rendezvous) is already in use, perhaps by another job's rendezvous. Pick "
            "a free port and give the same --rdzv-endpoint to every node."
        ) from None


def run_agent(command: list[str], env: dict[str, str]) -> int:
    """Run torch's agent to its end: its status, or ``PREEMPTED_EXIT`` once SIGTERM came here
    and was passed on (Kubernetes signals only a container's first process)."""
    terminated = False
    with subprocess.Popen(command, env=env) as agent:

        def forward(signum: int, frame: object) -> None:
            nonlocal terminated
            terminated = True
            agent.send_signal(signal.SIGTERM)

        previous = signal.signal(signal.SIGTERM, forward)
        try:
            status = agent.wait()
        except BaseException:
            agent.kill()  # as subprocess.call does (Ctrl-C, say)
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
    return PREEMPTED_EXIT if terminated else status


def destroy_group() -> None:
    """End this rank's process groups after collecting reference cycles, which (FSDP and
    DTensor state) would keep a gloo group alive into finalization (see ``exit_rank``)."""
    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_rank(status: int) -> NoReturn:
    """Flush and end a rank with ``status`` without the interpreter's finalization: freeing
    the gloo group torch's caches still hold then sometimes aborts a rank that succeeded
    ("terminate called without an active exception"; pytorch/pytorch#179291)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # The reader may have gone away (a closed pipe), or the stream been closed.
        with contextlib.suppress(BrokenPipeError, ValueError):
            stream.flush()
    os._exit(status)
