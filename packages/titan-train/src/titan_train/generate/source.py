"""Where ``titan-train generate`` takes its model from: ``resolve_source`` reads what
``--checkpoint.path`` is (a titan or torchtitan DCP step, a checkpoint folder, a Hugging Face
folder, or nothing for random weights) and which model it holds, from small files only (the
commit manifest's model record, config.json), before any model is built."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from titan_ckpt.layout import classify_step, committed_steps, read_manifest, step_name
from titan_ckpt.storage import LocalStorage
from titan_models import ModelSpec
from titan_train.config.registry import load_model_spec
from titan_train.errors import ConfigError

__all__ = ["HF_MODEL_TYPES", "GenerateCheckpoint", "GenerateModel", "Source", "resolve_source"]

# Hugging Face ``model_type`` -> titan model name, for an HF folder without --model.name.
HF_MODEL_TYPES = {"llama": "llama3", "deepseek_v3": "deepseek_v3", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3"}  # fmt: skip


@dataclass(kw_only=True)
class GenerateModel:
    """Which model (for random weights, or a checkpoint that records none) and tokenizer."""

    name: str | None = None
    """A registered model (titan-train list-models); default: the checkpoint's record, the HF
    config's model_type, else llama3."""
    flavor: str | None = None
    """The flavor for random weights or an unrecorded checkpoint; default debugmodel."""
    tokenizer_path: str | None = None
    """A tiktoken BPE file or tokenizer.json (or a folder holding one); default: the one the
    checkpoint records, the HF folder's own, else the shipped tokenizer."""


@dataclass(kw_only=True)
class GenerateCheckpoint:
    """Where the weights come from."""

    path: str | None = None
    """A titan DCP step folder, a checkpoint folder (its newest committed step) or a Hugging
    Face folder (config.json + safetensors); empty: random weights."""
    trust_pickles: bool = False
    """Unpickle the checkpoint's metadata without titan-ckpt's allowlist (only for
    checkpoints you made yourself with custom objects: their pickles can run code)."""


@dataclass(kw_only=True)
class Source:
    """Where the model comes from and how it is described."""

    kind: str
    """``dcp`` (a titan or torchtitan step), ``hf`` (a Hugging Face folder) or ``random``."""
    path: str | None
    spec: ModelSpec
    flavor: str
    args: dict[str, Any] | None = None
    """The model's real args (recorded, or read from config.json); None: the flavor's."""
    adapter: Any = None
    """The HF state-dict adapter (``hf`` only)."""
    tokenizer_path: str | None = None
    """The tokenizer the source names (recorded with the run, or the HF folder's)."""


def resolve_source(checkpoint: GenerateCheckpoint, model: GenerateModel) -> Source:
    """What ``--checkpoint.path`` is and which model it holds (reads only small files)."""
    path = checkpoint.path
    if not path:
        name = model.name or "llama3"
        spec, flavor = load_model_spec(name), _flavor(name, model)
        return Source(kind="random", path=None, spec=spec, flavor=flavor)
    if not os.path.exists(path):
        raise ConfigError(
            f"--checkpoint.path {path} does not exist. Give a titan checkpoint step folder "
            "(e.g. outputs/checkpoint/step-100), a checkpoint folder, or a Hugging Face "
            "folder (config.json + safetensors); leave it out for random weights."
        )
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return _hf_source(path, model)
    step = _step_folder(path)
    if step is None:
        raise ConfigError(
            f"--checkpoint.path {path} is neither a DCP checkpoint step (a step-<N> folder "
            "with a .metadata file, or a folder of committed steps) nor a Hugging Face "
            "folder (config.json + safetensors)."
        )
    kind = classify_step(LocalStorage(), step)
    if kind not in ("committed", "torchtitan"):
        raise ConfigError(
            f"{step} is a DCP step that cannot be loaded: "
            + (
                "titan began saving it but never committed it (an interrupted save); give "
                "an older committed step or the checkpoint folder."
                if kind == "interrupted"
                else "titan did not write it and it is no torchtitan checkpoint."
            )
        )
    manifest = read_manifest(LocalStorage(), step)
    record = (manifest.metadata.get("model") if manifest is not None else None) or {}
    name = record.get("name")
    if name and model.name and model.name != name:
        raise ConfigError(
            f"{step} holds a {name} model (its record), not --model.name {model.name}; "
            "leave --model.name out or give a checkpoint of that model."
        )
    flavor = record.get("flavor")
    if flavor and model.flavor and model.flavor != flavor:
        raise ConfigError(
            f"{step} holds {name} {flavor} (its record), not --model.flavor {model.flavor}; "
            "leave --model.flavor out: the record describes the model."
        )
    name = name or model.name or "llama3"
    args = record.get("args") if isinstance(record.get("args"), dict) else None
    return Source(
        kind="dcp",
        path=step,
        spec=load_model_spec(name),
        flavor=flavor or _flavor(name, model),
        args=args,
        tokenizer_path=record.get("tokenizer_path"),
    )


def _flavor(name: str, model: GenerateModel) -> str:
    flavors = load_model_spec(name).flavors
    return model.flavor or ("debugmodel" if "debugmodel" in flavors else next(iter(flavors)))


def _step_folder(path: str) -> str | None:
    """The DCP step ``path`` is, or the newest committed step of the folder ``path``."""
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    storage = LocalStorage()
    steps = committed_steps(storage, path)
    return os.path.join(path, step_name(steps[-1])) if steps else None


def _hf_source(path: str, model: GenerateModel) -> Source:
    try:
        with open(os.path.join(path, "config.json")) as f:
            hf_config = json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}/config.json is not readable JSON: {error}") from error
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):
        raise ConfigError(f"{path} has a config.json but no .safetensors weights.")
    model_type = hf_config.get("model_type")
    name = model.name or HF_MODEL_TYPES.get(str(model_type))
    if name is None:
        raise ConfigError(
            f"{path}/config.json has model_type {model_type!r}, which no titan model is known "
            f"to read ({', '.join(sorted(HF_MODEL_TYPES))}); name the model with --model.name."
        )
    spec = load_model_spec(name)
    try:
        adapter = spec.state_dict_adapter(hf_config=hf_config)
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"{path}/config.json does not describe a {name} model: {error}"
        ) from error
    args = adapter.model_args() if callable(getattr(adapter, "model_args", None)) else None
    has_tokenizer = any(
        os.path.isfile(os.path.join(path, n))
        for n in ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")
    )
    return Source(
        kind="hf",
        path=path,
        spec=spec,
        flavor=_flavor(name, model),
        args=args,
        adapter=adapter,
        tokenizer_path=path if has_tokenizer else None,
    )
