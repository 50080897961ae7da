"""titan-optim: optimizers over model parts, gradient clipping and LR schedules.

``build_optimizers`` turns an ``OptimizerConfig`` into an ``OptimizersContainer``: one
``torch.optim`` optimizer per model part (two with ``Muon``, which leaves embeddings, head,
norms and biases to AdamW), stepped together, clipped by the global gradient norm across
meshes and pipeline stages, checkpointed as one flat dict keyed by parameter FQN.
``build_lr_schedulers`` adds a warmup-stable-decay schedule per optimizer. Errors are
``OptimError``; a bad setting is an ``OptimizerConfigError`` (a ``ValueError``)."""

from titan_optim.__about__ import __version__
from titan_optim.build import build_optimizers
from titan_optim.clip import clip_grad_norm_
from titan_optim.config import MuonConfig, OptimizerConfig, ParamGroupRule
from titan_optim.container import OptimizersContainer
from titan_optim.errors import (
    NonFiniteGradError,
    OptimError,
    OptimizerConfigError,
    OptimizerInBackwardError,
)
from titan_optim.ft import FTOptimizersContainer
from titan_optim.in_backward import OptimizersInBackwardContainer
from titan_optim.lr_scheduler import (
    LRSchedulerConfig,
    LRSchedulersContainer,
    WarmupStableDecay,
    build_lr_schedulers,
)
from titan_optim.muon import Muon
from titan_optim.protocol import Optimizers

__all__ = [
    "FTOptimizersContainer",
    "LRSchedulerConfig",
    "LRSchedulersContainer",
    "Muon",
    "MuonConfig",
    "NonFiniteGradError",
    "OptimError",
    "OptimizerConfig",
    "OptimizerConfigError",
    "OptimizerInBackwardError",
    "Optimizers",
    "OptimizersContainer",
    "OptimizersInBackwardContainer",
    "ParamGroupRule",
    "WarmupStableDecay",
    "__version__",
    "build_lr_schedulers",
    "build_optimizers",
    "clip_grad_norm_",
]
