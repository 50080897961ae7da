"""Turning an ``OptimizerConfig`` and a module into ``torch.optim`` optimizers (the helpers
``build_optimizers`` and both containers use).

Three decisions live here: which parameter group each parameter joins (the first matching
``ParamGroupRule``, else the default group); with ``name = "Muon"``, which optimizer each
parameter takes (the rule's ``optimizer``, else Muon for 2-D hidden weights and 3-D expert
stacks, AdamW for the rest); and which implementation torch runs (``fused`` only where every
parameter has a fused kernel for its device and dtype).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import (
    _get_foreach_kernels_supported_devices,
    _get_fused_kernels_supported_devices,
)

from titan_optim.config import OptimizerConfig
from titan_optim.errors import OptimizerConfigError
from titan_optim.muon import Muon, can_orthogonalize

__all__ = [
    "HEAD_PATTERNS",
    "build_optimizer",
    "build_part_optimizers",
    "group_parameters",
    "implementation_flags",
]

HEAD_PATTERNS = ("output.*", "lm_head.*", "*.lm_head.*")
"""FQN globs of output heads, which take AdamW under Muon (a ``ParamGroupRule`` naming
``optimizer`` overrides this, for heads named otherwise or to put one on Muon)."""

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
    """Split ``model``'s trainable parameters into torch param groups: the first rule whose
    pattern matches a parameter's FQN wins, the rest form the default group (last); empty groups
    are dropped, so every rank of a stage builds the same groups. With ``name = "Muon"`` each
    group also names its optimizer (Muon's first): a rule's ``optimizer``, else
    :func:`muon_default`; a parameter Muon cannot orthogonalise put on Muon raises
    ``OptimizerConfigError``."""
    rules = config.param_group_rules
    muon = config.name == "Muon"
    kinds = ("Muon", "AdamW") if muon else (None,)
    buckets: dict[tuple[int, str | None], list[nn.Parameter]] = {
        (i, k): [] for i in range(len(rules) + 1) for k in kinds
    }
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    for fqn, param in model.named_parameters():
        if not param.requires_grad:
            continue
        index = next((i for i, r in enumerate(rules) if r.matches(fqn)), len(rules))
        kind = None
        if muon:
            kind = rules[index].optimizer if index < len(rules) else None
            if kind is None:
                kind = muon_default(fqn, param, owners[id(param)])
            elif kind == "Muon" and not can_orthogonalize(param):
                raise OptimizerConfigError(
                    f"optimizer.param_group_rules[{rules[index].pattern!r}] puts {fqn} "
                    f"(shape {tuple(param.shape)}) on Muon, which orthogonalises only 2-D "
                    "matrices and 3-D stacks of expert matrices; narrow the pattern or set "
                    "its optimizer to 'AdamW'."
                )
        buckets[(index, kind)].append(param)
    groups = []
    for (i, kind), params in buckets.items():
        if params:
            group = {"params": params, **(rules[i].overrides() if i < len(rules) else {})}
            groups.append(group if kind is None else {**group, "optimizer": kind})
    return groups


def muon_default(fqn: str, param: torch.Tensor, owner: nn.Module) -> str:
    """``"Muon"`` for a hidden weight matrix or expert stack; ``"AdamW"`` for embeddings,
    output heads (``HEAD_PATTERNS``), norms, biases and anything not 2-D or 3-D."""
    if not can_orthogonalize(param) or isinstance(owner, nn.Embedding):
        return "AdamW"
    if any(fnmatchcase(fqn, pattern) for pattern in HEAD_PATTERNS):
        return "AdamW"
    return "Muon"


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
    """One ``torch.optim`` optimizer over ``params`` (param groups) as ``config`` says, and the
    reason ``fused`` fell back, if it did (the caller warns once for all). Muon groups get
    ``torch.optim.Muon`` when all their parameters are plain 2-D tensors, else titan's ``Muon``."""
    kinds = {g.get("optimizer") for g in params}
    if len(kinds) != 1:
        raise ValueError(f"build_optimizer takes groups of one optimizer, got {sorted(kinds)}")
    kind = kinds.pop()
    params = [{k: v for k, v in g.items() if k != "optimizer"} for g in params]
    flat = [p for group in params for p in group["params"]]
    kwargs = config.optimizer_kwargs(kind)
    if kind == "Muon":
        plain = all(p.ndim == 2 and not isinstance(p, DTensor) for p in flat)
        cls = torch.optim.Muon if plain else Muon
        return cls(params, **kwargs), None
    flags, fallback = implementation_flags(flat, config.implementation)
    cls = _CLASSES[kind or config.name]
    return cls(params, **kwargs, **flags), fallback


def build_part_optimizers(
    groups: list[dict[str, Any]], config: OptimizerConfig
) -> tuple[list[torch.optim.Optimizer], list[str | None]]:
    """The optimizers of one model part: one, or under Muon one per optimizer its groups
    name, in the order the groups name them. Returns them and the ``fused`` fallbacks."""
    opts, reasons = [], []
    for kind in dict.fromkeys(g.get("optimizer") for g in groups):
        opt, reason = build_optimizer([g for g in groups if g.get("optimizer") == kind], config)
        opts.append(opt)
        reasons.append(reason)
    return opts, reasons


def warn_fallback(reasons: Iterable[str | None]) -> None:
    """Warn once for the first non-empty fallback reason."""
    reason = next((r for r in reasons if r), None)
    if reason is not None:
        warnings.warn(reason, UserWarning, stacklevel=3)
