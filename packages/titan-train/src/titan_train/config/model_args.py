"""The model's real arguments: built from ``[model]`` and the tokenizer through the spec's
``args_fn``, recorded with every checkpoint, and given to the HF adapter.

Model-agnostic: ``args_fn(flavor, **overrides)`` gets only what the trainer knows
(``vocab_size``, the longest ``max_seq_len`` fed, ``rope_scaling`` unless ``"flavor"``). The
record (``titan_ckpt.MODEL_RECORD``: name, flavor, args as JSON) lets ``titan-ckpt convert
--to hf`` describe the model as trained without being told.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import typing
from typing import Any

from titan_ckpt import MODEL_RECORD
from titan_ckpt.adapter import takes_keyword
from titan_models import ModelConfigError, ModelSpec
from titan_train.config import ModelSection
from titan_train.config.loader import check_type
from titan_train.errors import ConfigError, check_number

__all__ = [
    "build_model_args",
    "check_resumed_model",
    "model_metadata",
    "state_dict_adapter",
    "torchtitan_rope_line",
]

logger = logging.getLogger("titan_train")


def build_model_args(
    spec: ModelSpec, model: ModelSection, *, vocab_size: int | None, max_seq_len: int
) -> Any:
    """``spec.args_fn(flavor, **overrides)`` for this run, ``model.args`` applied last;
    ``ConfigError`` for a key the family's args lack or a value they refuse."""
    overrides: dict[str, Any] = {"max_seq_len": max_seq_len}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    if model.rope_scaling != "flavor":
        overrides["rope_scaling"] = model.rope_scaling
    overrides.update(_moe_overrides(spec, model))
    if not model.args:
        return spec.args_fn(model.flavor, **overrides)
    overrides.update(_given_args(spec, model, vocab_size=vocab_size, max_seq_len=max_seq_len))
    try:
        return spec.args_fn(model.flavor, **overrides)
    except ModelConfigError as error:  # the args' own rules (dim divisible by n_heads, ...)
        raise ConfigError(
            f"[model.args] {_show(model.args)} with {spec.name} {model.flavor}: {error}"
        ) from None


def _given_args(
    spec: ModelSpec, model: ModelSection, *, vocab_size: int | None, max_seq_len: int
) -> dict[str, Any]:
    """``model.args`` checked against the family's args: known fields (not ``rope_scaling``,
    ``model.rope_scaling``'s) of their types, ``vocab_size`` and ``max_seq_len`` no smaller
    than the tokenizer's and the longest sequence."""
    defaults = spec.args_fn(model.flavor)
    if not dataclasses.is_dataclass(defaults):
        raise ConfigError(
            f"model.args cannot be given for {spec.name}: its args are not a dataclass."
        )
    hints = typing.get_type_hints(type(defaults))
    allowed = sorted(f.name for f in dataclasses.fields(defaults) if f.name != "rope_scaling")
    unknown = sorted(set(model.args) - set(allowed))
    if unknown:
        also = " (RoPE scaling is model.rope_scaling)" if "rope_scaling" in unknown else ""
        raise ConfigError(
            f"model.args.{unknown[0]} is not an argument of {spec.name} "
            f"({type(defaults).__name__}){also}; allowed: {', '.join(allowed)}."
        )
    given = {
        name: check_type(value, hints[name], source="model.args", where=f"model.args.{name}")
        for name, value in model.args.items()
    }
    for name in ("load_balance_coeff", "aux_loss_alpha"):
        if name in given and getattr(model, name) is not None:
            raise ConfigError(f"model.{name} and model.args.{name} are both set; keep one.")
    given_vocab = given.get("vocab_size")
    if given_vocab is not None and vocab_size is not None and given_vocab < vocab_size:
        raise ConfigError(
            f"model.args.vocab_size={given_vocab} is smaller than the tokenizer's {vocab_size} "
            f"tokens ({model.tokenizer_path or 'the shipped tokenizer'}): its embedding would "
            f"have no row for some; raise it to at least {vocab_size}, or leave it unset (the "
            "tokenizer's)."
        )
    if given.get("max_seq_len", max_seq_len) < max_seq_len:
        raise ConfigError(
            f"model.args.max_seq_len={given['max_seq_len']} is shorter than the longest "
            f"sequence the run feeds the model ({max_seq_len}, training.seq_len or "
            "validation.seq_len); raise it, or leave it unset (that length)."
        )
    return given


def _show(args: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {v!r}" for k, v in args.items()) + "}"


def _moe_overrides(spec: ModelSpec, model: ModelSection) -> dict[str, Any]:
    """``model.load_balance_coeff`` and ``model.aux_loss_alpha`` as args overrides (0 turns
    the bias off: ``None`` in the args); refused for a model without them."""
    overrides: dict[str, Any] = {}
    if model.load_balance_coeff is not None:
        check_number("model.load_balance_coeff", model.load_balance_coeff, low=0)
        overrides["load_balance_coeff"] = model.load_balance_coeff or None
    if model.aux_loss_alpha is not None:
        check_number("model.aux_loss_alpha", model.aux_loss_alpha, low=0)
        overrides["aux_loss_alpha"] = model.aux_loss_alpha
    if not overrides:
        return overrides
    defaults = spec.args_fn(model.flavor)
    fields = (
        {f.name for f in dataclasses.fields(defaults)}
        if dataclasses.is_dataclass(defaults)
        else set()
    )
    moe = bool(getattr(defaults, "moe_enabled", True)) and "load_balance_coeff" in fields
    if not moe or not set(overrides) <= fields:
        names = " and ".join(f"model.{name}" for name in overrides)
        raise ConfigError(
            f"{names} set expert balancing, but {spec.name} {model.flavor} has no "
            "mixture-of-experts blocks; leave them unset, or choose an MoE model "
            "(deepseek_v3, or a qwen3 *_moe / A3B / A22B flavor)."
        )
    return overrides


def _as_json(args: Any) -> dict[str, Any] | None:
    """``args`` as a JSON object (a dataclass's fields), or None if it is not one."""
    if not dataclasses.is_dataclass(args) or isinstance(args, type):
        return None
    try:
        return json.loads(json.dumps(dataclasses.asdict(args)))
    except (TypeError, ValueError):
        return None


def model_metadata(
    spec: ModelSpec, flavor: str, args: Any, *, tokenizer_path: str | None = None
) -> dict[str, Any]:
    """``CheckpointManager(metadata=...)``: name, flavor, real args and the run's tokenizer (an
    absolute path; absent or ``embedded_chat`` for shipped ones), for ``generate``."""
    record: dict[str, Any] = {"name": spec.name, "flavor": flavor}
    if tokenizer_path == "embedded_chat":  # the shipped chat tokenizer, by its name
        record["tokenizer_path"] = tokenizer_path
    elif tokenizer_path and tokenizer_path != "embedded":
        record["tokenizer_path"] = os.path.abspath(tokenizer_path)
    as_json = _as_json(args)
    if as_json is None:
        logger.warning(
            "The args of model %s are not a JSON-serializable dataclass; checkpoints record "
            "only its name and flavor.",
            spec.name,
        )
    else:
        record["args"] = as_json
    return {MODEL_RECORD: record}


def state_dict_adapter(spec: ModelSpec, flavor: str, args: Any) -> Any:
    """The spec's HF adapter for the model as built (its real args: vocabulary, RoPE), or
    for its flavor when the spec's factory does not take ``model_args``."""
    if takes_keyword(spec.state_dict_adapter, "model_args"):
        return spec.state_dict_adapter(model_args=args)
    return spec.state_dict_adapter(flavor=flavor)


# Args a run may change on resume without changing the model's function.
_RUN_ARGS = ("max_seq_len",)


def check_resumed_model(
    loaded: dict[str, Any] | None, metadata: dict[str, Any], *, source: str | None = None
) -> list[str]:
    """Warn once when a checkpoint of this model and flavor recorded other args (``rope_scaling``
    computes something else); returns ``field: recorded -> now``."""
    if source == "torchtitan":
        line = torchtitan_rope_line(metadata)
        if line is not None:
            logger.warning("%s", line)
        return []
    before = (loaded or {}).get(MODEL_RECORD) or {}
    now = metadata.get(MODEL_RECORD, {})
    same_model = (before.get("name"), before.get("flavor")) == (now.get("name"), now.get("flavor"))
    if not (same_model and isinstance(before.get("args"), dict) and "args" in now):
        return []
    old, new = before["args"], now["args"]
    changed = [
        f"{key}: {json.dumps(old.get(key))} -> {json.dumps(new.get(key))}"
        for key in sorted(set(old) | set(new))
        if key not in _RUN_ARGS and old.get(key) != new.get(key)
    ]
    if changed:
        logger.warning(
            "The checkpoint was trained with other model args than this run's (%s); set them "
            "as recorded (e.g. --model.rope_scaling) unless the change is intended.",
            "; ".join(changed),
        )
    return changed


def torchtitan_rope_line(metadata: dict[str, Any]) -> str | None:
    """The RoPE a resumed torchtitan checkpoint runs with and the ``model.rope_scaling`` for the
    other (its Llama 3 changed to 3.1 scaling in October 2025); None without rope_scaling."""
    args = metadata.get(MODEL_RECORD, {}).get("args")
    if not isinstance(args, dict) or "rope_scaling" not in args:
        return None
    scaling = args["rope_scaling"]
    if scaling:
        return (
            "This torchtitan checkpoint resumes with Llama 3.1 RoPE scaling (factor "
            f"{scaling.get('factor')}, original_max_position_embeddings "
            f"{scaling.get('original_max_position_embeddings')}), as torchtitan's Llama 3 "
            "since October 2025; a run of an older torchtitan (e.g. July 2025) trained with "
            "plain RoPE: resume it with --model.rope_scaling none (model.rope_scaling = "
            '"none").'
        )
    return (
        "This torchtitan checkpoint resumes with plain RoPE, as torchtitan's Llama 3 before "
        "October 2025 (e.g. July 2025); a run of a later torchtitan trained with Llama 3.1 "
        'scaling: resume it with --model.rope_scaling llama3 (model.rope_scaling = "llama3").'
    )
