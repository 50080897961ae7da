"""Hugging Face safetensors export and import of the model, through a ``StateDictAdapter``.

Export gathers the full (unsharded) model on rank 0, converts it with ``adapter.to_hf`` and
writes ``model.safetensors`` plus ``config.json``. Import reads every ``*.safetensors`` file of
a folder on each rank, converts back with ``adapter.from_hf`` and lets torch shard the full
tensors into the (possibly FSDP/TP) model parts.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from titan_ckpt.adapter import StateDictAdapter
from titan_ckpt.states import ModelState
from titan_ckpt.storage import Storage

__all__ = ["load_hf", "require_safetensors", "save_hf"]

HF_WEIGHTS = "model.safetensors"
HF_CONFIG = "config.json"


def require_safetensors(what: str) -> None:
    """Raise a clear ImportError unless the optional ``safetensors`` package is installed."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ImportError(
            f"{what} writes or reads safetensors files, which needs the optional dependency: "
            "pip install 'titan-ckpt[safetensors]'."
        ) from None


def save_hf(
    storage: Storage,
    directory: str,
    model: ModelState,
    adapter: StateDictAdapter,
    dtype: torch.dtype,
) -> None:
    """Write the model as a Hugging Face folder at ``directory`` (rank 0 writes; all gather)."""
    from safetensors.torch import save

    full: dict[str, Any] = {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for part in model.model_parts:
        full.update(get_model_state_dict(part, options=options))  # collective under FSDP/TP
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    hf = adapter.to_hf(full)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in hf.items()}
    storage.makedirs(directory)
    storage.write_atomic(storage.join(directory, HF_WEIGHTS), save(tensors))
    config = json.dumps(adapter.hf_config(), indent=2, sort_keys=True).encode()
    storage.write_atomic(storage.join(directory, HF_CONFIG), config)


def load_hf(storage: Storage, directory: str, model: ModelState, adapter: StateDictAdapter) -> None:
    """Load the model parts from the Hugging Face folder at ``directory``."""
    from safetensors.torch import load

    files = sorted(n for n in storage.list(directory) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"checkpoint.initial_load_path={directory!r} holds no *.safetensors files; with "
            "initial_load_in_hf=true it must be a Hugging Face model folder."
        )
    hf: dict[str, torch.Tensor] = {}
    for name in files:
        with storage.open(storage.join(directory, name), "rb") as f:
            hf.update(load(f.read()))
    native = adapter.from_hf(hf)
    claimed: set[str] = set()
    for part in model.model_parts:
        template = get_model_state_dict(part)
        missing = [k for k in template if k not in native]
        if missing:
            raise KeyError(
                f"The Hugging Face checkpoint in {directory} lacks model keys {missing[:5]} "
                f"(of {len(missing)}) after adapter.from_hf."
            )
        claimed |= template.keys()
        sd = {k: native[k].to(template[k].dtype) for k in template}
        set_model_state_dict(part, sd, options=StateDictOptions(full_state_dict=True, strict=False))
    unused = sorted(set(native) - claimed)
    if unused:
        raise KeyError(
            f"The Hugging Face checkpoint in {directory} has keys no model part owns after "
            f"adapter.from_hf: {unused[:5]} (of {len(unused)})."
        )
