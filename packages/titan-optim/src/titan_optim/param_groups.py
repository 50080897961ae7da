"""Turning an ``OptimizerConfig`` and a module into ``torch.optim`` optimizers (the helpers
``build_optimizers`` and both containers use).

Two decisions live here: which parameter group each parameter joins (the first matching
``ParamGroupRule``, else the default group), and which implementation torch runs (``fused``
only where every parameter has a fused kernel for its device and dtype).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._foreach_utils import (
    _get_foreach_kernels_supported_devices,
    _get_fused_kernels_supported_devices,
)

from titan_optim.config import OptimizerConfig

__all__ = ["build_optimizer", "group_parameters", "implementation_flags"]

_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
    "SGD": torch.optim.SGD,
}

# Which devices torch has fused and foreach optimizer kernels for, as torch itself reports it
# (private helpers, present in every torch this package supports).
_FUSED_DEVICES = tuple(_get_fused_kernels_supported_devices())
_FOREACH_DEVICES = tuple(_get_foreach_kernels_supported_devices())


def group_parameters(model: nn.Module, config: OptimizerConfig) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into torch param groups by ``config``'s rules.

    Rules are tried in order and the first whose pattern matches a parameter's FQN wins; the
    remaining parameters form the default group. Groups are ordered rule by rule with the
    default group last, and empty groups are dropped, so every rank of a pipeline stage
    builds the same groups.
    """
    rules = config.param_group_rules
    buckets: list[list[nn.Parameter]] = [[] for _ in range(len(rules) + 1)]
    for fqn, param in model.named_parameters():
        if not param.requires_grad:
            continue
        index = next((i for i, r in enumerate(rules) if r.matches(fqn)), len(rules))
        buckets[index].append(param)
    groups = []
    for i, params in enumerate(buckets):
        if params:
            groups.append({"params": params, **(rules[i].overrides() if i < len(rules) else {})})
    return groups


def implementation_flags(
    params: Iterable[torch.Tensor], implementation: str
) -> tuple[dict[str, bool], str | None]:
    """The ``foreach``/``fused`` keyword arguments for ``implementation`` on ``params``.

    Returns the flags and, when ``fused`` had to fall back, the reason (for one warning).
    The fallback is ``foreach`` on devices with foreach kernels, else ``for-loop``.
    """
    if implementation == "for-loop":
        return {"foreach": False, "fused": False}, None
    if implementation == "foreach":
        return {"foreach": True, "fused": False}, None
    params = list(params)
    for p in params:
        if p.device.type not in _FUSED_DEVICES or not p.is_floating_point():
            device = p.device.type
            fallback = "foreach" if device in _FOREACH_DEVICES else "for-loop"
            reason = (
                f"optimizer.implementation='fused' is not available for {p.dtype} parameters "
                f"on {device!r} in this torch build (fused kernels: floating point on "
                f"{', '.join(_FUSED_DEVICES)}); using {fallback!r} instead."
            )
            return {"foreach": fallback == "foreach", "fused": False}, reason
    return {"foreach": False, "fused": True}, None


def build_optimizer(
    params: list[dict[str, Any]], config: OptimizerConfig
) -> tuple[torch.optim.Optimizer, str | None]:
    """One ``torch.optim`` optimizer over ``params`` (param groups) as ``config`` says.

    Returns the optimizer and the reason ``fused`` fell back, if it did, so that the caller
    warns once for all the optimizers it builds.
    """
    flat = [p for group in params for p in group["params"]]
    flags, fallback = implementation_flags(flat, config.implementation)
    cls = _CLASSES[config.name]
    return cls(params, **config.optimizer_kwargs(), **flags), fallback


def warn_fallback(reasons: Iterable[str | None]) -> None:
    """Warn once for the first non-empty fallback reason."""
    reason = next((r for r in reasons if r), None)
    if reason is not None:
        warnings.warn(reason, UserWarning, stacklevel=3)
