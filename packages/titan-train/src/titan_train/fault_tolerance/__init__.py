"""Fault tolerance with torchft: several replica groups train one model as one data-parallel
job, and a failed group drops out (and heals from its peers on return) without stopping
the others.

Each group is an ordinary titan run (any layout but pipeline parallel) with its own
``fault_tolerance.replica_id``; a torchft lighthouse decides every step which groups take
part. Per step torchft is met only in titan-optim's ``FTOptimizersContainer``: ``zero_grad``
starts the quorum, ``clip_grad_norm_`` (or ``step``) first averages each gradient's local
shard over the groups in ``bucket_cap_mb`` buckets, and the optimizer steps only when the
manager commits. Data is sharded over all groups (global dp rank ``replica_id x local dp +
local rank``); one group writes the shared checkpoint, each its own dataloader state and
metrics under ``<dump_folder>/ft-replica-<replica_id>/``. With ``semi_sync_method`` the
groups sync every ``sync_steps`` instead (``fault_tolerance.semi_sync``). Needs
``pip install 'titan-train[torchft]'``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch

from titan_dims import ParallelDims
from titan_train.errors import ConfigError, check_duration, check_number
from titan_train.fault_tolerance.semi_sync import check_semi_sync_fields

__all__ = [
    "LIGHTHOUSE_ENV",
    "FaultToleranceConfig",
    "ReplicaGroup",
    "check_fault_tolerance",
    "lighthouse_address",
]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The environment variable torchft reads the lighthouse address from."""

INSTALL_HINT = "pip install 'titan-train[torchft]'"


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Replica groups coordinated by torchft (keys as torchtitan's ``[fault_tolerance]``)."""

    enable: bool = False
    """Train as one replica group of a torchft job (needs the ``torchft`` extra)."""
    process_group: Literal["gloo", "nccl"] | None = None
    """Backend of the gradient averaging across replica groups; unset means nccl on CUDA,
    gloo otherwise (torchtitan's default is always gloo)."""
    process_group_timeout_ms: int = 10000
    """Timeout of that process group's operations, in milliseconds."""
    replica_id: int = 0
    """This replica group's index, 0 to group_size - 1."""
    group_size: int = 0
    """How many replica groups the job has (at full strength); must be set when enabled."""
    min_replica_size: int = 1
    """Fewest replica groups a step may proceed with."""
    lighthouse: str | None = None
    """The lighthouse address, e.g. ``http://host:29510``; unset reads ``TORCHFT_LIGHTHOUSE``
    as torchft does (titan's key)."""
    bucket_cap_mb: float = 25.0
    """MiB per bucket of the gradient average across replica groups: gradients are flattened
    into buckets, one all-reduce each; 0 all-reduces every gradient on its own (titan's)."""
    semi_sync_method: Literal["local_sgd", "diloco", ""] | None = None
    """Semi-synchronous training (``titan_train.fault_tolerance.semi_sync``): each group steps
    on its own gradients and the groups sync every ``sync_steps`` steps, averaging weights
    (local_sgd) or through an outer optimizer (diloco); unset averages gradients every step.
    ``""`` (what TOML files that cannot write "unset" hold) is read as unset."""
    sync_steps: int = 5
    """Optimizer steps between syncs (with semi_sync_method)."""
    should_quantize: bool = False
    """DiLoCo: quantize the pseudo-gradients before their all-reduce (CUDA only)."""
    fragment_sync_delay: int = 0
    """DiLoCo: steps between starting a fragment's all-reduce and waiting for it."""
    fragment_update_alpha: float = 0.0
    """DiLoCo: after a sync, weights = lerp(synced, local, alpha); 0 keeps the synced ones."""
    num_fragments: int = 1
    """DiLoCo: fragments of whole blocks that sync in turn (Streaming DiLoCo); must divide
    the model's blocks and sync_steps."""
    outer_lr: float = 0.7
    """DiLoCo: the outer SGD's learning rate (titan's key; torchtitan fixes 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo: the outer SGD's momentum, 0 to below 1 (titan's key; torchtitan fixes 0.9)."""
    outer_nesterov: bool = True
    """DiLoCo: Nesterov momentum in the outer SGD (titan's key; torchtitan's is on)."""

    def __post_init__(self) -> None:
        if self.semi_sync_method == "":
            self.semi_sync_method = None
        check_duration(
            "fault_tolerance.process_group_timeout_ms",
            self.process_group_timeout_ms,
            unit_s=1e-3,
            hint="milliseconds",
        )
        check_number(
            "fault_tolerance.bucket_cap_mb",
            self.bucket_cap_mb,
            low=0,
            hint="MiB per all-reduce bucket; 0 all-reduces each gradient alone",
        )
        check_semi_sync_fields(self)
        if not self.enable:
            return
        if self.group_size < 1:
            raise ConfigError(
                f"fault_tolerance.group_size={self.group_size} is not allowed with "
                "fault_tolerance.enable=true; set it to the number of replica groups (>= 1)."
            )
        if not 0 <= self.replica_id < self.group_size:
            raise ConfigError(
                f"fault_tolerance.replica_id={self.replica_id} is out of range: with "
                f"group_size={self.group_size} it must be 0 to {self.group_size - 1}."
            )
        if not 1 <= self.min_replica_size <= self.group_size:
            raise ConfigError(
                f"fault_tolerance.min_replica_size={self.min_replica_size} is not allowed; it "
                f"must be 1 to group_size={self.group_size}."
            )
        try:
            import torchft  # noqa: F401
        except ImportError:
            raise ConfigError(
                "fault_tolerance.enable=true needs torchft, which is not installed: "
                f"{INSTALL_HINT}, or set fault_tolerance.enable=false."
            ) from None


def lighthouse_address(config: FaultToleranceConfig, environ: Any = None) -> str:
    """The lighthouse address: ``config.lighthouse``, else ``$TORCHFT_LIGHTHOUSE``; raises
    ``ConfigError`` when neither is set."""
    environ = os.environ if environ is None else environ
    address = config.lighthouse or environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise ConfigError(
            "fault_tolerance.enable=true needs the torchft lighthouse's address: set "
            f"{LIGHTHOUSE_ENV}=http://<host>:<port> (as torchft reads it) or "
            "fault_tolerance.lighthouse; start one with `torchft_lighthouse`."
        )
    return address


def check_fault_tolerance(
    config: FaultToleranceConfig,
    dims: ParallelDims,
    *,
    create_seed_checkpoint: bool = False,
    environ: Any = None,
) -> None:
    """``ConfigError`` if ``config`` cannot run with layout ``dims``, a seed checkpoint, or
    without a lighthouse."""
    if not config.enable:
        return
    if create_seed_checkpoint:
        raise ConfigError(
            "checkpoint.create_seed_checkpoint=true cannot be combined with "
            "fault_tolerance.enable=true: write the seed checkpoint once without fault "
            "tolerance, then start every replica group from it (checkpoint.initial_load_path)."
        )
    if dims.pp_enabled:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={dims.pp} cannot be combined with "
            "fault_tolerance.enable=true (titan averages whole gradients across replica "
            "groups, not pipeline stages); use pipeline_parallel_degree=1 or "
            "fault_tolerance.enable=false."
        )
    lighthouse_address(config, environ)


class ReplicaGroup:
    """This process's part of a torchft replica group (``rank`` of ``world_size``): the
    ``Manager`` and what the trainer does with it."""

    def __init__(
        self,
        config: FaultToleranceConfig,
        *,
        device: torch.device,
        rank: int,
        world_size: int,
    ) -> None:
        import torchft
        from torch.distributed import TCPStore

        self.config = config
        self.replica_id = config.replica_id
        # torchft's structured loggers write empty messages with the data in `extra`, for
        # handlers attached to them; on the console they are blank lines.
        for name in ("torchft_quorums", "torchft_commits"):
            logging.getLogger(name).propagate = False
        timeout = timedelta(milliseconds=config.process_group_timeout_ms)
        backend = config.process_group or ("nccl" if device.type == "cuda" else "gloo")
        pg = (
            torchft.ProcessGroupNCCL(timeout=timeout)
            if backend == "nccl"
            else torchft.ProcessGroupGloo(timeout=timeout)
        )
        # The manager keeps its rendezvous keys in the replica group's store: torchrun's
        # (MASTER_ADDR/MASTER_PORT) or, in a plain one-process run, one of our own.
        self._store = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store_addr, store_port = "localhost", self._store.port
        self.manager = torchft.Manager(
            pg=pg,
            min_replica_size=config.min_replica_size,
            load_state_dict=None,
            state_dict=None,
            # Semi-sync methods meet only every sync_steps steps, in a quorum that must be
            # complete (a joining group heals in it) before they average: synchronous.
            use_async_quorum=config.semi_sync_method is None,
            replica_id=f"titan_ft_{config.replica_id}",
            store_addr=store_addr,
            store_port=store_port,
            rank=rank,
            world_size=world_size,
            lighthouse_addr=lighthouse_address(config),
            # Every group starts from the same weights (the same seed, or the same
            # checkpoint), so step 0 needs no copy; a group that joins later heals anyway.
            init_sync=False,
        )

    def data_parallel(self, dp_rank: int, dp_degree: int) -> tuple[int, int]:
        """The (rank, degree) the dataloader shards by: this group's ranks after those of
        the groups with smaller ids."""
        return self.replica_id * dp_degree + dp_rank, self.config.group_size * dp_degree

    def wrap_optimizers(self, optimizers: Any) -> Any:
        """``optimizers`` driven by the manager (their state reaches recovering peers through
        the checkpointer's callbacks, so it is not registered twice)."""
        from titan_optim import FTOptimizersContainer

        if self.config.semi_sync_method is not None:
            return optimizers  # each group steps alone; semi_sync syncs them
        return FTOptimizersContainer(
            optimizers, self.manager, state_key=None, bucket_cap_mb=self.config.bucket_cap_mb
        )

    def participants(self) -> int:
        """Replica groups taking part in this step (semi-sync: in the last sync, at least 1)."""
        if self.config.semi_sync_method is not None:
            return max(1, self.manager.num_participants())
        return self.manager.num_participants()

    def close(self) -> None:
        """Stop the manager's servers."""
        self.manager.shutdown(wait=False)
