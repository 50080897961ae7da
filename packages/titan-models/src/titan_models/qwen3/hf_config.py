"""Qwen3 args to and from a Hugging Face ``config.json`` (``Qwen3ForCausalLM``, or
``Qwen3MoeForCausalLM`` with experts).

Fields map one to one. What titan's Qwen3 cannot express is refused in one
``ModelConfigError`` naming each field: another architecture, RoPE scaling, sliding-window
attention, attention biases, an activation other than SiLU. ``load_balance_coeff`` has no HF
counterpart; a config read from HF gets torchtitan's default."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titan_models.errors import ModelConfigError
from titan_models.qwen3.args import Qwen3Args

__all__ = ["HF_ARCHITECTURES", "args_from_hf_config", "hf_config_of"]

HF_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}
"""The HF classes (and their ``model_type``) the adapter reads and writes."""


def hf_config_of(args: Qwen3Args) -> dict[str, Any]:
    """The ``config.json`` of the ``Qwen3ForCausalLM`` (or, with MoE blocks,
    ``Qwen3MoeForCausalLM``) equivalent to ``args``."""
    a = args
    config: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if a.moe_enabled else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if a.moe_enabled else "qwen3",
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "intermediate_size": a.hidden_dim,
        "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": a.enable_weight_tying,
        "torch_dtype": "bfloat16",
    }
    if a.moe_enabled:
        config |= {
            "moe_intermediate_size": a.moe_inter_dim,
            "num_experts": a.num_experts,
            "num_experts_per_tok": a.top_k,
            "norm_topk_prob": a.route_norm,
            "decoder_sparse_step": a.decoder_sparse_step,
            "mlp_only_layers": list(a.mlp_only_layers),
            "output_router_logits": False,
        }
    return config


def _unsupported(hf_config: Mapping[str, Any]) -> list[str]:
    """What in ``hf_config`` titan's Qwen3 cannot express, one phrase each."""
    problems = []
    architectures = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if model_type not in (None, *HF_ARCHITECTURES.values()) or any(
        name not in HF_ARCHITECTURES for name in architectures
    ):
        problems.append(
            f"architectures={architectures} (model_type={model_type!r}) is not "
            f"{' or '.join(HF_ARCHITECTURES)}"
        )
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        problems.append(f"RoPE type {kind!r} (titan's Qwen3 has plain RoPE only)")
    if hf_config.get("use_sliding_window"):
        problems.append("use_sliding_window=true (titan's Qwen3 attends to the whole sequence)")
    if hf_config.get("attention_bias"):
        problems.append("attention_bias=true (titan's Qwen3 projections have no bias)")
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config['hidden_act']!r} (titan's Qwen3: 'silu')")
    return problems


def args_from_hf_config(hf_config: Mapping[str, Any]) -> Qwen3Args:
    """``Qwen3Args`` for a ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` ``config.json``.
    ``max_seq_len`` is ``max_position_embeddings``; a trainer sets its own."""
    problems = _unsupported(hf_config)
    if problems:
        raise ModelConfigError(
            f"This HF config cannot be loaded as titan's Qwen3: {'; '.join(problems)}. Use the "
            "model family it belongs to (e.g. --model.name llama3 for LlamaForCausalLM)."
        )
    try:
        heads = hf_config["num_attention_heads"]
        dim = hf_config["hidden_size"]
        rope = hf_config.get("rope_parameters") or {}
        # transformers 5 writes num_experts as num_local_experts (its attribute map).
        experts = hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0
        moe = hf_config.get("model_type") == "qwen3_moe" or "Qwen3MoeForCausalLM" in (
            hf_config.get("architectures") or []
        )
        fields = {
            "vocab_size": hf_config["vocab_size"],
            "dim": dim,
            "n_layers": hf_config["num_hidden_layers"],
            "n_heads": heads,
            "n_kv_heads": hf_config.get("num_key_value_heads") or heads,
            "head_dim": hf_config.get("head_dim") or dim // heads,
            "hidden_dim": hf_config["intermediate_size"],
            "norm_eps": hf_config.get("rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", hf_config.get("rope_theta", 1_000_000.0)),
            "max_seq_len": hf_config.get("max_position_embeddings", 40960),
            "enable_weight_tying": bool(hf_config.get("tie_word_embeddings", False)),
            "moe_enabled": moe and experts > 0,
        }
        if fields["moe_enabled"]:
            fields |= {
                "moe_inter_dim": hf_config["moe_intermediate_size"],
                "num_experts": experts,
                "top_k": hf_config["num_experts_per_tok"],
                "route_norm": bool(hf_config.get("norm_topk_prob", False)),
                "decoder_sparse_step": hf_config.get("decoder_sparse_step") or 1,
                "mlp_only_layers": tuple(hf_config.get("mlp_only_layers") or ()),
            }
    except KeyError as missing:
        raise ModelConfigError(f"The HF config has no {missing}; is it a Qwen3 config?") from None
    return Qwen3Args(**fields)


def differences(a: Qwen3Args, b: Qwen3Args, *, vocab: bool) -> list[str]:
    """The architecture fields in which ``a`` and ``b`` differ, as ``name: a vs b``
    (``vocab``: the vocabulary too). Training settings (``max_seq_len``, ``depth_init``,
    ``load_balance_coeff``, ``aux_loss_alpha``, ``use_grouped_mm``) are not the
    architecture."""
    skip = {"max_seq_len", "depth_init", "load_balance_coeff", "aux_loss_alpha", "use_grouped_mm"}
    if not vocab:
        skip.add("vocab_size")
    if not (a.moe_enabled or b.moe_enabled):  # MoE fields configure nothing in a dense model
        skip |= {"moe_inter_dim", "num_experts", "top_k", "route_norm"}
        skip |= {"decoder_sparse_step", "mlp_only_layers"}
    return [
        f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}"
        for f in dataclasses.fields(Qwen3Args)
        if f.name not in skip and getattr(a, f.name) != getattr(b, f.name)
    ]
