"""Continue pretraining from Hugging Face weights: the check, before any work, that the
folder ``checkpoint.initial_load_path`` (with ``checkpoint.initial_load_in_hf``) holds the
model this run builds: its ``config.json`` describes the family and its tensors, renamed by
the spec's adapter from the safetensors headers alone, are this run's parameters with their
shapes (one ``CheckpointConfigError``, exit 2, starting with the folder, otherwise).
Published checkpoints often pad the embedding beyond the tokenizer (Qwen3: 151,936 rows for
151,669 tokens), so the run builds the folder's ``vocab_size`` (:func:`run_vocab_size`); a
smaller one than the tokenizer's is refused.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from titan_ckpt import CheckpointConfigError
from titan_ckpt.adapter import takes_keyword
from titan_ckpt.hf import HF_CONFIG, check_hf_folder, require_safetensors
from titan_ckpt.preflight import open_storage
from titan_models import ModelSpec
from titan_train.config import JobConfig
from titan_train.config.model_args import build_model_args, state_dict_adapter

__all__ = ["check_initial_hf_load", "run_vocab_size"]

_FIX = (
    "To continue from this folder, choose the --model.name and --model.flavor of its model "
    "(and --model.tokenizer_path of its vocabulary)."
)


def _hf_config(storage: Any, path: str) -> dict[str, Any] | None:
    name = storage.join(path, HF_CONFIG)
    if not storage.exists(name):
        return None
    with storage.open(name, "rb") as f:
        try:
            config = json.loads(f.read())
        except ValueError as error:
            raise CheckpointConfigError(
                f"checkpoint.initial_load_path={path!r}: its {HF_CONFIG} is not JSON ({error})."
            ) from None
    return config if isinstance(config, dict) else None


def _starts_from_hf(config: JobConfig) -> str | None:
    ckpt = config.checkpoint
    path = ckpt.initial_load_path
    return path if ckpt.enable and ckpt.initial_load_in_hf and path else None


def run_vocab_size(config: JobConfig, tokenizer_vocab: int) -> int:
    """The vocabulary the model is built with: the tokenizer's, or a larger (padded) one of
    the Hugging Face folder it starts from; ``CheckpointConfigError`` when that is smaller."""
    path = _starts_from_hf(config)
    if path is None:
        return tokenizer_vocab
    storage = open_storage(path)
    hf_config = _hf_config(storage, path) if storage.exists(path) else None
    hf_vocab = (hf_config or {}).get("vocab_size")
    if not isinstance(hf_vocab, int) or isinstance(hf_vocab, bool):
        return tokenizer_vocab
    if hf_vocab < tokenizer_vocab:
        raise CheckpointConfigError(
            f"checkpoint.initial_load_path={path!r} has vocab_size={hf_vocab} in its "
            f"{HF_CONFIG}, fewer rows than the tokenizer's {tokenizer_vocab} tokens "
            f"(model.tokenizer_path={config.model.tokenizer_path!r}); use the tokenizer that "
            "came with these weights."
        )
    return hf_vocab


def check_initial_hf_load(config: JobConfig, spec: ModelSpec, *, max_seq_len: int) -> None:
    """Raise ``CheckpointConfigError`` unless the HF folder this run starts from holds the
    model it builds (module docstring); loads the tokenizer, builds on the meta device."""
    path = _starts_from_hf(config)
    if path is None:
        return
    where = f"checkpoint.initial_load_path={path!r}"
    storage = open_storage(path)
    if not storage.exists(path):
        raise CheckpointConfigError(
            f"{where} does not exist; with checkpoint.initial_load_in_hf it must be a Hugging "
            "Face model folder (config.json and *.safetensors)."
        )
    require_safetensors("checkpoint.initial_load_in_hf")
    from titan_train.tokenizer import load_tokenizer

    vocab = run_vocab_size(config, load_tokenizer(config.model.tokenizer_path).vocab_size)
    args = build_model_args(spec, config.model, vocab_size=vocab, max_seq_len=max_seq_len)
    what = f"--model.name {spec.name} --model.flavor {config.model.flavor} (vocabulary {vocab})"
    try:
        hf_config = _hf_config(storage, path)
        if hf_config is not None and takes_keyword(spec.state_dict_adapter, "hf_config"):
            # Raises for another architecture, and (a factory that compares descriptions)
            # for each field in which the folder's config.json and this run's args differ.
            described = {"model_args": args}
            if not takes_keyword(spec.state_dict_adapter, "model_args"):
                described = {}
            spec.state_dict_adapter(hf_config=hf_config, **described)
        adapter = state_dict_adapter(spec, config.model.flavor, args)
        with torch.device("meta"):
            model = spec.model_cls(args)
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if takes_keyword(spec.state_dict_adapter, "tensor_shapes"):
            _check_fields(storage, path, spec, adapter, args)
        check_hf_folder(storage, path, adapter, shapes)
    except CheckpointConfigError as error:
        raise CheckpointConfigError(f"{error} This run builds {what}. {_FIX}") from None
    except (ValueError, KeyError) as error:  # the model package's config error included
        raise CheckpointConfigError(
            f"{where} does not hold the model this run builds ({what}): {error} {_FIX}"
        ) from None


def _check_fields(storage: Any, path: str, spec: ModelSpec, adapter: Any, args: Any) -> None:
    """The factory's field-by-field check of the run's args against the folder's tensors, e.g.
    ``dim (hidden_size): expected 256 ..., found 64``."""
    from functools import partial

    from titan_ckpt.adapter import from_hf_items, plan_items, streams
    from titan_ckpt.hf import hf_files

    if not streams(adapter):
        return
    planned = plan_items(partial(from_hf_items, adapter), hf_files(storage, path).specs.items())
    spec.state_dict_adapter(
        model_args=args, tensor_shapes={k: shape for k, (shape, _) in planned.items()}
    )
