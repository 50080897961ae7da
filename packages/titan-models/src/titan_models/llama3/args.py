"""``Llama3Args``: the shape of a Llama 3 model, its published flavors, and what it costs.

Field names follow torchtitan's ``TransformerModelArgs`` so that its flavors and TOML files
carry over (Llama 3.1 8B/70B/405B, Llama 3.2 1B/3B with untied output weights, a tiny
``debugmodel``). Every flavor applies Llama 3.1 RoPE scaling, as torchtitan's current
flavors do; ``rope_scaling="none"`` selects its July 2025 plain RoPE."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from titan_models.errors import ModelConfigError, check_int, check_number
from titan_models.spec import flavor_args

__all__ = [
    "LLAMA3_FLAVORS",
    "ROPE_SCALING_CHOICES",
    "Llama3Args",
    "RopeScaling",
    "llama3_args",
    "rope_scaling_of",
]

ROPE_SCALING_CHOICES = ("flavor", "none", "llama3")
"""What ``rope_scaling`` may be named by: the flavor's default, plain RoPE, or Llama 3.1
scaling (the flavor's factors, or ``RopeScaling()``'s when the flavor has none)."""


@dataclass(kw_only=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling, which stretches the low frequencies so that a model
    trained on ``original_max_position_embeddings`` tokens works on longer contexts."""

    factor: float = 8.0
    """How much the lowest frequencies are divided by."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor are fully scaled."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """The context length the unscaled frequencies were trained for."""

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_number(f"rope_scaling.{name}", getattr(self, name), low=0, low_open=True)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ModelConfigError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must be greater than "
                f"rope_scaling.low_freq_factor={self.low_freq_factor}."
            )
        check_int(
            "rope_scaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
            minimum=1,
        )


def rope_scaling_of(value: object, default: RopeScaling | None) -> RopeScaling | None:
    """The ``RopeScaling`` (or ``None``: plain RoPE) that ``value`` names, as a fresh copy:
    a ``RopeScaling`` or ``None``; a name of ``ROPE_SCALING_CHOICES`` (``"flavor"``: ``default``;
    ``"llama3"``: ``default`` or else ``RopeScaling()``); or a mapping of its fields (a TOML
    table, recorded args, HF's ``rope_scaling`` with ``"rope_type": "llama3"``, ``"default"``
    meaning plain RoPE)."""
    if value is None:
        return None
    if isinstance(value, RopeScaling):
        return dataclasses.replace(value)
    if isinstance(value, str):
        if value not in ROPE_SCALING_CHOICES:
            raise ModelConfigError(
                f"rope_scaling={value!r} is not allowed; choose one of "
                f"{', '.join(map(repr, ROPE_SCALING_CHOICES))} (the flavor's default, plain "
                "RoPE, Llama 3.1 frequency scaling)."
            )
        if value == "none" or (value == "flavor" and default is None):
            return None
        return dataclasses.replace(default) if default is not None else RopeScaling()
    if isinstance(value, Mapping):
        fields = dict(value)
        # HF writes "rope_type"; configs of older transformers versions say "type".
        rope_type = fields.pop("rope_type", None) or fields.pop("type", None) or "llama3"
        fields.pop("rope_theta", None)  # transformers 5 keeps the base here too
        if rope_type == "default":
            return None
        if rope_type != "llama3":
            raise ModelConfigError(
                f"rope_scaling of type {rope_type!r} is not supported by titan's Llama 3; it "
                "knows plain RoPE and 'llama3' (Llama 3.1 frequency scaling)."
            )
        known = {f.name for f in dataclasses.fields(RopeScaling)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ModelConfigError(
                f"Unknown rope_scaling field(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}."
            )
        return RopeScaling(**fields)
    raise ModelConfigError(
        f"rope_scaling={value!r} is not allowed; give one of "
        f"{', '.join(map(repr, ROPE_SCALING_CHOICES))}, a table of RopeScaling fields, or None."
    )


@dataclass(kw_only=True)
class Llama3Args:
    """The hyperparameters of a Llama 3 decoder; everything else (hidden sizes, parameter
    count, FLOPs) is derived from them."""

    dim: int = 4096
    """Width of the residual stream (hidden size)."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads per attention layer; dim must divide by it."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); ``None`` means n_heads. Must divide n_heads."""
    vocab_size: int = 128256
    """Rows of the embedding and output matrices: set it from the tokenizer."""
    multiple_of: int = 256
    """The feed-forward hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the feed-forward hidden size (8/3 x dim before scaling and rounding)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500000.0
    """Base of the rotary position embedding's frequencies."""
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    """Llama 3.1 frequency scaling; ``None`` for plain RoPE (torchtitan's Llama 3 before its
    models scaled, e.g. July 2025). Also accepts what :func:`rope_scaling_of` reads."""
    max_seq_len: int = 131072
    """Longest sequence the RoPE table covers; set it to the training sequence length."""
    depth_init: bool = True
    """Scale each block's output-projection init by its depth (else by the layer count)."""

    def __post_init__(self) -> None:
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            # A TOML table, recorded args or an HF config arrive as a dict; a name as a str.
            self.rope_scaling = rope_scaling_of(self.rope_scaling, RopeScaling())
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
            check_int(name, getattr(self, name), minimum=1)
        if self.n_kv_heads is not None:
            check_int("n_kv_heads", self.n_kv_heads, minimum=1)
        if self.dim % self.n_heads:
            raise ModelConfigError(
                f"dim={self.dim} must be divisible by n_heads={self.n_heads} "
                f"(each head gets dim / n_heads channels)."
            )
        if self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.kv_heads} "
                "(grouped-query attention shares each key/value head among a group of queries)."
            )
        if self.head_dim % 2:
            raise ModelConfigError(
                f"dim / n_heads = {self.head_dim} must be even: RoPE rotates channel pairs."
            )
        for name in ("norm_eps", "rope_theta"):
            check_number(name, getattr(self, name), low=0, low_open=True)
        if self.ffn_dim_multiplier is not None:
            check_number(
                "ffn_dim_multiplier", self.ffn_dim_multiplier, low=0, low_open=True, hint="or None"
            )

    # ---------------------------------------------------------------------- derived shapes
    @property
    def kv_heads(self) -> int:
        """Key/value heads, n_heads when n_kv_heads is None."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden size: 2/3 of 4 x dim, times ffn_dim_multiplier, rounded up to a
        multiple of multiple_of (14336 for 8B)."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    # ------------------------------------------------------------------------- accounting
    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters of the model these args build (output weights untied)."""
        d, kv = self.dim, self.kv_heads * self.head_dim
        attention = 2 * d * d + 2 * d * kv
        feed_forward = 3 * d * self.hidden_dim
        block = attention + feed_forward + 2 * d  # two RMSNorm weights
        embedding = self.vocab_size * d
        total = self.n_layers * block + d + 2 * embedding  # final norm, embedding, output
        return total - embedding if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token at ``seq_len``: 6 per matmul weight
        (the embedding lookup is not a matmul) plus the attention scores and their weighted
        sum, 12 x layers x heads x head_dim x seq_len. The same estimate torchtitan and
        the PaLM paper use for MFU, so numbers compare across tools."""
        check_int("seq_len", seq_len, minimum=1, error=ValueError)  # an argument, not a config
        dense = 6 * self.num_params(exclude_embedding=True)
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return dense + attention


_LLAMA32_ROPE = RopeScaling(factor=32.0)

LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, vocab_size=2048, max_seq_len=2048),
    "1B": Llama3Args(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA32_ROPE,
    ),
    "3B": Llama3Args(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
        rope_scaling=_LLAMA32_ROPE,
    ),
    "8B": Llama3Args(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024
    ),
    "70B": Llama3Args(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096
    ),
    "405B": Llama3Args(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
}  # fmt: skip
"""Published Llama 3 shapes by name. Use :func:`llama3_args` to get an editable copy."""


def llama3_args(flavor: str, **overrides: object) -> Llama3Args:
    """A fresh copy of the named flavor with ``overrides`` applied, e.g.
    ``llama3_args("8B", vocab_size=tokenizer.n_words, max_seq_len=8192)``.

    ``rope_scaling`` may be given by name (``ROPE_SCALING_CHOICES``): ``"flavor"`` keeps the
    flavor's, ``"none"`` is plain RoPE, ``"llama3"`` the flavor's factors (or the defaults)."""
    base = LLAMA3_FLAVORS.get(flavor)
    scaling = overrides.pop("rope_scaling", "flavor")
    args = flavor_args("Llama 3", LLAMA3_FLAVORS, flavor, overrides)
    return dataclasses.replace(args, rope_scaling=rope_scaling_of(scaling, base.rope_scaling))
