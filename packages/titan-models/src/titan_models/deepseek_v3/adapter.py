"""Convert DeepSeek-V3 state dicts between titan (= torchtitan) and Hugging Face naming.

Names: ``layers.3.attention.wkv_a.weight`` is HF's
``model.layers.3.self_attn.kv_a_proj_with_mqa.weight``, ``moe.expert_bias`` is
``mlp.gate.e_score_correction_bias``, and so on. Experts: titan's stacks are HF's
per-expert weights transposed (``titan_models.hf_adapter``); the shared expert, a stack of
one, is ``mlp.shared_experts.*``, transposed alike. RoPE: titan, torchtitan and DeepSeek
rotate adjacent pairs, HF's ``rope_interleave=True`` (the default, and what
:meth:`hf_config` writes); a config with ``rope_interleave: false`` has the rotated rows of
``q_proj``/``q_b_proj`` and ``kv_a_proj_with_mqa`` permuted on the way in and out.

Dropped: torchtitan's saved RoPE table ``freqs_cis``, and HF's multi-token-prediction layers
(``model.layers.<n_layers>`` and above), which titan does not train.
``moe.tokens_per_expert`` (a running count) is left out going to HF and comes back as zeros."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from titan_models.deepseek_v3.args import DeepSeekV3Args, deepseek_v3_args
from titan_models.deepseek_v3.hf_config import args_from_hf_config, hf_config_of
from titan_models.deepseek_v3.model import DeepSeekV3
from titan_models.errors import ModelConfigError
from titan_models.hf_adapter import (
    HF_EXPERT,
    HF_FUSED,
    HF_LAYER,
    TITAN_EXPERTS,
    TITAN_LAYER,
    TOP_NAMES,
    ExpertStacks,
    StateDictAdapter,
    claims_of,
    experts_from_fused,
    experts_to_hf,
    fit_by_building,
    recorded_args,
    refuse_changes,
)
from titan_models.spec import check_fields

__all__ = ["DeepSeekV3StateDictAdapter", "args_from_hf_config", "make_adapter"]

# titan name within a block -> HF's (model.layers.<i>.<name>); tensors the same.
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
}
# Stacks of one (shared) or n_routed_experts (routed) right-multiplied matrices.
_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_SHARED = {
    f"moe.shared_expert.{w}": f"mlp.shared_experts.{p}.weight" for w, p in _PROJECTIONS.items()
}
_ROPE_ROWS = {"wq", "wq_b", "wkv_a"}
# torchtitan saves its RoPE table with the weights; titan derives it from the args.
_TORCHTITAN_ROPE = "freqs_cis"


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    """Maps full (unsharded) DeepSeek-V3 state dicts to and from ``DeepseekV3ForCausalLM``
    naming (see the module docstring). ``rope_interleave`` is the HF side's RoPE layout."""

    args: DeepSeekV3Args

    def __init__(self, args: DeepSeekV3Args, *, rope_interleave: bool = True) -> None:
        super().__init__(args)
        self.rope_interleave = rope_interleave

    # ------------------------------------------------------------------ RoPE channel order
    def _permute_rope_rows(self, proj: str, w: torch.Tensor, *, to_hf: bool) -> torch.Tensor:
        """The rotated rows of a query or ``wkv_a`` weight between titan's interleaved pairs
        and HF's half-split ones (only when the HF side is ``rope_interleave=False``)."""
        if self.rope_interleave or proj not in _ROPE_ROWS:
            return w
        a = self.args
        rope, cols = a.qk_rope_head_dim, w.shape[-1]
        if proj == "wkv_a":
            keep, rot = w[: a.kv_lora_rank], w[a.kv_lora_rank :]
            return torch.cat([keep, _reorder(rot.reshape(1, rope, cols), to_hf)[0]])
        heads = w.view(-1, a.qk_head_dim, cols)
        rot = _reorder(heads[:, a.qk_nope_head_dim :], to_hf)
        return torch.cat([heads[:, : a.qk_nope_head_dim], rot], dim=1).reshape(w.shape)

    # ---------------------------------------------------------------------------- to HF
    def to_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """titan ``(key, tensor)`` pairs -> HF's; a routed-expert stack becomes one tensor
        per expert. Unknown keys raise ``KeyError``."""
        for key, value in items:
            if key in TOP_NAMES:
                yield TOP_NAMES[key], value
                continue
            if key == _TORCHTITAN_ROPE:
                continue  # torchtitan's saved RoPE table: derived from the args
            match = TITAN_LAYER.match(key)
            if match is None:
                raise KeyError(f"{key!r} is not a DeepSeek-V3 parameter name.")
            layer, rest = match.groups()
            prefix = f"model.layers.{layer}."
            if rest == "moe.tokens_per_expert":
                continue  # a running count, not a weight (see the module docstring)
            if rest in _LAYER_NAMES:
                value = self._permute_rope_rows(rest.split(".")[1], value, to_hf=True)
                yield prefix + _LAYER_NAMES[rest], value
                if rest == "moe.router.gate.weight" and self.args.load_balance_coeff is None:
                    # HF's router always has the selection bias: a zero one changes nothing.
                    bias = torch.zeros(value.shape[0], dtype=torch.float32, device=value.device)
                    yield prefix + _LAYER_NAMES["moe.expert_bias"], bias
            elif rest in _SHARED:
                yield prefix + _SHARED[rest], value[0].t().contiguous()
            elif experts := TITAN_EXPERTS.match(rest):
                yield from experts_to_hf(prefix, experts.group(1), value)
            else:
                raise KeyError(f"{key!r} is not a DeepSeek-V3 parameter name.")
            del value  # hold nothing while the next input is read

    # -------------------------------------------------------------------------- from HF
    def from_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF ``(key, tensor)`` pairs -> titan's. Experts come one tensor per expert (an HF
        checkpoint) or fused as transformers 5 holds them in memory
        (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). Rotary ``inv_freq``
        buffers and layers from ``n_layers`` on (multi-token prediction) are dropped;
        unknown keys raise ``KeyError``, missing experts ``ModelConfigError``."""
        top = {hf: titan for titan, hf in TOP_NAMES.items()}
        layer_names = {hf: titan for titan, hf in _LAYER_NAMES.items()}
        shared = {hf: titan for titan, hf in _SHARED.items()}
        stacks = ExpertStacks(self.args.n_routed_experts)
        for key, value in items:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            if key in top:
                yield top[key], value
                continue
            match = HF_LAYER.match(key)
            if match is None:
                raise KeyError(f"{key!r} is not a DeepseekV3ForCausalLM parameter name.")
            layer, rest = match.groups()
            if int(layer) >= self.args.n_layers:
                continue  # multi-token prediction
            prefix = f"layers.{layer}."
            if rest in layer_names:
                yield from self._from_hf_layer(prefix, layer_names[rest], value)
            elif rest in shared:
                yield prefix + shared[rest], value.t().unsqueeze(0).contiguous()
            elif expert := HF_EXPERT.match(rest):
                yield from stacks.add(prefix, int(expert.group(1)), expert.group(2), value)
            elif fused := HF_FUSED.match(rest):
                yield from experts_from_fused(prefix, fused.group(1), value)
            else:
                raise KeyError(f"{key!r} is not a DeepseekV3ForCausalLM parameter name.")
            del value  # hold nothing while the next input is read
        stacks.check_complete()

    def _from_hf_layer(
        self, prefix: str, name: str, value: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if name == "moe.expert_bias" and self.args.load_balance_coeff is None:
            # The output never depends on values (titan-ckpt plans on meta tensors first).
            if value.device.type != "meta" and value.count_nonzero():
                raise ModelConfigError(
                    f"{prefix}moe.expert_bias is nonzero in the checkpoint, but the model has "
                    "load_balance_coeff=None (no bias): set load_balance_coeff to keep it."
                )
            return
        yield prefix + name, self._permute_rope_rows(name.split(".")[1], value, to_hf=False)
        if name == "moe.expert_bias":
            yield prefix + "moe.tokens_per_expert", torch.zeros_like(value, dtype=torch.int64)

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``DeepseekV3ForCausalLM`` (see
        :mod:`titan_models.deepseek_v3.hf_config` for RoPE and softmax scoring)."""
        return hf_config_of(self.args, rope_interleave=self.rope_interleave)


def _reorder(rows: torch.Tensor, to_half_split: bool) -> torch.Tensor:
    """(..., rope_dim, cols): interleaved pairs -> half-split order, or back."""
    *lead, rope, cols = rows.shape
    if to_half_split:
        return rows.view(*lead, rope // 2, 2, cols).transpose(-3, -2).reshape(rows.shape)
    return rows.view(*lead, 2, rope // 2, cols).transpose(-3, -2).reshape(rows.shape)


def make_adapter(
    *,
    flavor: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
    model_args: DeepSeekV3Args | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    tensor_shapes: Mapping[str, Sequence[int]] | None = None,
) -> DeepSeekV3StateDictAdapter:
    """The ``titan.state_dict_adapters`` entry point: an adapter for the model described by
    ``model_args`` (the real args, e.g. recorded with a checkpoint), a ``flavor`` or an HF
    ``config.json`` (not both); an HF config's ``rope_interleave`` sets the HF side's RoPE
    layout. ``overrides`` replaces fields (refused where it changes recorded args).
    ``tensor_shapes`` (titan names -> shapes) are the checkpoint's: each description must agree
    with them, field by field, and the vocabulary is taken from them."""
    claims = claims_of(
        flavor=flavor,
        hf_config=hf_config,
        model_args=model_args,
        recorded=lambda recorded: recorded_args(DeepSeekV3Args, recorded),
        from_hf=args_from_hf_config,
        from_flavor=deepseek_v3_args,
        example="flavor= (e.g. '16B') or hf_config= (a DeepseekV3ForCausalLM config.json as a "
        "dict)",
    )
    args = claims[0][1]
    if tensor_shapes is not None:
        # torchtitan saves its RoPE table with the weights.
        shapes = {k: v for k, v in tensor_shapes.items() if k != _TORCHTITAN_ROPE}
        args = fit_by_building(claims, shapes, DeepSeekV3)
    if overrides:
        check_fields(DeepSeekV3Args, overrides)
        if model_args is not None:
            refuse_changes(args, overrides)
        args = dataclasses.replace(args, **overrides)
    interleave = True if hf_config is None else bool(hf_config.get("rope_interleave", True))
    return DeepSeekV3StateDictAdapter(args, rope_interleave=interleave)
