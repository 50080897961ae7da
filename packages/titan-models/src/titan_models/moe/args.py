"""``MoEArgs``: the shape and routing rules of one mixture-of-experts layer, onto which a
family's args map (DeepSeek-V3's ``n_routed_experts``, ``n_activated_experts``...). Every
field is checked when built, so a layer that cannot route fails before any allocation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_models.errors import (
    ModelConfigError,
    check_bool,
    check_choice,
    check_int,
    check_number,
)

__all__ = ["SCORE_FUNCS", "MoEArgs"]

SCORE_FUNCS = ("softmax", "sigmoid")
"""How router logits become scores: a softmax over the experts, or one sigmoid each."""


@dataclass(kw_only=True)
class MoEArgs:
    """One MoE layer's routing and sizes (the widths, ``dim`` and ``hidden_dim``, are the
    model's and are given to ``MoE`` beside these)."""

    num_experts: int = 8
    """Routed experts."""
    num_shared_experts: int = 1
    """0: no shared expert; else one SwiGLU of ``hidden_dim * num_shared_experts`` that
    every token goes through."""
    top_k: int = 1
    """Routed experts per token."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over the experts, or a sigmoid per expert (DeepSeek-V3)."""
    route_norm: bool = False
    """Renormalize each token's top-k weights to sum to 1 (DeepSeek-V3 with sigmoid)."""
    route_scale: float = 1.0
    """Multiplies the routing weights (after ``route_norm``)."""
    n_expert_groups: int = 1
    """Grouped routing: the experts split into this many equal groups (1: off)."""
    n_limited_groups: int = 1
    """Groups a token may take its experts from: the best ones by the sum of their two
    highest (bias-corrected) scores."""
    load_balance_coeff: float | None = 1e-3
    """Step of the auxiliary-loss-free bias update (``update_expert_bias``); ``None``: no
    bias at all (routing by the scores alone)."""
    aux_loss_alpha: float = 0.0
    """Weight of DeepSeek-V3's sequence-level balance loss, added to the backward by the
    layer itself; 0: off."""
    use_grouped_mm: bool = True
    """Run the experts as grouped matmuls where the device and dtype have them; else (and
    when False) the per-expert fallback. Both give the same result."""

    def __post_init__(self) -> None:
        check_int("num_experts", self.num_experts, minimum=1)
        check_int("num_shared_experts", self.num_shared_experts, minimum=0)
        check_int("top_k", self.top_k, minimum=1)
        if self.top_k > self.num_experts:
            raise ModelConfigError(
                f"top_k={self.top_k} is not allowed; it must be at most num_experts="
                f"{self.num_experts} (each token picks top_k distinct experts)."
            )
        check_choice("score_func", self.score_func, SCORE_FUNCS)
        check_bool("route_norm", self.route_norm)
        check_number("route_scale", self.route_scale, low=0, low_open=True)
        self._check_groups()
        if self.load_balance_coeff is not None:
            check_number(
                "load_balance_coeff",
                self.load_balance_coeff,
                low=0,
                low_open=True,
                hint="None turns the load-balancing bias off",
            )
        check_number("aux_loss_alpha", self.aux_loss_alpha, low=0, hint="0 turns it off")
        check_bool("use_grouped_mm", self.use_grouped_mm)

    def _check_groups(self) -> None:
        check_int("n_expert_groups", self.n_expert_groups, minimum=1)
        check_int("n_limited_groups", self.n_limited_groups, minimum=1)
        if self.num_experts % self.n_expert_groups:
            raise ModelConfigError(
                f"n_expert_groups={self.n_expert_groups} is not allowed; it must divide "
                f"num_experts={self.num_experts} (groups are equal slices of the experts)."
            )
        if self.n_limited_groups > self.n_expert_groups:
            raise ModelConfigError(
                f"n_limited_groups={self.n_limited_groups} is not allowed; it must be at most "
                f"n_expert_groups={self.n_expert_groups}."
            )
        if self.n_expert_groups == 1:
            return
        per_group = self.experts_per_group
        if per_group < 2:
            raise ModelConfigError(
                f"n_expert_groups={self.n_expert_groups} is not allowed with num_experts="
                f"{self.num_experts}: a group scores by its two best experts, so it needs at "
                "least 2; use fewer groups."
            )
        if self.top_k > self.n_limited_groups * per_group:
            raise ModelConfigError(
                f"top_k={self.top_k} is not allowed; the n_limited_groups="
                f"{self.n_limited_groups} groups a token may use hold only "
                f"{self.n_limited_groups * per_group} experts; raise n_limited_groups or "
                "lower top_k."
            )

    @property
    def experts_per_group(self) -> int:
        """Experts in each routing group."""
        return self.num_experts // self.n_expert_groups
