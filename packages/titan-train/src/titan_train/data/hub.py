"""Is the Hugging Face hub reachable? Asked before a hub dataset is opened, so that a machine
without a network fails in about a second with one message, not after ``datasets`` and
``huggingface_hub`` spent ~25 s retrying (each retry a warning of its own).

Offline is: ``HF_HUB_OFFLINE`` or ``HF_DATASETS_OFFLINE`` set to a true value, or no TCP
connection to the hub's host (``HF_ENDPOINT``, default huggingface.co) within
``PROBE_TIMEOUT_S``. Behind a proxy (``HTTPS_PROXY`` and friends) the direct probe says
nothing, so none is made and ``datasets`` finds out itself.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

__all__ = ["PROBE_TIMEOUT_S", "hub_unreachable"]

PROBE_TIMEOUT_S = 1.0
_DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "true", "yes", "on"}


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from here (a short phrase), or ``None`` when it may be."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").strip().lower() in _TRUE:
            return f"{variable} is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT)
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return f"no connection to {host}:{port} ({reason})"
