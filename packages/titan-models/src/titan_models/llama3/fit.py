"""Checking a description of a Llama 3 model (a flavor, an HF config, recorded args) against
a checkpoint's tensors, so that an HF ``config.json`` tells the truth about them.

A flavor fixes the architecture but not the vocabulary (titan-train sets ``vocab_size`` from
the tokenizer); an HF config and recorded args state it too. What the tensors show (the
embedding, the layer indices, ``wq``/``wk``/``w1`` rows) must agree with the description;
the vocabulary is then taken from the tensors. ``n_heads`` shows in no tensor, so it comes
from the descriptions, which must agree on it."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from titan_models.errors import ModelConfigError
from titan_models.llama3.args import Llama3Args

__all__ = ["Claim", "TensorShape", "fit_to_tensors"]

_LAYER = re.compile(r"^layers\.(\d+)\.")

TensorShape = Sequence[int]


@dataclass(frozen=True)
class Claim:
    """One description of the model and where it came from."""

    source: str
    """How the error message names it, e.g. ``flavor '8B'``, ``the HF config``."""
    args: Llama3Args
    fixes_vocab: bool
    """Whether its ``vocab_size`` is part of the claim (an HF config, recorded args), or a
    placeholder that training replaces (a flavor)."""


def _found(shapes: Mapping[str, TensorShape]) -> dict[str, tuple[int, str]]:
    """The sizes the tensors show: field -> (value, the tensor it was read from)."""
    found: dict[str, tuple[int, str]] = {}
    emb = shapes.get("tok_embeddings.weight")
    if emb is not None and len(emb) == 2:
        found["vocab_size"] = (int(emb[0]), "tok_embeddings.weight rows")
        found["dim"] = (int(emb[1]), "tok_embeddings.weight columns")
    layers = {int(m.group(1)) for k in shapes if (m := _LAYER.match(k))}
    if layers:
        found["n_layers"] = (max(layers) + 1, "layers.<i> indices")
    for key, name in (
        ("layers.0.attention.wq.weight", "q_rows"),
        ("layers.0.attention.wk.weight", "kv_rows"),
        ("layers.0.feed_forward.w1.weight", "hidden_dim"),
    ):
        shape = shapes.get(key)
        if shape is not None and len(shape) == 2:
            found[name] = (int(shape[0]), f"{key} rows")
    return found


def _contradictions(claim: Claim, found: Mapping[str, tuple[int, str]]) -> list[str]:
    a = claim.args
    expected = {
        "dim": a.dim,
        "n_layers": a.n_layers,
        "q_rows": a.n_heads * a.head_dim,
        "kv_rows": a.kv_heads * a.head_dim,
        "hidden_dim": a.hidden_dim,
    }
    if claim.fixes_vocab:
        expected["vocab_size"] = a.vocab_size
    labels = {  # titan's name (HF config.json's)
        "vocab_size": "vocab_size",
        "dim": "dim (hidden_size)",
        "n_layers": "n_layers (num_hidden_layers)",
        "q_rows": "n_heads x head_dim (num_attention_heads x head_dim)",
        "kv_rows": "n_kv_heads x head_dim (num_key_value_heads x head_dim)",
        "hidden_dim": "ffn hidden size (intermediate_size)",
    }
    out = []
    for field, want in expected.items():
        if field in found and found[field][0] != want:
            value, where = found[field]
            out.append(
                f"{labels[field]}: expected {want} from {claim.source}, found {value} ({where})"
            )
    return out


def fit_to_tensors(claims: Sequence[Claim], shapes: Mapping[str, TensorShape]) -> Llama3Args:
    """The first claim's args with the vocabulary the tensors have, after checking that every
    claim agrees with the tensors (and the claims on ``n_heads``, which the tensors do not
    show). Raises ``ModelConfigError`` naming each contradicting field, expected vs found."""
    if not claims:
        raise ModelConfigError("fit_to_tensors needs at least one description of the model.")
    found = _found(shapes)
    problems = [p for claim in claims for p in _contradictions(claim, found)]
    first = claims[0]
    for claim in claims[1:]:
        if claim.args.n_heads != first.args.n_heads:
            problems.append(
                f"n_heads: {first.args.n_heads} from {first.source}, {claim.args.n_heads} "
                f"from {claim.source}"
            )
    if problems:
        sources = " and ".join(dict.fromkeys(c.source for c in claims))
        raise ModelConfigError(
            f"{sources} contradicts the checkpoint's tensors: {'; '.join(problems)}. Describe "
            "the model the checkpoint holds (its flavor, or an HF config.json of its shape)."
        )
    vocab = found.get("vocab_size", (first.args.vocab_size, ""))[0]
    return dataclasses.replace(first.args, vocab_size=vocab)
