"""The ``titan-ckpt`` command (``cli.main``) and the library functions behind its subcommands
(``inspect_path``, ``verify_path``, ``diff_paths``, ``convert``), which read any checkpoint
through ``open_source``: every format as a ``Source`` (``titan_ckpt.formats.base``).
"""

from __future__ import annotations

import os

from titan_ckpt.errors import CheckpointFormatError
from titan_ckpt.formats.base import Source
from titan_ckpt.formats.dcp import DCP_METADATA, DcpSource
from titan_ckpt.formats.safetensors import SafetensorsSource
from titan_ckpt.formats.torch_save import TorchSource
from titan_ckpt.layout import COMMIT_MARKER, step_of

__all__ = ["detect", "open_source"]


def detect(path: str) -> str:
    """``dcp``, ``safetensors``, ``hf``, ``torch`` or ``folder`` (of ``step-<N>`` dirs)."""
    if not os.path.exists(path):
        raise CheckpointFormatError(f"{path} does not exist.")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return "safetensors"
        return "torch"
    names = os.listdir(path)
    if DCP_METADATA in names or COMMIT_MARKER in names or any(n.endswith(".distcp") for n in names):
        return "dcp"
    if any(n.endswith(".safetensors") for n in names):
        return "hf" if "config.json" in names else "safetensors"
    if any(step_of(n) is not None for n in names):
        return "folder"
    raise CheckpointFormatError(
        f"{path} is not a checkpoint: no .metadata (DCP), *.safetensors, or step-<N>/ "
        "directories in it. Pass a step directory, a checkpoint folder, a safetensors file or "
        "folder, or a torch.save file."
    )


def open_source(path: str, *, trust_pickles: bool = False) -> Source:
    """Open ``path`` for reading by its detected format (not a folder of steps); a DCP
    step's pickles are unpickled under the allowlist of ``safe_pickle`` unless
    ``trust_pickles``."""
    kind = detect(path)
    if kind == "dcp":
        return DcpSource(path, trust_pickles=trust_pickles)
    if kind in ("safetensors", "hf"):
        return SafetensorsSource(path)
    if kind == "torch":
        return TorchSource(path)
    raise CheckpointFormatError(
        f"{path} is a checkpoint folder (step-<N>/ directories); pass one step, e.g. "
        f"{os.path.join(path, 'step-<N>')}."
    )
