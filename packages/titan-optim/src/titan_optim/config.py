"""``OptimizerConfig``: which optimizer to build, its hyperparameters and per-group rules.

Field names follow torchtitan's ``[optimizer]`` section where one exists, so its TOML files
carry over; ``param_group_rules`` and ``implementation`` are titan's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch

from titan_optim.errors import (
    OptimizerConfigError,
    check_bool,
    check_choice,
    check_int,
    check_number,
)

__all__ = [
    "IMPLEMENTATIONS",
    "MUON_GROUPS",
    "OPTIMIZER_NAMES",
    "MuonConfig",
    "OptimizerConfig",
    "OptimizerConfigError",
    "ParamGroupRule",
]

OPTIMIZER_NAMES = ("Adam", "AdamW", "Muon", "SGD")
"""Optimizers ``build_optimizers`` knows, by the name of their ``torch.optim`` class."""

IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
"""How torch runs the update: one kernel per tensor, per op over a list, or one fused kernel."""

MUON_GROUPS = ("Muon", "AdamW")
"""The optimizers a parameter can join when ``name = "Muon"`` (``ParamGroupRule.optimizer``)."""

ADJUST_LR_FNS = ("original", "match_rms_adamw")
"""``torch.optim.Muon``'s LR scalings: Keller Jordan's ``sqrt(max(1, rows/cols))`` or
Moonshot's ``0.2 * sqrt(max(rows, cols))`` (an update RMS like AdamW's)."""


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
    optimizer: str | None = None
    """With ``name = "Muon"``: ``Muon`` or ``AdamW`` for matching parameters, overriding the
    default split (``None`` keeps it). A parameter Muon cannot orthogonalise (not 2-D or a
    3-D stack of expert matrices) put on ``Muon`` is refused when the optimizers are built."""

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise OptimizerConfigError(
                f"optimizer.param_group_rules.pattern={self.pattern!r} is not allowed; "
                "it must be a non-empty glob such as '*.bias'."
            )
        if self.optimizer is not None:
            check_choice(
                f"optimizer.param_group_rules[{self.pattern!r}].optimizer",
                self.optimizer,
                MUON_GROUPS,
            )
        for key in ("lr", "weight_decay"):
            if getattr(self, key) is not None:
                name = f"optimizer.param_group_rules[{self.pattern!r}].{key}"
                setattr(self, key, check_number(name, getattr(self, key), low=0))

    def matches(self, fqn: str) -> bool:
        """Whether the parameter named ``fqn`` falls under this rule."""
        return fnmatchcase(fqn, self.pattern)

    def overrides(self) -> dict[str, float]:
        """The optimizer keyword arguments this rule replaces."""
        pairs = (("lr", self.lr), ("weight_decay", self.weight_decay))
        return {key: value for key, value in pairs if value is not None}


@dataclass(kw_only=True)
class MuonConfig:
    """Muon's settings (``[optimizer.muon]``), named as ``torch.optim.Muon`` names them.

    With ``optimizer.name = "Muon"``, 2-D hidden weights (and 3-D stacks of expert matrices,
    orthogonalised per expert) take Muon at ``optimizer.lr`` and ``optimizer.weight_decay``;
    embeddings, the output head, norms and biases take AdamW with ``optimizer.betas`` and
    ``optimizer.eps`` at ``adamw_lr`` / ``adamw_weight_decay`` (defaulting to Muon's).

    >>> MuonConfig().adjust_lr_fn
    'match_rms_adamw'
    """

    momentum: float = 0.95
    """Momentum factor, in [0, 1)."""
    nesterov: bool = True
    """Orthogonalise the Nesterov look-ahead ``grad.lerp(buffer, momentum)``."""
    ns_steps: int = 5
    """Newton-Schulz iterations, 1..99."""
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    """The quintic Newton-Schulz coefficients (a, b, c)."""
    eps: float = 1e-7
    """Lower bound of the norm the update is divided by before the iterations."""
    adjust_lr_fn: str = "match_rms_adamw"
    """``original`` or ``match_rms_adamw`` (see ``ADJUST_LR_FNS``). The default lets an
    AdamW-tuned ``optimizer.lr`` carry over (torch's own default is ``original``). An expert
    stack is scaled by its last two dimensions as (rows, cols); ``original`` is not symmetric
    in them, so a stack stored (in, out), as titan-models' experts are, gets the scaling of
    the transposed ``nn.Linear`` weight; ``match_rms_adamw`` is symmetric."""
    adamw_lr: float | None = None
    """Learning rate of the AdamW group; ``None`` uses ``optimizer.lr``."""
    adamw_weight_decay: float | None = None
    """Weight decay of the AdamW group; ``None`` uses ``optimizer.weight_decay``."""

    def __post_init__(self) -> None:
        self.momentum = check_number(
            "optimizer.muon.momentum", self.momentum, low=0, high=1, high_open=True
        )
        check_bool("optimizer.muon.nesterov", self.nesterov)
        self.ns_steps = check_int("optimizer.muon.ns_steps", self.ns_steps, minimum=1)
        if self.ns_steps >= 100:
            raise OptimizerConfigError(
                f"optimizer.muon.ns_steps={self.ns_steps} is not allowed; torch.optim.Muon "
                "takes fewer than 100 Newton-Schulz steps (5 is usual)."
            )
        want = "three numbers (a, b, c), e.g. (3.4445, -4.7750, 2.0315)"
        self.ns_coefficients = _numbers(
            "optimizer.muon.ns_coefficients", self.ns_coefficients, 3, want
        )  # type: ignore[assignment]
        self.eps = check_number("optimizer.muon.eps", self.eps, low=0, low_open=True)
        check_choice("optimizer.muon.adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR_FNS)
        if self.adamw_lr is not None:
            self.adamw_lr = check_number("optimizer.muon.adamw_lr", self.adamw_lr, low=0)
        if self.adamw_weight_decay is not None:
            self.adamw_weight_decay = check_number(
                "optimizer.muon.adamw_weight_decay", self.adamw_weight_decay, low=0
            )


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer of a run. Defaults are a sound AdamW for LLM pretraining.

    >>> OptimizerConfig(name="AdamW", lr=3e-4).betas
    (0.9, 0.95)
    """

    name: str = "AdamW"
    """Optimizer: ``Adam``, ``AdamW``, ``Muon`` (with AdamW for what Muon does not fit, see
    ``MuonConfig``) or ``SGD``."""
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
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon's settings, used when ``name = "Muon"``."""

    def __post_init__(self) -> None:
        check_choice("optimizer.name", self.name, OPTIMIZER_NAMES)
        if self.name == "Muon" and not hasattr(torch.optim, "Muon"):
            raise OptimizerConfigError(
                f"optimizer.name='Muon' needs torch.optim.Muon (torch 2.9 or newer); this is "
                f"torch {torch.__version__}. Upgrade torch or choose AdamW."
            )
        check_choice("optimizer.implementation", self.implementation, IMPLEMENTATIONS)
        self.lr = check_number("optimizer.lr", self.lr, low=0)
        self.eps = check_number("optimizer.eps", self.eps, low=0)
        self.weight_decay = check_number("optimizer.weight_decay", self.weight_decay, low=0)
        self.momentum = check_number(
            "optimizer.momentum", self.momentum, low=0, high=1, high_open=True
        )
        want = "two numbers in [0, 1), e.g. (0.9, 0.95)"
        betas = _numbers("optimizer.betas", self.betas, 2, want, low=0, high=1, high_open=True)
        self.betas = betas  # type: ignore[assignment]
        check_bool("optimizer.early_step_in_backward", self.early_step_in_backward)
        self.param_group_rules = [_as_rule(r) for r in self.param_group_rules]
        if isinstance(self.muon, dict):
            self.muon = MuonConfig(**self.muon)
        named = [r.pattern for r in self.param_group_rules if r.optimizer is not None]
        if named and self.name != "Muon":
            raise OptimizerConfigError(
                f"optimizer.param_group_rules {named} name an optimizer, which only "
                f"optimizer.name='Muon' splits by; got name={self.name!r}. Drop the rules' "
                "'optimizer' or set name='Muon'."
            )

    def optimizer_kwargs(self, kind: str | None = None) -> dict[str, Any]:
        """Keyword arguments for the ``torch.optim`` class, without the implementation flags;
        with ``name = "Muon"``, ``kind`` picks the ``Muon`` or the ``AdamW`` group's."""
        if self.name == "Muon" and kind == "Muon":
            m = self.muon
            muon = ("momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
            return {"lr": self.lr, "weight_decay": self.weight_decay} | {
                key: getattr(m, key) for key in muon
            }
        lr, weight_decay = self.lr, self.weight_decay
        if self.name == "Muon":
            m = self.muon
            lr = lr if m.adamw_lr is None else m.adamw_lr
            weight_decay = weight_decay if m.adamw_weight_decay is None else m.adamw_weight_decay
        if self.name == "SGD":
            return {"lr": lr, "momentum": self.momentum, "weight_decay": weight_decay}
        return {"lr": lr, "betas": self.betas, "eps": self.eps, "weight_decay": weight_decay}


def _numbers(name: str, value: object, count: int, want: str, **bounds: Any) -> tuple[float, ...]:
    """``value`` as a tuple of ``count`` numbers, each checked by ``check_number``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        problem = "is not allowed"
    elif len(value) != count:
        problem = f"has {len(value)} values"
    else:
        return tuple(check_number(f"{name}[{i}]", v, **bounds) for i, v in enumerate(value))
    raise OptimizerConfigError(f"{name}={value!r} {problem}; give {want}.")


def _as_rule(rule: object) -> ParamGroupRule:
    """Accept a rule or its TOML form (a table with ``pattern``, ``lr``, ``weight_decay``)."""
    if isinstance(rule, ParamGroupRule):
        return rule
    if isinstance(rule, dict):
        unknown = set(rule) - {"pattern", "lr", "weight_decay", "optimizer"}
        if unknown:
            raise OptimizerConfigError(
                f"optimizer.param_group_rules has unknown key(s) {sorted(unknown)}; "
                "allowed keys are 'pattern', 'lr', 'weight_decay', 'optimizer'."
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
