"""What every family's Hugging Face state-dict adapter shares: the whole-dict form over the
streaming one, recorded args, the descriptions of a model checked against each other and a
checkpoint's tensors, and HF's per-expert weights to and from titan's stacks. A family's
adapter adds only its own facts: names, tensor layouts and its ``config.json``."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from titan_models.errors import ModelConfigError
from titan_models.spec import check_fields

__all__ = [
    "Claim",
    "ExpertStacks",
    "StateDictAdapter",
    "claims_of",
    "fit_by_building",
    "recorded_args",
    "refuse_changes",
]

Claim = tuple[str, Any, bool]
"""One description of the model: where it came from (``flavor '8B'``, ``the HF config``), its
args, and whether its ``vocab_size`` is part of it (a flavor's is a placeholder that training
replaces with the tokenizer's)."""

_PROJECTIONS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
# The names every family shares: the ends of the decoder, a block's prefix, the experts.
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
TITAN_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
TITAN_EXPERTS = re.compile(r"^moe\.experts\.(w[123])$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
HF_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
HF_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")


class StateDictAdapter:
    """The base of the families' adapters: ``to_hf``/``from_hf`` over whole dicts are the
    streaming ``to_hf_items``/``from_hf_items`` (one ``(key, tensor)`` pair in, pairs out,
    lazily; names and shapes only, so they also run on ``meta`` tensors)."""

    def __init__(self, args: Any) -> None:
        self.args = args

    def to_hf_items(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        raise NotImplementedError

    def from_hf_items(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        raise NotImplementedError

    def to_hf(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """titan names and layouts -> HF's (see ``to_hf_items``). Unknown keys raise
        ``KeyError``."""
        return dict(self.to_hf_items(state_dict.items()))

    def from_hf(self, hf_state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF names and layouts -> titan's (see ``from_hf_items``)."""
        return dict(self.from_hf_items(hf_state_dict.items()))

    def model_args(self) -> dict[str, Any]:
        """The args as JSON (``dataclasses.asdict``): what titan-ckpt records with a
        checkpoint converted from HF, so its shape, RoPE and vocabulary travel with it."""
        return dataclasses.asdict(self.args)


def recorded_args(cls: type, model_args: Any) -> Any:
    """A fresh ``cls`` (an args dataclass) from an instance or from its recorded ``asdict``
    form (JSON)."""
    if isinstance(model_args, cls):
        return dataclasses.replace(model_args)
    check_fields(cls, model_args, "The recorded model args")
    return cls(**model_args)


def refuse_changes(args: Any, values: Mapping[str, Any]) -> None:
    """Raise ``ModelConfigError`` if ``values`` change recorded ``args``: they are what the
    model was trained with."""
    changed = [
        f"{k}={v!r} (recorded: {getattr(args, k)!r})"
        for k, v in values.items()
        if getattr(args, k) != v
    ]
    if changed:
        raise ModelConfigError(
            f"{', '.join(changed)} contradicts the model args recorded with the checkpoint, "
            "which are what it was trained with; leave it out."
        )


def claims_of(
    *,
    flavor: str | None,
    hf_config: Mapping[str, Any] | None,
    model_args: Any,
    recorded: Callable[[Any], Any],
    from_hf: Callable[[Mapping[str, Any]], Any],
    from_flavor: Callable[[str], Any],
    example: str,
) -> list[Claim]:
    """The descriptions ``make_adapter`` was given, recorded args first; ``example`` completes
    the error for none (``"flavor= (e.g. '8B') or hf_config= (...)"``)."""
    if flavor is not None and hf_config is not None:
        raise ModelConfigError("make_adapter takes flavor= or hf_config=, not both.")
    claims: list[Claim] = []
    if model_args is not None:
        claims.append(("the recorded model args", recorded(model_args), True))
    if hf_config is not None:
        claims.append(("the HF config", from_hf(hf_config), True))
    if flavor is not None:
        claims.append((f"flavor {flavor!r}", from_flavor(flavor), False))
    if not claims:
        raise ModelConfigError(
            f"make_adapter needs model_args=, {example} to know the model's shape."
        )
    return claims


def fit_by_building(
    claims: Sequence[Claim],
    shapes: Mapping[str, Sequence[int]],
    model_cls: Callable[[Any], torch.nn.Module],
    *,
    optional: Callable[[Any], set[str]] = lambda args: set(),
) -> Any:
    """The first claim's args with the tensors' vocabulary, after checking that the model each
    claim describes (built on the meta device) has exactly the checkpoint's tensors (``shapes``),
    but ``optional(args)`` ones it may lack; else ``ModelConfigError`` naming what differs."""
    emb = shapes.get("tok_embeddings.weight") or shapes.get("output.weight")
    vocab = int(emb[0]) if emb is not None else claims[0][1].vocab_size
    problems = []
    for source, args, fixes_vocab in claims:
        described = args if fixes_vocab else dataclasses.replace(args, vocab_size=vocab)
        with torch.device("meta"):
            model = model_cls(described)
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        wrong = [
            f"{name}: expected {list(expected[name])}, found {list(shape)}"
            for name, shape in shapes.items()
            if name in expected and tuple(shape) != expected[name]
        ]
        wrong += [f"{name}: not in the model" for name in shapes if name not in expected]
        skip = optional(described)
        wrong += [f"{n}: missing" for n in expected if n not in shapes and n not in skip]
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


class ExpertStacks:
    """HF's per-expert weights (``mlp.experts.<j>.gate_proj.weight``, (hidden, dim)) gathered
    into titan's stacks (``moe.experts.w1``/``w3`` (experts, dim, hidden), ``w2`` (experts,
    hidden, dim)); a stack is handed out once whole, so a stream in key order holds at most one
    block's experts."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self._pending: dict[tuple[str, str], dict[int, torch.Tensor]] = {}

    def add(
        self, prefix: str, expert: int, proj: str, value: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Take one expert's ``proj`` weight of the block ``prefix`` (``layers.<i>.``); yield
        the block's stack once it is whole (each tensor held once: the stack is emptied)."""
        stack = self._pending.setdefault((prefix, proj), {})
        stack[expert] = value
        if len(stack) == self.num_experts:
            del self._pending[(prefix, proj)]
            weights = [stack.pop(j).t() for j in range(self.num_experts)]
            yield f"{prefix}moe.experts.{_PROJECTIONS[proj]}", torch.stack(weights)

    def check_complete(self) -> None:
        """Raise ``ModelConfigError`` naming every stack with experts missing."""
        if self._pending:
            missing = ", ".join(
                f"layer {prefix.split('.')[1]} {proj}: {self.num_experts - len(got)} of "
                f"{self.num_experts} experts missing"
                for (prefix, proj), got in sorted(self._pending.items())
            )
            raise ModelConfigError(f"The HF checkpoint's experts are incomplete: {missing}.")


def experts_to_hf(prefix: str, name: str, value: torch.Tensor) -> Iterator[tuple[str, Any]]:
    """titan's stacked ``moe.experts.<name>`` (``w1``, ``w2``, ``w3``) as HF's per-expert
    ``nn.Linear`` weights of the block ``prefix`` (``model.layers.<i>.``)."""
    proj = {w: p for p, w in _PROJECTIONS.items()}[name]
    for j in range(value.shape[0]):
        yield f"{prefix}mlp.experts.{j}.{proj}.weight", value[j].t().contiguous()


def experts_from_fused(
    prefix: str, name: str, value: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """titan's stacked experts from transformers 5's fused in-memory form: ``gate_up_proj``
    (experts, 2 hidden, dim), gate rows first, and ``down_proj`` (experts, dim, hidden), both
    left-multiplied, so transposed per expert."""
    if name == "down_proj":
        yield f"{prefix}moe.experts.w2", value.transpose(1, 2).contiguous()
        return
    gate, up = value.chunk(2, dim=1)
    yield f"{prefix}moe.experts.w1", gate.transpose(1, 2).contiguous()
    yield f"{prefix}moe.experts.w3", up.transpose(1, 2).contiguous()
