"""``Qwen3Args``: the shape of a Qwen3 model (dense or mixture of experts), its published
flavors, and what it costs (parameters in total and per token, training FLOPs per token).

Field names follow torchtitan's ``Qwen3ModelArgs`` (October 2025), so its flavors carry
over; :meth:`Qwen3Args.moe_args` maps the flat routing fields onto
:class:`titan_models.moe.MoEArgs`. The flavors are the Qwen3 release's ``config.json``
shapes; ``debugmodel`` is torchtitan's, ``debugmodel_moe`` has 8 experts (torchtitan's 64),
so that it trains on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

from titan_models.errors import ModelConfigError, check_bool, check_int, check_number
from titan_models.moe import MoEArgs
from titan_models.spec import flavor_args

__all__ = ["QWEN3_FLAVORS", "QWEN3_ROPE_SCALINGS", "Qwen3Args", "qwen3_args"]

QWEN3_ROPE_SCALINGS = ("flavor", "none")
"""What ``qwen3_args(..., rope_scaling=...)`` accepts: Qwen3 uses plain RoPE, so both mean
the same; a trainer passes the name only when its user set one."""


@dataclass(kw_only=True)
class Qwen3Args:
    """The hyperparameters of a Qwen3 decoder: grouped-query attention with RMSNorm on each
    query and key head (QK-norm), plain RoPE, and SwiGLU feed-forward or mixture-of-experts
    blocks."""

    dim: int = 1024
    """Width of the residual stream (hidden size)."""
    n_layers: int = 28
    """Number of transformer blocks."""
    n_heads: int = 16
    """Query heads per attention layer."""
    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention); must divide n_heads."""
    head_dim: int = 128
    """Channels per head. Qwen3 sets it explicitly: n_heads x head_dim need not be dim."""
    hidden_dim: int = 3072
    """Hidden size of the dense blocks' SwiGLU."""
    vocab_size: int = 151936
    """Rows of the embedding and output matrices: set it from the tokenizer."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (the QK-norms' included)."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding's frequencies."""
    max_seq_len: int = 40960
    """Longest sequence the RoPE table covers; set it to the training sequence length."""
    enable_weight_tying: bool = False
    """One matrix for the token embedding and the output projection (the small flavors)."""
    depth_init: bool = True
    """Scale each block's output-projection init by its depth (else by the layer count)."""
    moe_enabled: bool = False
    """Mixture-of-experts blocks (Qwen3-MoE) in place of the dense SwiGLU."""
    moe_inter_dim: int = 768
    """Hidden size of each expert."""
    num_experts: int = 128
    """Routed experts per MoE block (Qwen3-MoE has no shared expert)."""
    top_k: int = 8
    """Experts each token is sent to."""
    route_norm: bool = True
    """Renormalize each token's top-k softmax weights to sum to 1 (HF's norm_topk_prob)."""
    decoder_sparse_step: int = 1
    """With moe_enabled, block i is an MoE block when (i + 1) % decoder_sparse_step == 0
    (and i is not in mlp_only_layers); 1: every block."""
    mlp_only_layers: tuple[int, ...] = ()
    """Blocks that stay dense in an MoE model (HF's mlp_only_layers)."""
    load_balance_coeff: float | None = 1e-3
    """Rate of the auxiliary-loss-free expert-bias update (DeepSeek-V3's balancing, torchtitan's
    default for Qwen3 too, so its checkpoints load whole); None: no bias, as the published
    Qwen3-MoE routes. Hugging Face's Qwen3-MoE has no place for the bias: a model trained
    with one exports to a model that routes some tokens differently (the adapter warns)."""
    aux_loss_alpha: float = 0.0
    """Weight of the sequence-wise auxiliary balance loss (``titan_models.moe``); 0: none."""
    use_grouped_mm: bool = True
    """Compute experts with torch's grouped mm where the device has it."""

    def __post_init__(self) -> None:
        if isinstance(self.mlp_only_layers, list):  # recorded args come back from JSON
            self.mlp_only_layers = tuple(self.mlp_only_layers)
        positive = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim")
        positive += ("vocab_size", "max_seq_len", "moe_inter_dim", "num_experts", "top_k")
        for name in (*positive, "decoder_sparse_step"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("norm_eps", "rope_theta"):
            check_number(name, getattr(self, name), low=0, low_open=True)
        for name in ("enable_weight_tying", "depth_init", "moe_enabled", "route_norm"):
            check_bool(name, getattr(self, name))
        check_bool("use_grouped_mm", self.use_grouped_mm)
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads} "
                "(grouped-query attention shares each key/value head among a group of queries)."
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs.")
        if self.top_k > self.num_experts:
            raise ModelConfigError(
                f"top_k={self.top_k} is more than num_experts={self.num_experts}; a token picks "
                "at most every expert."
            )
        if not isinstance(self.mlp_only_layers, tuple) or any(
            not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.n_layers
            for i in self.mlp_only_layers
        ):
            raise ModelConfigError(
                f"mlp_only_layers={self.mlp_only_layers!r} is not allowed; it must be block "
                f"indices in [0, {self.n_layers})."
            )
        if self.load_balance_coeff is not None:
            check_number(
                "load_balance_coeff", self.load_balance_coeff, low=0, low_open=True, hint="or None"
            )
        check_number("aux_loss_alpha", self.aux_loss_alpha, low=0)

    # ---------------------------------------------------------------------- derived shapes
    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block ``layer_id`` is a mixture-of-experts block (HF's rule)."""
        return (
            self.moe_enabled
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    @property
    def n_moe_layers(self) -> int:
        """How many blocks are MoE blocks."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def moe_args(self) -> MoEArgs:
        """The MoE blocks' routing, as :class:`titan_models.moe.MoEArgs`: softmax scores,
        top-k, renormalized weights, no shared expert; the bias and the auxiliary loss as set."""
        return MoEArgs(
            num_experts=self.num_experts,
            num_shared_experts=0,
            top_k=self.top_k,
            score_func="softmax",
            route_norm=self.route_norm,
            route_scale=1.0,
            load_balance_coeff=self.load_balance_coeff,
            aux_loss_alpha=self.aux_loss_alpha,
            use_grouped_mm=self.use_grouped_mm,
        )

    # ------------------------------------------------------------------------- accounting
    def _count(self, *, experts_per_token: int | None, exclude_embedding: bool) -> int:
        d, hd = self.dim, self.head_dim
        attention = 2 * d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + 2 * hd  # + QK-norms
        dense = 3 * d * self.hidden_dim
        experts = self.num_experts if experts_per_token is None else experts_per_token
        moe = d * self.num_experts + experts * 3 * d * self.moe_inter_dim  # router + experts
        n_moe = self.n_moe_layers
        blocks = self.n_layers * (attention + 2 * d) + n_moe * moe + (self.n_layers - n_moe) * dense
        embedding = self.vocab_size * d
        total = blocks + d + embedding * (1 if self.enable_weight_tying else 2)
        return total - embedding if exclude_embedding else total

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters of the model these args build, a tied embedding counted once
        (``exclude_embedding``: without the vocab x dim embedding table; for a tied model
        that is the output matrix too)."""
        return self._count(experts_per_token=None, exclude_embedding=exclude_embedding)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters one token uses: as :meth:`num_params`, with only ``top_k`` experts of
        each MoE block (the router counts in full). A dense model: :meth:`num_params`."""
        return self._count(experts_per_token=self.top_k, exclude_embedding=exclude_embedding)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``: 6 per matmul weight a
        token uses (the active experts only; the output projection always, tied or not; the
        embedding lookup is not a matmul) plus the attention scores and their weighted sum,
        ``12 x n_layers x n_heads x head_dim x seq_len``, torchtitan's count."""
        check_int("seq_len", seq_len, minimum=1, error=ValueError)  # an argument, not a config
        matmul = self.num_active_params(exclude_embedding=True)
        if self.enable_weight_tying:
            matmul += self.vocab_size * self.dim  # the output projection's matmul
        return 6 * matmul + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len


def _dense(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tied: bool) -> Qwen3Args:
    return Qwen3Args(
        dim=dim, n_layers=n_layers, n_heads=n_heads, hidden_dim=hidden_dim,
        enable_weight_tying=tied,
    )  # fmt: skip


_DEBUG = dict(dim=256, n_layers=8, n_heads=16, hidden_dim=3072, vocab_size=2048, max_seq_len=4096)

QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(**_DEBUG, enable_weight_tying=True),
    "debugmodel_moe": Qwen3Args(**_DEBUG, moe_enabled=True, num_experts=8, top_k=2),
    "0.6B": _dense(1024, 28, 16, 3072, tied=True),
    "1.7B": _dense(2048, 28, 16, 6144, tied=True),
    "4B": _dense(2560, 36, 32, 9728, tied=True),
    "8B": _dense(4096, 36, 32, 12288, tied=False),
    "14B": _dense(5120, 40, 40, 17408, tied=False),
    "32B": _dense(5120, 64, 64, 25600, tied=False),
    "30B-A3B": Qwen3Args(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, hidden_dim=6144, moe_enabled=True,
    ),
    "235B-A22B": Qwen3Args(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, hidden_dim=12288, moe_enabled=True,
        moe_inter_dim=1536,
    ),
}  # fmt: skip
"""Published Qwen3 shapes by name (every one: head_dim 128, RoPE theta 1e6, RMSNorm eps
1e-6, vocabulary 151936, 40960 positions). Use :func:`qwen3_args` for an editable copy."""


def qwen3_args(flavor: str, **overrides: object) -> Qwen3Args:
    """A fresh copy of the named flavor with ``overrides`` applied, e.g.
    ``qwen3_args("8B", vocab_size=tokenizer.n_words, max_seq_len=4096)``.

    ``rope_scaling`` (what a trainer passes when its user names one) may be ``"flavor"`` or
    ``"none"``: Qwen3 uses plain RoPE. ``"llama3"`` is refused."""
    scaling = overrides.pop("rope_scaling", "flavor")
    if scaling not in QWEN3_ROPE_SCALINGS:
        raise ModelConfigError(
            f"rope_scaling={scaling!r} does not apply to Qwen3, which uses plain RoPE "
            "(theta rope_theta, no frequency scaling); choose 'none' or 'flavor' (the same), "
            "or leave model.rope_scaling unset."
        )
    return flavor_args("Qwen3", QWEN3_FLAVORS, flavor, overrides)
