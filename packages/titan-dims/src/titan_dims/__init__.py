"""titan-dims: parallel layouts for PyTorch pretraining.

``ParallelDims`` validates a run's degrees (dp_replicate, dp_shard, cp, tp, pp, ep) and
lazily builds its ``DeviceMesh`` with the flattened sub-meshes trainers use; ``simulate``
builds the same mesh for any world size in one process; ``init_distributed`` starts the
process group from torchrun's environment. Errors are ``TitanDimsError``; a layout that
cannot be built is a ``ParallelDimsError`` (a ``ValueError``)."""

from titan_dims import _quiet_torch  # noqa: F401  (first: it imports torch, see there)
from titan_dims.__about__ import __version__
from titan_dims.config import ParallelismConfig
from titan_dims.device import default_backend, detect_device_type, device_module
from titan_dims.distributed import (
    DistributedEnv,
    init_distributed,
    local_device_index,
    set_collective_timeout,
)
from titan_dims.errors import DistributedEnvError, ParallelDimsError, TitanDimsError
from titan_dims.layout import MeshLayout
from titan_dims.parallel_dims import ParallelDims, suggest_degrees
from titan_dims.simulate import fake_process_group, simulate

__all__ = [
    "DistributedEnv",
    "DistributedEnvError",
    "MeshLayout",
    "ParallelDims",
    "ParallelDimsError",
    "ParallelismConfig",
    "TitanDimsError",
    "__version__",
    "default_backend",
    "detect_device_type",
    "device_module",
    "fake_process_group",
    "init_distributed",
    "local_device_index",
    "set_collective_timeout",
    "simulate",
    "suggest_degrees",
]
