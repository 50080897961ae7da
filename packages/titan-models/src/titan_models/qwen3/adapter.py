"""Convert Qwen3 state dicts between titan (= torchtitan) and Hugging Face naming
(``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``).

Names differ (``layers.3.moe.router.gate.weight`` is HF's ``model.layers.3.mlp.gate.weight``);
RoPE rows need no permutation (both rotate the two halves of each head); expert stacks are
HF's per-expert weights transposed. Tied: HF has no ``lm_head.weight``, so ``output.weight``
is left out going to HF and is the embedding coming back. ``moe.expert_bias`` and
``moe.tokens_per_expert`` have no HF place: left out going, zeros coming back; a model whose
trained bias is nonzero routes some tokens differently there (the adapter warns)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

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
from titan_models.qwen3.args import Qwen3Args, qwen3_args
from titan_models.qwen3.hf_config import args_from_hf_config, differences, hf_config_of
from titan_models.qwen3.model import Qwen3
from titan_models.spec import check_fields

logger = logging.getLogger("titan_models")

__all__ = ["Qwen3StateDictAdapter", "args_from_hf_config", "make_adapter"]

# titan name within a block -> HF's (model.layers.<i>.<name>); tensors the same.
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_BALANCE_BUFFERS = ("moe.expert_bias", "moe.tokens_per_expert")


class Qwen3StateDictAdapter(StateDictAdapter):
    """Maps full (unsharded) Qwen3 state dicts to and from ``Qwen3ForCausalLM`` /
    ``Qwen3MoeForCausalLM`` naming (see the module docstring)."""

    args: Qwen3Args

    def to_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """titan ``(key, tensor)`` pairs -> HF's; an expert stack becomes one tensor per
        expert; a tied ``output.weight`` and the balance buffers are left out. Unknown keys
        raise ``KeyError``."""
        for key, value in items:
            if key in TOP_NAMES:
                if not (key == "output.weight" and self.args.enable_weight_tying):
                    yield TOP_NAMES[key], value
                continue
            match = TITAN_LAYER.match(key)
            if match is None:
                raise KeyError(f"{key!r} is not a Qwen3 parameter name.")
            layer, rest = match.groups()
            prefix = f"model.layers.{layer}."
            if rest in _LAYER_NAMES:
                yield prefix + _LAYER_NAMES[rest], value
            elif experts := TITAN_EXPERTS.match(rest):
                yield from experts_to_hf(prefix, experts.group(1), value)
            elif rest not in _BALANCE_BUFFERS:
                raise KeyError(f"{key!r} is not a Qwen3 parameter name.")
            elif rest == "moe.expert_bias" and value.device.type != "meta" and value.any():
                logger.warning(
                    "layers.%s.moe.expert_bias is not zero (max %.3g) and Hugging Face's "
                    "Qwen3-MoE cannot hold it: the exported model routes some tokens to other "
                    "experts than this one. Train with load_balance_coeff=None (titan-train "
                    "--model.load_balance_coeff 0) for an export "
                    "that routes exactly as trained.",
                    layer,
                    float(value.abs().max()),
                )
            del value  # hold nothing while the next input is read

    def from_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF ``(key, tensor)`` pairs -> titan's. Experts come one tensor per expert (an HF
        checkpoint) or fused as transformers 5 holds them in memory. Tied: the embedding is
        yielded as ``output.weight`` too and an ``lm_head.weight`` is ignored. Rotary
        ``inv_freq`` buffers are dropped; unknown keys raise ``KeyError``, missing experts
        ``ModelConfigError``."""
        tied = self.args.enable_weight_tying
        top = {hf: titan for titan, hf in TOP_NAMES.items()}
        layer_names = {hf: titan for titan, hf in _LAYER_NAMES.items()}
        stacks = ExpertStacks(self.args.num_experts)
        for key, value in items:
            if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                continue
            if key in top:
                yield top[key], value
                if tied and key == "model.embed_tokens.weight":
                    yield "output.weight", value
                continue
            match = HF_LAYER.match(key)
            if match is None:
                raise KeyError(f"{key!r} is not a Qwen3ForCausalLM parameter name.")
            layer, rest = match.groups()
            prefix = f"layers.{layer}."
            if rest in layer_names:
                yield prefix + layer_names[rest], value
                if rest == "mlp.gate.weight" and self.args.load_balance_coeff is not None:
                    zeros = torch.zeros(value.shape[0], dtype=torch.float32, device=value.device)
                    yield from ((prefix + name, zeros.clone()) for name in _BALANCE_BUFFERS)
            elif expert := HF_EXPERT.match(rest):
                yield from stacks.add(prefix, int(expert.group(1)), expert.group(2), value)
            elif fused := HF_FUSED.match(rest):
                yield from experts_from_fused(prefix, fused.group(1), value)
            else:
                raise KeyError(f"{key!r} is not a Qwen3ForCausalLM parameter name.")
            del value  # hold nothing while the next input is read
        stacks.check_complete()

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``Qwen3ForCausalLM`` or
        ``Qwen3MoeForCausalLM``."""
        return hf_config_of(self.args)


def make_adapter(
    *,
    flavor: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
    model_args: Qwen3Args | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    tensor_shapes: Mapping[str, Sequence[int]] | None = None,
) -> Qwen3StateDictAdapter:
    """The ``titan.state_dict_adapters`` entry point: an adapter for the model described by
    ``model_args`` (the real args, e.g. recorded with a checkpoint), a ``flavor`` or an HF
    ``config.json`` (not both); with ``model_args`` they must describe the same architecture.
    ``overrides`` replaces fields (refused where it changes recorded args). ``tensor_shapes``
    (titan names -> shapes) are the checkpoint's: each description must agree with them, field
    by field, and the vocabulary is taken from them."""
    claims = claims_of(
        flavor=flavor,
        hf_config=hf_config,
        model_args=model_args,
        recorded=lambda recorded: recorded_args(Qwen3Args, recorded),
        from_hf=args_from_hf_config,
        from_flavor=qwen3_args,
        example="flavor= (e.g. '8B') or hf_config= (a Qwen3ForCausalLM or "
        "Qwen3MoeForCausalLM config.json as a dict)",
    )
    source, first, first_vocab = claims[0]
    for other_source, other, other_vocab in claims[1:]:
        diff = differences(first, other, vocab=first_vocab and other_vocab)
        if diff:
            raise ModelConfigError(
                f"{other_source} describes another model than {source}: {'; '.join(diff)} "
                f"({source}'s value first). Give the description of the weights being loaded."
            )
    args = first
    if tensor_shapes is not None:
        tied = lambda a: {"output.weight"} if a.enable_weight_tying else set()  # noqa: E731
        args = fit_by_building(claims, tensor_shapes, Qwen3, optional=tied)
    if overrides:
        values = dict(overrides)
        if values.get("rope_scaling", "none") in ("none", "flavor"):
            values.pop("rope_scaling", None)  # Qwen3's only RoPE; anything else is refused
        check_fields(Qwen3Args, values)
        if model_args is not None:
            refuse_changes(args, values)
        args = dataclasses.replace(args, **values)
    return Qwen3StateDictAdapter(args)
