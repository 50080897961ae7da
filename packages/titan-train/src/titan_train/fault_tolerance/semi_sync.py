"""Semi-synchronous training with torchft: LocalSGD and DiLoCo as fault-tolerance modes.

With ``fault_tolerance.semi_sync_method`` each replica group steps on its own gradients and
every ``sync_steps`` steps the groups meet in one torchft quorum (where a returning group
heals): ``local_sgd`` averages their weights (arXiv:1805.09767); ``diloco`` averages the
pseudo-gradients (weights at the last sync minus now) and an outer SGD (``outer_lr``,
``outer_momentum``, ``outer_nesterov``) steps the synced weights (arXiv:2311.08105; equal to
LocalSGD at ``outer_lr = 1``, ``outer_momentum = 0``); ``num_fragments`` > 1 syncs fragments
of whole blocks in turn (arXiv:2501.18512). The keys and outer defaults are torchtitan's;
torchft's ``LocalSGD`` / ``DiLoCo`` do the work through the optimizer's step hooks. Between
syncs the groups differ: the shared checkpoint holds the writer's (set
``checkpoint.interval`` to a multiple of ``sync_steps``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_train.errors import ConfigError, check_int, check_number

if TYPE_CHECKING:
    from titan_optim import Optimizers
    from titan_train.fault_tolerance import FaultToleranceConfig, ReplicaGroup

__all__ = [
    "METHODS",
    "check_semi_sync",
    "check_semi_sync_fields",
    "model_fragments",
    "semi_sync_training",
]

logger = logging.getLogger("titan_train")

METHODS = ("local_sgd", "diloco")
"""The values of ``fault_tolerance.semi_sync_method`` (unset: average gradients every step)."""


def check_semi_sync_fields(config: FaultToleranceConfig) -> None:
    """``ConfigError`` for semi-sync keys out of range or combined impossibly."""
    ft = "fault_tolerance"
    check_int(f"{ft}.sync_steps", config.sync_steps, minimum=1, hint="optimizer steps per sync")
    check_int(f"{ft}.num_fragments", config.num_fragments, minimum=1, hint="model fragments")
    check_int(f"{ft}.fragment_sync_delay", config.fragment_sync_delay, minimum=0, hint="steps")
    check_number(f"{ft}.fragment_update_alpha", config.fragment_update_alpha, low=0, high=1)
    check_number(f"{ft}.outer_lr", config.outer_lr, low=0, hint="the outer SGD's lr")
    check_number(f"{ft}.outer_momentum", config.outer_momentum, low=0, high=1, high_open=True)
    method = config.semi_sync_method
    if method is None:
        return
    if method not in METHODS:
        raise ConfigError(
            f"{ft}.semi_sync_method={method!r} is not allowed; it must be one of "
            f"{', '.join(METHODS)} (or unset, to average gradients every step)."
        )
    if not config.enable:
        raise ConfigError(
            f"{ft}.semi_sync_method={method!r} needs {ft}.enable=true (it is a mode of "
            "torchft replica groups); enable fault tolerance or unset semi_sync_method."
        )
    if method == "local_sgd" and config.num_fragments != 1:
        raise ConfigError(
            f"{ft}.num_fragments={config.num_fragments} applies to semi_sync_method='diloco' "
            "only (local_sgd averages the whole model); set it to 1 or use diloco."
        )
    if method == "diloco":
        _check_diloco_schedule(config)


def _check_diloco_schedule(config: FaultToleranceConfig) -> None:
    steps, fragments = config.sync_steps, config.num_fragments
    if steps % fragments != 0:
        example = fragments * max(1, steps // fragments)
        raise ConfigError(
            f"fault_tolerance.sync_steps={steps} must be a multiple of "
            f"fault_tolerance.num_fragments={fragments}: one fragment syncs every "
            f"sync_steps / num_fragments steps; e.g. sync_steps={example}."
        )
    per_fragment = steps // fragments
    if config.fragment_sync_delay >= per_fragment:
        raise ConfigError(
            f"fault_tolerance.fragment_sync_delay={config.fragment_sync_delay} must be below "
            f"sync_steps / num_fragments = {per_fragment} (a fragment must finish syncing "
            "before its next sync starts); lower it or raise sync_steps."
        )


def check_semi_sync(config: FaultToleranceConfig, *, n_layers: int, device_type: str) -> None:
    """Raise ``ConfigError`` if the semi-sync mode cannot run this model (``n_layers``
    blocks) on ``device_type``; checked before any work. Nothing to check when unset."""
    if not config.enable or config.semi_sync_method is None:
        return
    if config.num_fragments > 1 and n_layers % config.num_fragments != 0:
        divisors = [d for d in range(1, n_layers + 1) if n_layers % d == 0]
        raise ConfigError(
            f"fault_tolerance.num_fragments={config.num_fragments} does not divide the "
            f"model's {n_layers} blocks: each fragment holds the same number of whole blocks; "
            f"use one of {', '.join(map(str, divisors))}."
        )
    if config.should_quantize and device_type != "cuda":
        raise ConfigError(
            "fault_tolerance.should_quantize=true needs CUDA (torchft quantizes the "
            f"pseudo-gradients with GPU kernels), not {device_type}; set it to false."
        )


def model_fragments(model: nn.Module, num_fragments: int) -> list[nn.Module]:
    """``model`` cut into ``num_fragments`` views of equal runs of its ``layers``, the
    children before them with the first and those after with the last."""
    if num_fragments == 1:
        return [model]
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleDict | nn.ModuleList):
        raise ConfigError(
            f"fault_tolerance.num_fragments={num_fragments} needs a model with its blocks "
            f"in `layers`; {type(model).__name__} has none: set num_fragments=1."
        )
    names = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else None
    block_list = list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)
    per = len(block_list) // num_fragments
    children = list(model.named_children())
    cut = next(i for i, (name, _) in enumerate(children) if name == "layers")
    fragments = []
    for f in range(num_fragments):
        fragment = nn.Module()
        if f == 0:
            for name, child in children[:cut]:
                fragment.add_module(name, child)
        part = nn.ModuleDict(
            {(names[i] if names else str(i)): block_list[i] for i in range(f * per, (f + 1) * per)}
        )
        fragment.add_module("layers", part)
        if f == num_fragments - 1:
            for name, child in children[cut + 1 :]:
                fragment.add_module(name, child)
        fragments.append(fragment)
    return fragments


class _TorchOptimizerHooks:
    """titan's optimizer container as torchft's ``LocalSGD``/``DiLoCo`` drive an optimizer:
    their hooks take ``(optimizer, args, kwargs)``, the container calls ``hook(container)``."""

    def __init__(self, optimizers: Optimizers) -> None:
        self._optimizers = optimizers

    def register_step_pre_hook(self, hook: Callable[..., None]) -> Any:
        return self._optimizers.register_step_pre_hook(lambda opt: hook(opt, (), {}))

    def register_step_post_hook(self, hook: Callable[..., None]) -> Any:
        return self._optimizers.register_step_post_hook(lambda opt: hook(opt, (), {}))


def semi_sync_training(
    config: FaultToleranceConfig,
    replicas: ReplicaGroup | None,
    model_parts: list[nn.Module],
    optimizers: Optimizers,
) -> AbstractContextManager[Any]:
    """The training loop's context: torchft's ``LocalSGD`` or ``DiLoCo`` when
    ``config.semi_sync_method`` is set, else a no-op."""
    if replicas is None or config.semi_sync_method is None:
        return contextlib.nullcontext()
    from torchft import local_sgd

    (model,) = model_parts  # pipeline parallel is refused with fault tolerance
    manager, optimizer = replicas.manager, _TorchOptimizerHooks(optimizers)
    if config.semi_sync_method == "local_sgd":
        return _logged(
            local_sgd.LocalSGD(manager, model, optimizer, sync_every=config.sync_steps),  # type: ignore[arg-type]
            config,
        )
    fragments = model_fragments(model, config.num_fragments)
    return _logged(
        local_sgd.DiLoCo(
            manager,
            fragments,
            optimizer,  # type: ignore[arg-type]
            [_outer_optimizer(f, config) for f in fragments],
            sync_every=config.sync_steps,
            should_quantize=config.should_quantize,
            fragment_sync_delay=config.fragment_sync_delay,
            fragment_update_alpha=config.fragment_update_alpha,
        ),
        config,
    )


def _outer_optimizer(fragment: nn.Module, config: FaultToleranceConfig) -> torch.optim.SGD:
    # Nesterov without momentum is plain SGD (torch refuses the combination).
    return torch.optim.SGD(
        [p for p in fragment.parameters() if p.requires_grad],
        lr=config.outer_lr,
        momentum=config.outer_momentum,
        nesterov=config.outer_nesterov and config.outer_momentum > 0,
    )


@contextlib.contextmanager
def _logged(method: Any, config: FaultToleranceConfig) -> Iterator[Any]:
    logger.info(
        "Semi-synchronous training: %s, replica groups sync every %d steps%s",
        config.semi_sync_method,
        config.sync_steps,
        f" ({config.num_fragments} fragments)" if config.semi_sync_method == "diloco" else "",
    )
    with method:
        yield method
