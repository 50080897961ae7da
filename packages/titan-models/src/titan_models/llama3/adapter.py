"""Convert Llama 3 state dicts between titan (= torchtitan = Meta) and Hugging Face naming.

Names differ (``layers.3.attention.wq.weight`` is HF's
``model.layers.3.self_attn.q_proj.weight``), and so does the order of query and key rows:
titan's RoPE rotates adjacent pairs of each head, HF's the two halves, so ``wq``/``wk`` rows
are permuted within every head. For that the adapter needs the head counts, from recorded
args, a flavor or an HF ``config.json``, checked against the checkpoint's tensors when given
(``titan_models.llama3.fit``), so the ``config.json`` it writes loads with them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from titan_models.errors import ModelConfigError
from titan_models.hf_adapter import (
    HF_LAYER,
    TITAN_LAYER,
    TOP_NAMES,
    StateDictAdapter,
    claims_of,
    recorded_args,
    refuse_changes,
)
from titan_models.llama3.args import Llama3Args, llama3_args, rope_scaling_of
from titan_models.llama3.fit import Claim, fit_to_tensors
from titan_models.spec import check_fields

__all__ = ["Llama3StateDictAdapter", "make_adapter"]

# titan name pattern -> HF name pattern; {} is the layer index.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def _to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head from interleaved pairs (titan) to the two-halves order (HF)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`_to_half_split`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


class Llama3StateDictAdapter(StateDictAdapter):
    """Maps full (unsharded) Llama 3 state dicts to and from ``LlamaForCausalLM`` naming."""

    args: Llama3Args

    def to_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """titan ``(key, tensor)`` pairs -> HF's, one at a time. Unknown keys raise
        ``KeyError``."""
        heads = {"wq": self.args.n_heads, "wk": self.args.kv_heads}
        for key, value in items:
            if key in TOP_NAMES:
                yield TOP_NAMES[key], value
                del value
                continue
            match = TITAN_LAYER.match(key)
            if match is None or match.group(2) not in _LAYER_NAMES:
                raise KeyError(f"{key!r} is not a Llama 3 parameter name.")
            layer, rest = match.groups()
            proj = rest.split(".")[1]
            if proj in heads:
                value = _to_half_split(value, heads[proj])
            yield f"model.layers.{layer}.{_LAYER_NAMES[rest]}", value
            del value  # hold nothing while the next input is read

    def from_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF ``(key, tensor)`` pairs -> titan's, one at a time; rotary ``inv_freq`` buffers
        are dropped. With tied embeddings (no ``lm_head.weight``, e.g. Llama 3.2 1B/3B) the
        embedding is yielded again as ``output.weight`` at the end of the stream; until
        ``lm_head.weight`` has been seen, the embedding is kept for that (HF names sort
        ``lm_head`` first, so a stream in key order keeps nothing)."""
        heads = {"q_proj": self.args.n_heads, "k_proj": self.args.kv_heads}
        top = {hf: titan for titan, hf in TOP_NAMES.items()}
        layer_names = {hf: titan for titan, hf in _LAYER_NAMES.items()}
        embedding: torch.Tensor | None = None
        has_output = False
        for key, value in items:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key in top:
                name = top[key]
                if name == "output.weight":
                    has_output, embedding = True, None
                elif name == "tok_embeddings.weight" and not has_output:
                    embedding = value
                yield name, value
                del value
                continue
            match = HF_LAYER.match(key)
            if match is None or match.group(2) not in layer_names:
                raise KeyError(f"{key!r} is not a LlamaForCausalLM parameter name.")
            layer, rest = match.groups()
            proj = rest.split(".")[1]
            if proj in heads:
                value = _to_interleaved(value, heads[proj])
            yield f"layers.{layer}.{layer_names[rest]}", value
            del value  # hold nothing while the next input is read
        if not has_output and embedding is not None:
            yield "output.weight", embedding

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names and layouts -> titan's. A checkpoint with tied embeddings (no
        ``lm_head.weight``, e.g. Llama 3.2 1B/3B) gets ``output.weight`` as a copy of the
        embedding; rotary ``inv_freq`` buffers are dropped."""
        out = super().from_hf(hf_state_dict)
        tied = out.get("output.weight")
        if tied is not None and tied is out.get("tok_embeddings.weight"):
            out["output.weight"] = tied.clone()
        return out

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``LlamaForCausalLM``."""
        a = self.args
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": _context(a),
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": None,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
        if a.rope_scaling is not None:
            s = a.rope_scaling
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        # transformers 5 reads RoPE from ``rope_parameters`` before ``rope_scaling``: written
        # too, so a base config.json (``--hf-config``) cannot leave a contradicting one behind.
        config["rope_parameters"] = {
            **(config["rope_scaling"] or {"rope_type": "default"}),
            "rope_theta": a.rope_theta,
        }
        return config


_LLAMA31_CONTEXT = 131072
"""The ``max_position_embeddings`` Meta publishes for Llama 3.1 and 3.2 (factor 8 and 32
alike): the context their RoPE scaling serves."""


def _context(args: Llama3Args) -> int:
    """``max_position_embeddings`` of the HF config: the context the model's RoPE serves.

    ``args.max_seq_len`` is the run's sequence length (how far the RoPE table was built),
    not the model's context: with Llama 3.1 scaling the model serves Llama 3.1's 131072
    (or the run's length, or the scaling's original, where longer), and transformers warns
    of a config whose context is not above ``original_max_position_embeddings``. Plain RoPE
    serves what the model was trained on."""
    s = args.rope_scaling
    if s is None:
        return args.max_seq_len
    return max(args.max_seq_len, _LLAMA31_CONTEXT, s.original_max_position_embeddings)


def args_from_hf_config(hf_config: Mapping[str, Any]) -> Llama3Args:
    """``Llama3Args`` for a ``LlamaForCausalLM`` ``config.json``. The feed-forward size is
    taken as given (``multiple_of`` = intermediate_size, no multiplier). RoPE scaling is read
    from ``rope_scaling`` (null: plain RoPE) or, as transformers 5 writes it,
    ``rope_parameters``."""
    try:
        dim = hf_config["hidden_size"]
        n_heads = hf_config["num_attention_heads"]
        rope = hf_config.get("rope_parameters") or {}
        scaling = hf_config.get("rope_scaling") or rope or None
        theta = hf_config.get("rope_theta", rope.get("rope_theta", 500000.0))
        if hf_config.get("head_dim", dim // n_heads) != dim // n_heads:
            raise ModelConfigError(
                f"head_dim={hf_config['head_dim']} differs from hidden_size / "
                f"num_attention_heads = {dim // n_heads}; titan's Llama 3 needs them equal."
            )
        args = Llama3Args(
            dim=dim,
            n_layers=hf_config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=hf_config.get("num_key_value_heads", n_heads),
            vocab_size=hf_config["vocab_size"],
            multiple_of=hf_config["intermediate_size"],
            ffn_dim_multiplier=None,
            norm_eps=hf_config.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=rope_scaling_of(scaling, None),
            max_seq_len=hf_config.get("max_position_embeddings", 131072),
        )
    except KeyError as missing:
        raise ModelConfigError(f"The HF config has no {missing}; is it a Llama config?") from None
    if args.hidden_dim != hf_config["intermediate_size"]:
        # multiple_of=intermediate_size rounds 8/3 x dim up to it only if it is larger.
        raise ModelConfigError(
            f"intermediate_size={hf_config['intermediate_size']} is smaller than 8/3 x "
            f"hidden_size; titan's Llama 3 cannot express it."
        )
    return args


def make_adapter(
    *,
    flavor: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
    model_args: Llama3Args | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    tensor_shapes: Mapping[str, Sequence[int]] | None = None,
) -> Llama3StateDictAdapter:
    """The ``titan.state_dict_adapters`` entry point: an adapter for the model described by
    ``model_args`` (the real args, e.g. recorded with a checkpoint), a ``flavor`` or an HF
    ``config.json`` (not both); ``rope_scaling`` overrides by name too (``rope_scaling_of``).
    ``overrides`` replaces fields (refused where it changes recorded args). ``tensor_shapes``
    (titan names -> shapes) are the checkpoint's: each description must agree with them, field
    by field, and the vocabulary is taken from them."""
    claims = [
        Claim(*claim)
        for claim in claims_of(
            flavor=flavor,
            hf_config=hf_config,
            model_args=model_args,
            recorded=lambda recorded: _fresh(recorded_args(Llama3Args, recorded)),
            from_hf=args_from_hf_config,
            from_flavor=llama3_args,
            example="flavor= (e.g. '8B') or hf_config= (a LlamaForCausalLM config.json as a dict)",
        )
    ]
    args = claims[0].args
    if tensor_shapes is not None:
        args = fit_to_tensors(claims, tensor_shapes)
    if overrides:
        check_fields(Llama3Args, overrides)
        values = dict(overrides)
        if "rope_scaling" in values:
            values["rope_scaling"] = rope_scaling_of(values["rope_scaling"], args.rope_scaling)
        if model_args is not None:
            refuse_changes(args, values)
        args = dataclasses.replace(args, **values)
    return Llama3StateDictAdapter(args)


def _fresh(args: Llama3Args) -> Llama3Args:
    """``args`` with a RopeScaling of its own."""
    return dataclasses.replace(args, rope_scaling=rope_scaling_of(args.rope_scaling, None))
