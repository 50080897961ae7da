"""``OptimizerConfig``: which optimizer to build, its hyperparameters and per-group rules.

Field names follow torchtitan's ``[optimizer]`` section where one exists, so its TOML files
carry over; ``param_group_rules`` and ``implementation`` are titan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from titan_optim.errors import OptimizerConfigError, check_bool, check_choice, check_number

__all__ = [
    "IMPLEMENTATIONS",
    "OPTIMIZER_NAMES",
    "OptimizerConfig",
    "OptimizerConfigError",
    "ParamGroupRule",
]

OPTIMIZER_NAMES = ("Adam", "AdamW", "SGD")
"""Optimizers ``build_optimizers`` knows, by the name of their ``torch.optim`` class."""

IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
"""How torch runs the update: one kernel per tensor, per op over a list, or one fused kernel."""


@dataclass(kw_only=True)
class ParamGroupRule:
    """Settings for the parameters whose fully-qualified name matches ``pattern``.

    >>> ParamGroupRule(pattern="*.bias", weight_decay=0.0).matches("layers.0.attn.wq.bias")
    True
    """

    pattern: str
    """A shell-style glob over the parameter's FQN (``fnmatch``), e.g. ``*norm*``, ``*.bias``."""
    lr: float | None = None
    """Learning rate for matching parameters; ``None`` keeps the optimizer's."""
    weight_decay: float | None = None
    """Weight decay for matching parameters; ``None`` keeps the optimizer's."""

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise OptimizerConfigError(
                f"optimizer.param_group_rules.pattern={self.pattern!r} is not allowed; "
                "it must be a non-empty glob such as '*.bias'."
            )
        if self.lr is not None:
            self.lr = check_number(
                f"optimizer.param_group_rules[{self.pattern!r}].lr", self.lr, low=0
            )
        if self.weight_decay is not None:
            self.weight_decay = check_number(
                f"optimizer.param_group_rules[{self.pattern!r}].weight_decay",
                self.weight_decay,
                low=0,
            )

    def matches(self, fqn: str) -> bool:
        """Whether the parameter named ``fqn`` falls under this rule."""
        return fnmatchcase(fqn, self.pattern)

    def overrides(self) -> dict[str, float]:
        """The optimizer keyword arguments this rule replaces."""
        out = {}
        if self.lr is not None:
            out["lr"] = self.lr
        if self.weight_decay is not None:
            out["weight_decay"] = self.weight_decay
        return out


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer of a run. Defaults are a sound AdamW for LLM pretraining.

    >>> OptimizerConfig(name="AdamW", lr=3e-4).betas
    (0.9, 0.95)
    """

    name: str = "AdamW"
    """Optimizer: ``Adam``, ``AdamW`` or ``SGD``."""
    lr: float = 8e-4
    """Peak learning rate (the LR schedule scales it)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's decay rates of the first and second moment estimates; each in [0, 1)."""
    eps: float = 1e-8
    """Adam's term added to the denominator for numerical stability."""
    weight_decay: float = 0.1
    """Weight decay (decoupled for AdamW, L2 for Adam and SGD)."""
    momentum: float = 0.0
    """SGD's momentum factor, in [0, 1); ignored by Adam and AdamW."""
    implementation: str = "fused"
    """``for-loop``, ``foreach`` or ``fused``; ``fused`` falls back, with one warning, where
    the parameters' device or dtype has no fused kernel."""
    param_group_rules: list[ParamGroupRule] = field(default_factory=list)
    """Per-parameter overrides matched by FQN pattern; the first matching rule wins."""
    early_step_in_backward: bool = False
    """Step each parameter from its post-accumulate-grad hook, freeing its gradient early.
    Incompatible with gradient clipping and pipeline parallelism."""

    def __post_init__(self) -> None:
        check_choice("optimizer.name", self.name, OPTIMIZER_NAMES)
        check_choice("optimizer.implementation", self.implementation, IMPLEMENTATIONS)
        self.lr = check_number("optimizer.lr", self.lr, low=0)
        self.eps = check_number("optimizer.eps", self.eps, low=0)
        self.weight_decay = check_number("optimizer.weight_decay", self.weight_decay, low=0)
        self.momentum = check_number(
            "optimizer.momentum", self.momentum, low=0, high=1, high_open=True
        )
        if isinstance(self.betas, (str, bytes)) or not hasattr(self.betas, "__len__"):
            raise OptimizerConfigError(
                f"optimizer.betas={self.betas!r} is not allowed; give two numbers in [0, 1), "
                "e.g. (0.9, 0.95)."
            )
        if len(self.betas) != 2:
            raise OptimizerConfigError(
                f"optimizer.betas={self.betas!r} has {len(self.betas)} values; give two numbers "
                "in [0, 1), e.g. (0.9, 0.95)."
            )
        self.betas = tuple(  # type: ignore[assignment]
            check_number(f"optimizer.betas[{i}]", b, low=0, high=1, high_open=True)
            for i, b in enumerate(self.betas)
        )
        check_bool("optimizer.early_step_in_backward", self.early_step_in_backward)
        self.param_group_rules = [_as_rule(r) for r in self.param_group_rules]

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the ``torch.optim`` class, without the implementation flags."""
        if self.name == "SGD":
            return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}
        return {
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }


def _as_rule(rule: object) -> ParamGroupRule:
    """Accept a rule or its TOML form (a table with ``pattern``, ``lr``, ``weight_decay``)."""
    if isinstance(rule, ParamGroupRule):
        return rule
    if isinstance(rule, dict):
        unknown = set(rule) - {"pattern", "lr", "weight_decay"}
        if unknown:
            raise OptimizerConfigError(
                f"optimizer.param_group_rules has unknown key(s) {sorted(unknown)}; "
                "allowed keys are 'pattern', 'lr', 'weight_decay'."
            )
        if "pattern" not in rule:
            raise OptimizerConfigError(
                f"optimizer.param_group_rules entry {rule!r} has no 'pattern'; "
                "give a glob such as '*.bias'."
            )
        return ParamGroupRule(**rule)
    raise OptimizerConfigError(
        f"optimizer.param_group_rules entries must be ParamGroupRule or tables, got {rule!r}."
    )
