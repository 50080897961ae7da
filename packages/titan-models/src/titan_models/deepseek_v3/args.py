"""``DeepSeekV3Args``: the shape of a DeepSeek-V3 model, its published flavors, and what it
costs (parameters in total and per token, training FLOPs per token).

Field names follow torchtitan's ``DeepSeekV3ModelArgs`` of July 2025, so its flavors and
TOML files carry over: ``16B`` is DeepSeek-V2-Lite, ``236B`` DeepSeek-V2, ``671B``
DeepSeek-V3. Left out are torchtitan's fields that configure nothing here; added are
``route_norm``, ``aux_loss_alpha`` and ``rope_scaling``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from titan_models.errors import ModelConfigError, check_bool, check_choice, check_int, check_number
from titan_models.moe import MoEArgs
from titan_models.spec import flavor_args

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "DEEPSEEK_V3_ROPE_SCALINGS",
    "DeepSeekV3Args",
    "deepseek_v3_args",
]

DEEPSEEK_V3_ROPE_SCALINGS = ("yarn", "none")
"""``DeepSeekV3Args.rope_scaling``: YaRN when ``max_seq_len > original_seq_len`` (as
DeepSeek-V3), or plain RoPE at any length."""


@dataclass(kw_only=True)
class DeepSeekV3Args:
    """The hyperparameters of a DeepSeek-V3 decoder: multi-head latent attention (MLA) with
    decoupled RoPE, ``n_dense_layers`` dense SwiGLU blocks, then mixture-of-experts blocks."""

    vocab_size: int = 102400
    """Rows of the embedding and output matrices: set it from the tokenizer."""
    dim: int = 2048
    """Width of the residual stream (hidden size)."""
    inter_dim: int = 10944
    """Hidden size of the dense blocks' SwiGLU."""
    moe_inter_dim: int = 1408
    """Hidden size of each routed expert (a shared expert has n_shared_experts times it)."""
    n_layers: int = 27
    """Number of transformer blocks."""
    n_dense_layers: int = 1
    """The first n_dense_layers blocks are dense; the others are MoE blocks."""
    n_heads: int = 16
    """Attention heads."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    n_routed_experts: int = 64
    """Routed experts per MoE block."""
    n_shared_experts: int = 2
    """Shared experts (one SwiGLU of moe_inter_dim x this, seen by every token); 0: none."""
    n_activated_experts: int = 6
    """Routed experts each token is sent to (top-k)."""
    n_expert_groups: int = 1
    """Groups of experts for grouped (node-limited) routing; 1: off."""
    n_limited_groups: int = 1
    """Groups a token may pick its experts from."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """How router logits become scores."""
    route_scale: float = 1.0
    """Multiplies the routing weights."""
    route_norm: bool = False
    """Renormalize each token's top-k weights to sum to 1 (DeepSeek-V3: yes)."""
    use_grouped_mm: bool = True
    """Compute experts with torch's grouped mm where the device has it."""
    load_balance_coeff: float | None = 1e-3
    """Rate of the auxiliary-loss-free expert-bias update; None: no bias."""
    aux_loss_alpha: float = 0.0
    """Weight of the sequence-level auxiliary balance loss; 0: off."""
    q_lora_rank: int = 0
    """Rank of the low-rank query projection; 0: a full-rank ``wq``."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without position information."""
    qk_rope_head_dim: int = 64
    """Per-head query/key channels rotated by RoPE (the key's are shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value channels."""
    max_seq_len: int = 4096 * 4
    """Longest sequence the RoPE table covers; set it to the training sequence length."""
    original_seq_len: int = 4096
    """The context length the model was pretrained for: YaRN applies above it."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding's frequencies."""
    rope_factor: float = 40.0
    """YaRN: how much the lowest frequencies are divided by."""
    beta_fast: int = 32
    """YaRN: frequencies rotating more than this often in original_seq_len are kept."""
    beta_slow: int = 1
    """YaRN: frequencies rotating fewer times than this are fully divided by rope_factor."""
    mscale: float = 1.0
    """YaRN: the softmax scale is multiplied by (0.1 mscale ln(rope_factor) + 1)^2."""
    rope_scaling: Literal["yarn", "none"] = "yarn"
    """``"yarn"``: YaRN when max_seq_len > original_seq_len (DeepSeek-V3's rule); ``"none"``:
    plain RoPE and the plain softmax scale at any length."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_heads")
        positive += ("n_routed_experts", "n_activated_experts", "n_expert_groups")
        positive += ("n_limited_groups", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
        for name in (*positive, "max_seq_len", "original_seq_len", "beta_fast", "beta_slow"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("n_dense_layers", "n_shared_experts", "q_lora_rank", "qk_nope_head_dim"):
            check_int(name, getattr(self, name), minimum=0)
        if self.n_dense_layers > self.n_layers:
            raise ModelConfigError(
                f"n_dense_layers={self.n_dense_layers} is more than n_layers={self.n_layers}; "
                "set it to at most n_layers (n_layers: a dense model)."
            )
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(
                f"qk_rope_head_dim={self.qk_rope_head_dim} must be even: RoPE rotates pairs."
            )
        for name in ("norm_eps", "rope_theta", "route_scale", "mscale"):
            check_number(name, getattr(self, name), low=0, low_open=True)
        check_number("rope_factor", self.rope_factor, low=1)
        check_number("aux_loss_alpha", self.aux_loss_alpha, low=0)
        if self.load_balance_coeff is not None:
            check_number(
                "load_balance_coeff", self.load_balance_coeff, low=0, low_open=True, hint="or None"
            )
        check_choice("score_func", self.score_func, ("softmax", "sigmoid"))
        check_choice("rope_scaling", self.rope_scaling, DEEPSEEK_V3_ROPE_SCALINGS)
        check_bool("route_norm", self.route_norm)
        check_bool("use_grouped_mm", self.use_grouped_mm)
        self._check_routing()

    def _check_routing(self) -> None:
        if self.n_activated_experts > self.n_routed_experts:
            raise ModelConfigError(
                f"n_activated_experts={self.n_activated_experts} is more than "
                f"n_routed_experts={self.n_routed_experts}; a token picks at most every expert."
            )
        if self.n_routed_experts % self.n_expert_groups:
            raise ModelConfigError(
                f"n_routed_experts={self.n_routed_experts} must be divisible by "
                f"n_expert_groups={self.n_expert_groups} (groups of equal size)."
            )
        if self.n_limited_groups > self.n_expert_groups:
            raise ModelConfigError(
                f"n_limited_groups={self.n_limited_groups} is more than "
                f"n_expert_groups={self.n_expert_groups}; set it to at most that."
            )
        per_group = self.n_routed_experts // self.n_expert_groups
        if self.n_limited_groups * per_group < self.n_activated_experts:
            raise ModelConfigError(
                f"n_limited_groups={self.n_limited_groups} groups of {per_group} experts hold "
                f"fewer than n_activated_experts={self.n_activated_experts}; raise "
                "n_limited_groups or lower n_activated_experts."
            )

    # ---------------------------------------------------------------------- derived shapes
    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key channels: qk_nope_head_dim + qk_rope_head_dim (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn(self) -> bool:
        """Whether RoPE is YaRN-scaled: ``rope_scaling="yarn"`` and max_seq_len above
        original_seq_len."""
        return self.rope_scaling == "yarn" and self.max_seq_len > self.original_seq_len

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale: qk_head_dim^-1/2, times mscale(rope_factor)^2 under
        YaRN, where mscale(s) = 0.1 mscale ln(s) + 1 (DeepSeek-V3's YaRN attention factor)."""
        scale = self.qk_head_dim**-0.5
        if self.yarn:
            factor = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            scale *= factor * factor
        return scale

    def moe_args(self) -> MoEArgs:
        """The MoE blocks' routing and expert settings, as :class:`titan_models.moe.MoEArgs`."""
        return MoEArgs(
            num_experts=self.n_routed_experts,
            num_shared_experts=self.n_shared_experts,
            top_k=self.n_activated_experts,
            score_func=self.score_func,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            n_expert_groups=self.n_expert_groups,
            n_limited_groups=self.n_limited_groups,
            load_balance_coeff=self.load_balance_coeff,
            aux_loss_alpha=self.aux_loss_alpha,
            use_grouped_mm=self.use_grouped_mm,
        )

    # ------------------------------------------------------------------------- accounting
    def _attention_params(self) -> int:
        d, h = self.dim, self.n_heads
        if self.q_lora_rank == 0:
            q = d * h * self.qk_head_dim
        else:  # wq_a, q_norm, wq_b
            q = d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        kv = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # wkv_a, norm
        kv += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)  # wkv_b
        return q + kv + h * self.v_head_dim * d  # wo

    def _count(self, *, experts_per_token: int | None, exclude_embedding: bool) -> int:
        """Parameters, with every routed expert (``experts_per_token=None``) or only that
        many per MoE block."""
        d = self.dim
        n_moe = self.n_layers - self.n_dense_layers
        expert = 3 * d * self.moe_inter_dim
        routed = self.n_routed_experts if experts_per_token is None else experts_per_token
        moe = d * self.n_routed_experts + routed * expert + self.n_shared_experts * expert
        blocks = self.n_layers * (self._attention_params() + 2 * d)  # + two RMSNorm weights
        blocks += self.n_dense_layers * 3 * d * self.inter_dim + n_moe * moe
        embedding = self.vocab_size * d
        total = blocks + d + 2 * embedding  # final norm, embedding, output (untied)
        return total - embedding if exclude_embedding else total

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters of the model these args build (every expert; output weights untied;
        buffers are not parameters)."""
        return self._count(experts_per_token=None, exclude_embedding=exclude_embedding)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters one token uses: as :meth:`num_params`, with only the top-k routed
        experts of each MoE block (shared experts and the router gate count in full)."""
        return self._count(
            experts_per_token=self.n_activated_experts, exclude_embedding=exclude_embedding
        )

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``, counting only the
        experts a token uses: ``6 x num_active_params(exclude_embedding=True)`` (2 per
        multiply-add, x3 for forward and backward; the embedding lookup is not a matmul)
        plus attention's two matmuls, ``6 x n_layers x n_heads x (qk_head_dim + v_head_dim)
        x seq_len`` (q.k over qk_head_dim and p.v over v_head_dim channels; no discount for
        the causal mask). With equal head dims this is Llama's ``12 x layers x heads x
        head_dim x seq_len``; torchtitan's July 2025 count used dim / n_heads for both."""
        check_int("seq_len", seq_len, minimum=1, error=ValueError)  # an argument, not a config
        dense = 6 * self.num_active_params(exclude_embedding=True)
        heads = self.n_heads * (self.qk_head_dim + self.v_head_dim)
        return dense + 6 * self.n_layers * heads * seq_len


# Fields not given are the defaults: DeepSeek-V2-Lite's (16B) but for its mscale; every
# flavor has kv_lora_rank 512 and head dims 128 (nope), 64 (rope), 128 (v).
DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": DeepSeekV3Args(
        dim=256, inter_dim=1024, moe_inter_dim=256, n_layers=3, n_routed_experts=8,
        n_activated_experts=3, mscale=0.70,
    ),
    "16B": DeepSeekV3Args(mscale=0.70),  # DeepSeek-V2-Lite
    "236B": DeepSeekV3Args(  # DeepSeek-V2
        dim=5120, inter_dim=12288, moe_inter_dim=1536, n_layers=60, n_heads=128,
        n_routed_experts=160, n_expert_groups=8, n_limited_groups=3, route_scale=16.0,
        q_lora_rank=1536,
    ),
    # DeepSeek-V3 (its multi-token-prediction module is not part of the model).
    "671B": DeepSeekV3Args(
        vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=61,
        n_dense_layers=3, n_heads=128, n_routed_experts=256, n_shared_experts=1,
        n_activated_experts=8, n_expert_groups=8, n_limited_groups=4, route_scale=2.5,
        route_norm=True, score_func="sigmoid", q_lora_rank=1536,
    ),
}  # fmt: skip
"""Published DeepSeek shapes by name (torchtitan's flavors; ``671B`` also normalizes its
top-k weights, as DeepSeek-V3 does). Use :func:`deepseek_v3_args` for an editable copy."""


def deepseek_v3_args(flavor: str, **overrides: object) -> DeepSeekV3Args:
    """A fresh copy of the named flavor with ``overrides`` applied, e.g.
    ``deepseek_v3_args("16B", vocab_size=tokenizer.n_words, max_seq_len=4096)``.

    ``rope_scaling`` may also be ``"flavor"`` (keep the flavor's). ``"llama3"`` (Llama 3.1
    frequency scaling, which a trainer may pass for any model) is refused: DeepSeek-V3
    scales RoPE with YaRN."""
    scaling = overrides.pop("rope_scaling", "flavor")
    if scaling == "llama3":
        raise ModelConfigError(
            "rope_scaling='llama3' (Llama 3.1 frequency scaling) does not apply to DeepSeek-V3, "
            "which scales RoPE with YaRN above original_seq_len; choose 'flavor' or 'yarn' "
            "(YaRN, the default) or 'none' (plain RoPE at any length)."
        )
    if scaling != "flavor":
        overrides["rope_scaling"] = scaling
    return flavor_args("DeepSeek-V3", DEEPSEEK_V3_FLAVORS, flavor, overrides)
