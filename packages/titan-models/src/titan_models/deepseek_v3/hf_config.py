"""DeepSeek-V3 args to and from a Hugging Face ``config.json`` (``DeepseekV3ForCausalLM``).

Fields map one to one except RoPE. titan (as torchtitan and DeepSeek's code) applies YaRN
exactly when ``max_seq_len > original_seq_len``; HF when ``rope_parameters`` (or
``rope_scaling``) says ``"yarn"``, scaling the softmax by ``mscale(factor,
mscale_all_dim)^2`` and the rotated channels by ``mscale(factor, mscale) / mscale(factor,
mscale_all_dim)``. titan's ``mscale`` is HF's ``mscale_all_dim``; both are written equal.

HF's class always scores experts with a sigmoid: a softmax-scored model (debugmodel, 16B,
236B, as DeepSeek-V2) is written with ``"scoring_func": "softmax"``, which DeepSeek's own
modeling code reads and transformers' class ignores."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from titan_models.deepseek_v3.args import DeepSeekV3Args
from titan_models.errors import ModelConfigError

__all__ = ["args_from_hf_config", "hf_config_of"]


def hf_config_of(args: DeepSeekV3Args, *, rope_interleave: bool = True) -> dict[str, Any]:
    """The ``config.json`` of the ``DeepseekV3ForCausalLM`` equivalent to ``args``."""
    a = args
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.yarn:
        rope = {
            "rope_type": "yarn",
            "rope_theta": a.rope_theta,
            "factor": a.rope_factor,
            "original_max_position_embeddings": a.original_seq_len,
            "beta_fast": a.beta_fast,
            "beta_slow": a.beta_slow,
            "mscale": a.mscale,
            "mscale_all_dim": a.mscale,
        }
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": a.vocab_size,
        "hidden_size": a.dim,
        "intermediate_size": a.inter_dim,
        "moe_intermediate_size": a.moe_inter_dim,
        "num_hidden_layers": a.n_layers,
        "first_k_dense_replace": a.n_dense_layers,
        "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_heads,
        "n_routed_experts": a.n_routed_experts,
        "n_shared_experts": a.n_shared_experts,
        "num_experts_per_tok": a.n_activated_experts,
        "n_group": a.n_expert_groups,
        "topk_group": a.n_limited_groups,
        "scoring_func": a.score_func,
        "topk_method": _topk_method(a),
        "norm_topk_prob": a.route_norm,
        "routed_scaling_factor": a.route_scale,
        "q_lora_rank": a.q_lora_rank or None,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim,
        "v_head_dim": a.v_head_dim,
        "max_position_embeddings": a.max_seq_len,
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None if rope["rope_type"] == "default" else dict(rope),
        "rope_parameters": rope,
        "rope_interleave": rope_interleave,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "torch_dtype": "bfloat16",
    }


def _topk_method(args: DeepSeekV3Args) -> str:
    """DeepSeek's name for the routing: bias-corrected grouped selection (V3) or greedy,
    grouped or not (V2)."""
    if args.score_func == "sigmoid":
        return "noaux_tc"
    return "group_limited_greedy" if args.n_expert_groups > 1 else "greedy"


def _rope_fields(hf_config: Mapping[str, Any], max_seq_len: int) -> dict[str, Any]:
    """The RoPE fields of ``DeepSeekV3Args`` for an HF config's ``rope_parameters`` (or
    ``rope_scaling``: older files, ``"type"`` for ``"rope_type"``)."""
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        # Plain RoPE at any length: original_seq_len is only where YaRN would start.
        return {"rope_theta": theta, "rope_scaling": "none", "original_seq_len": max_seq_len}
    if kind != "yarn":
        raise ModelConfigError(
            f"rope type {kind!r} is not supported by titan's DeepSeek-V3; it knows 'default' "
            "(plain RoPE) and 'yarn' (DeepSeek-V3's scaling)."
        )
    original = rope["original_max_position_embeddings"]
    mscale_all = rope.get("mscale_all_dim") or 0
    numerator = rope.get("mscale") or 0
    problems = []
    if max_seq_len <= original:
        problems.append(
            f"max_position_embeddings={max_seq_len} is not above "
            f"original_max_position_embeddings={original} (titan applies YaRN only above it)"
        )
    if not mscale_all or numerator != mscale_all:
        problems.append(
            f"mscale={numerator} and mscale_all_dim={mscale_all} must be equal and nonzero "
            "(titan scales the softmax by one mscale and never the rotated channels)"
        )
    if rope.get("attention_factor") not in (None, 1.0) or rope.get("truncate", True) is not True:
        problems.append("attention_factor and truncate must be left unset")
    if problems:
        raise ModelConfigError(
            f"This HF config's YaRN cannot be expressed by titan's DeepSeek-V3: "
            f"{'; '.join(problems)}."
        )
    return {
        "rope_theta": theta,
        "rope_scaling": "yarn",
        "original_seq_len": original,
        "rope_factor": rope["factor"],
        "beta_fast": rope.get("beta_fast") or 32,
        "beta_slow": rope.get("beta_slow") or 1,
        "mscale": mscale_all,
    }


def args_from_hf_config(hf_config: Mapping[str, Any]) -> DeepSeekV3Args:
    """``DeepSeekV3Args`` for a ``DeepseekV3ForCausalLM`` ``config.json`` (DeepSeek's own
    files included: ``rope_scaling`` and ``scoring_func`` are read). ``max_seq_len`` is
    ``max_position_embeddings``; a trainer sets its own."""
    try:
        heads = hf_config["num_attention_heads"]
        if hf_config.get("num_key_value_heads", heads) != heads:
            raise ModelConfigError(
                f"num_key_value_heads={hf_config['num_key_value_heads']} differs from "
                f"num_attention_heads={heads}; multi-head latent attention has one key/value "
                "head per query head."
            )
        max_seq_len = hf_config.get("max_position_embeddings", 4096)
        fields = {
            "vocab_size": hf_config["vocab_size"],
            "dim": hf_config["hidden_size"],
            "inter_dim": hf_config["intermediate_size"],
            "moe_inter_dim": hf_config["moe_intermediate_size"],
            "n_layers": hf_config["num_hidden_layers"],
            "n_dense_layers": hf_config.get("first_k_dense_replace") or 0,
            "n_heads": heads,
            "norm_eps": hf_config.get("rms_norm_eps", 1e-6),
            "n_routed_experts": hf_config["n_routed_experts"],
            "n_shared_experts": hf_config.get("n_shared_experts") or 0,
            "n_activated_experts": hf_config["num_experts_per_tok"],
            "n_expert_groups": hf_config.get("n_group") or 1,
            "n_limited_groups": hf_config.get("topk_group") or 1,
            "score_func": hf_config.get("scoring_func", "sigmoid"),
            "route_scale": float(hf_config.get("routed_scaling_factor", 1.0)),
            "route_norm": bool(hf_config.get("norm_topk_prob", False)),
            "q_lora_rank": hf_config.get("q_lora_rank") or 0,
            "kv_lora_rank": hf_config["kv_lora_rank"],
            "qk_nope_head_dim": hf_config["qk_nope_head_dim"],
            "qk_rope_head_dim": hf_config["qk_rope_head_dim"],
            "v_head_dim": hf_config["v_head_dim"],
            "max_seq_len": max_seq_len,
            **_rope_fields(hf_config, max_seq_len),
        }
    except KeyError as missing:
        raise ModelConfigError(
            f"The HF config has no {missing}; is it a DeepSeek-V3 config?"
        ) from None
    known = {f.name for f in dataclasses.fields(DeepSeekV3Args)}
    return DeepSeekV3Args(**{k: v for k, v in fields.items() if k in known})
