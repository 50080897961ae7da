"""Convert Qwen3 state dicts between titan (= torchtitan) and Hugging Face naming
(``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``).

Names: ``layers.3.attention.q_norm.weight`` is HF's ``model.layers.3.self_attn.q_norm.weight``,
``layers.3.moe.router.gate.weight`` is ``model.layers.3.mlp.gate.weight``, and so on (the
names torchtitan's Qwen3 adapter maps). RoPE needs no permutation: titan's Qwen3 rotates the
channel pairs ``(i, i + head_dim/2)`` of each head, as HF's ``rotate_half`` does, so
``wq``/``wk`` and the QK-norm weights cross unchanged (Llama 3 rotates adjacent pairs and
its adapter permutes rows; torchtitan's Qwen3, too, uses HF's layout).

Experts: titan stacks each MoE block's experts into ``moe.experts.w1``/``w3`` (experts, dim,
hidden) and ``w2`` (experts, hidden, dim), multiplied from the right; an HF checkpoint has one
``nn.Linear`` weight per expert and projection (``mlp.experts.<j>.gate_proj.weight``,
(hidden, dim)): each is a transposed slice. transformers 5 holds them fused in memory
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``); that form converts from HF too.

Tied embeddings: HF writes no ``lm_head.weight`` when ``tie_word_embeddings`` is set, so
``output.weight`` is left out going to HF, and coming back the embedding is yielded under both
names (the same tensor; the model ties them anyway). Buffers without an HF counterpart: the
expert-selection bias ``moe.expert_bias`` and the token counts ``moe.tokens_per_expert`` are
left out going to HF and come back as zeros. HF's Qwen3-MoE routes without a bias, so a model
whose trained bias is nonzero routes some tokens differently there.

The adapter has titan-ckpt's streaming form (one ``(key, tensor)`` pair in, pairs out,
lazily) and is registered under ``titan.state_dict_adapters`` as ``qwen3``. Going from HF,
an expert projection is yielded once all of its experts have been read.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from titan_models.errors import ModelConfigError
from titan_models.moe.hf import experts_from_fused, stack_experts
from titan_models.qwen3.args import Qwen3Args, qwen3_args
from titan_models.qwen3.hf_config import args_from_hf_config, differences, hf_config_of

logger = logging.getLogger("titan_models")

__all__ = ["Qwen3StateDictAdapter", "args_from_hf_config", "make_adapter"]

_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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
_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_BALANCE_BUFFERS = ("moe.expert_bias", "moe.tokens_per_expert")
_TITAN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_HF_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")


class Qwen3StateDictAdapter:
    """Maps full (unsharded) Qwen3 state dicts to and from ``Qwen3ForCausalLM`` /
    ``Qwen3MoeForCausalLM`` naming (see the module docstring). The mapping depends on names
    and shapes only, so it also runs on ``meta`` tensors."""

    def __init__(self, args: Qwen3Args) -> None:
        self.args = args

    # ---------------------------------------------------------------------------- to HF
    def to_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """titan ``(key, tensor)`` pairs -> HF's; an expert stack becomes one tensor per
        expert; a tied ``output.weight`` and the balance buffers are left out. Unknown keys
        raise ``KeyError``."""
        for key, value in items:
            if key in _TOP_NAMES:
                if not (key == "output.weight" and self.args.enable_weight_tying):
                    yield _TOP_NAMES[key], value
                continue
            match = _TITAN_LAYER.match(key)
            if match is None:
                raise KeyError(f"{key!r} is not a Qwen3 parameter name.")
            layer, rest = match.groups()
            prefix = f"model.layers.{layer}."
            if rest in _LAYER_NAMES:
                yield prefix + _LAYER_NAMES[rest], value
            elif rest.startswith("moe.experts.") and rest[12:] in _PROJECTIONS:
                proj = _PROJECTIONS[rest[12:]]
                for j in range(value.shape[0]):
                    yield f"{prefix}mlp.experts.{j}.{proj}.weight", value[j].t().contiguous()
            elif rest not in _BALANCE_BUFFERS:
                raise KeyError(f"{key!r} is not a Qwen3 parameter name.")
            elif rest == "moe.expert_bias" and value.device.type != "meta" and value.any():
                # HF's Qwen3-MoE has no place for it: the export routes without it.
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

    # -------------------------------------------------------------------------- from HF
    def from_hf_items(
        self, items: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF ``(key, tensor)`` pairs -> titan's. Experts come one tensor per expert (an HF
        checkpoint) or fused as transformers 5 holds them in memory. Tied: the embedding is
        yielded as ``output.weight`` too and an ``lm_head.weight`` is ignored. Rotary
        ``inv_freq`` buffers are dropped; unknown keys raise ``KeyError``, missing experts
        ``ModelConfigError``."""
        tied = self.args.enable_weight_tying
        top = {hf: titan for titan, hf in _TOP_NAMES.items()}
        layer_names = {hf: titan for titan, hf in _LAYER_NAMES.items()}
        pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        for key, value in items:
            if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                continue
            if key in top:
                yield top[key], value
                if tied and key == "model.embed_tokens.weight":
                    yield "output.weight", value
                continue
            match = _HF_LAYER.match(key)
            if match is None:
                raise KeyError(f"{key!r} is not a Qwen3ForCausalLM parameter name.")
            layer, rest = match.groups()
            prefix = f"layers.{layer}."
            if rest in layer_names:
                yield prefix + layer_names[rest], value
                if rest == "mlp.gate.weight" and self.args.load_balance_coeff is not None:
                    zeros = torch.zeros(value.shape[0], dtype=torch.float32, device=value.device)
                    yield from ((prefix + name, zeros.clone()) for name in _BALANCE_BUFFERS)
            elif expert := _HF_EXPERT.match(rest):
                j, proj = int(expert.group(1)), expert.group(2)
                stack = pending.setdefault((layer, proj), {})
                stack[j] = value
                if len(stack) == self.args.num_experts:
                    del pending[(layer, proj)]
                    yield self._stacked(prefix, proj, stack)
            elif fused := _HF_FUSED.match(rest):
                yield from experts_from_fused(prefix, fused.group(1), value)
            else:
                raise KeyError(f"{key!r} is not a Qwen3ForCausalLM parameter name.")
            del value  # hold nothing while the next input is read
        if pending:
            missing = ", ".join(
                f"layer {layer} {proj}: {self.args.num_experts - len(got)} of "
                f"{self.args.num_experts} experts missing"
                for (layer, proj), got in sorted(pending.items())
            )
            raise ModelConfigError(f"The HF checkpoint's experts are incomplete: {missing}.")

    def _stacked(
        self, prefix: str, proj: str, stack: dict[int, torch.Tensor]
    ) -> tuple[str, torch.Tensor]:
        name = {p: w for w, p in _PROJECTIONS.items()}[proj]
        return f"{prefix}moe.experts.{name}", stack_experts(stack, self.args.num_experts)

    # ------------------------------------------------------------------------ whole dicts
    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """titan names and layouts -> HF's (see :meth:`to_hf_items`)."""
        return dict(self.to_hf_items(state_dict.items()))

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names and layouts -> titan's (see :meth:`from_hf_items`)."""
        return dict(self.from_hf_items(hf_state_dict.items()))

    def model_args(self) -> dict[str, Any]:
        """The args as JSON (``dataclasses.asdict``): what titan-ckpt records with a
        checkpoint converted from HF."""
        return dataclasses.asdict(self.args)

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``Qwen3ForCausalLM`` or
        ``Qwen3MoeForCausalLM``."""
        return hf_config_of(self.args)


def _expected_shapes(args: Qwen3Args) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry of the model ``args`` builds, with its shape (on the meta
    device: nothing is allocated)."""
    from titan_models.qwen3.model import Qwen3

    with torch.device("meta"):
        model = Qwen3(args)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _fit(
    claims: list[tuple[str, Qwen3Args, bool]], shapes: Mapping[str, Sequence[int]]
) -> Qwen3Args:
    """The first claim's args with the tensors' vocabulary, after checking every claim's
    names and shapes against the tensors (``(source, args, fixes_vocab)``)."""
    emb = shapes.get("tok_embeddings.weight") or shapes.get("output.weight")
    vocab = int(emb[0]) if emb is not None else claims[0][1].vocab_size
    problems = []
    for source, args, fixes_vocab in claims:
        described = args if fixes_vocab else dataclasses.replace(args, vocab_size=vocab)
        expected = _expected_shapes(described)
        wrong = [
            f"{name}: expected {list(expected[name])}, found {list(shape)}"
            for name, shape in shapes.items()
            if name in expected and tuple(shape) != expected[name]
        ]
        wrong += [f"{name}: not in the model" for name in shapes if name not in expected]
        optional = {"output.weight"} if described.enable_weight_tying else set()
        wrong += [f"{n}: missing" for n in expected if n not in shapes and n not in optional]
        if wrong:
            more = f" and {len(wrong) - 6} more" if len(wrong) > 6 else ""
            problems.append(f"{source}: {'; '.join(wrong[:6])}{more}")
    if problems:
        raise ModelConfigError(
            f"The description contradicts the checkpoint's tensors ({' | '.join(problems)}). "
            "Describe the model the checkpoint holds (its flavor, or an HF config.json of its "
            "shape)."
        )
    return dataclasses.replace(claims[0][1], vocab_size=vocab)


def _recorded_args(model_args: Qwen3Args | Mapping[str, Any]) -> Qwen3Args:
    if isinstance(model_args, Qwen3Args):
        return dataclasses.replace(model_args)
    known = {f.name for f in dataclasses.fields(Qwen3Args)}
    unknown = sorted(set(model_args) - known)
    if unknown:
        raise ModelConfigError(
            f"The recorded model args have field(s) {', '.join(unknown)} that Qwen3Args "
            "lacks; were they written by another version or model?"
        )
    return Qwen3Args(**model_args)


def _check_agree(claims: list[tuple[str, Qwen3Args, bool]]) -> None:
    """Raise naming every architecture field in which two descriptions differ."""
    source, first, first_vocab = claims[0]
    for other_source, other, other_vocab in claims[1:]:
        diff = differences(first, other, vocab=first_vocab and other_vocab)
        if diff:
            raise ModelConfigError(
                f"{other_source} describes another model than {source}: {'; '.join(diff)} "
                f"({source}'s value first). Give the description of the weights being loaded."
            )


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
    ``config.json`` (``flavor`` and ``hf_config`` exclude each other; with ``model_args``
    they must describe the same architecture, else ``ModelConfigError`` names each field).

    ``overrides`` replaces fields (refused where it contradicts recorded args).
    ``tensor_shapes`` (titan names -> shapes) are the checkpoint's: every description must
    build exactly those tensors (``ModelConfigError`` naming each that differs), the
    vocabulary aside for a flavor, which is taken from them."""
    if flavor is not None and hf_config is not None:
        raise ModelConfigError("make_adapter takes flavor= or hf_config=, not both.")
    claims: list[tuple[str, Qwen3Args, bool]] = []
    if model_args is not None:
        claims.append(("the recorded model args", _recorded_args(model_args), True))
    if hf_config is not None:
        claims.append(("the HF config", args_from_hf_config(hf_config), True))
    if flavor is not None:
        claims.append((f"flavor {flavor!r}", qwen3_args(flavor), False))
    if not claims:
        raise ModelConfigError(
            "make_adapter needs model_args=, flavor= (e.g. '8B') or hf_config= (a "
            "Qwen3ForCausalLM or Qwen3MoeForCausalLM config.json as a dict) to know the "
            "model's shape."
        )
    _check_agree(claims)
    args = claims[0][1]
    if tensor_shapes is not None:
        args = _fit(claims, tensor_shapes)
    if overrides:
        args = _with_overrides(args, overrides, recorded=model_args is not None)
    return Qwen3StateDictAdapter(args)


def _with_overrides(args: Qwen3Args, overrides: Mapping[str, Any], *, recorded: bool) -> Qwen3Args:
    """``args`` with ``overrides`` applied; unknown fields raise ``ModelConfigError``, and so
    does a change to recorded args (what the model was trained with)."""
    values = dict(overrides)
    if values.get("rope_scaling", "none") in ("none", "flavor"):
        values.pop("rope_scaling", None)  # Qwen3's only RoPE; anything else is refused below
    known = {f.name for f in dataclasses.fields(Qwen3Args)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ModelConfigError(
            f"Unknown Qwen3Args field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}."
        )
    if recorded:
        changed = [f"{k}={v!r}" for k, v in values.items() if getattr(args, k) != v]
        if changed:
            raise ModelConfigError(
                f"{', '.join(changed)} contradicts the model args recorded with the "
                "checkpoint, which are what it was trained with; leave it out."
            )
    return dataclasses.replace(args, **values)
