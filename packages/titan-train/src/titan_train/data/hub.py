"""Can a hub dataset be streamed from here? Asked before ``datasets`` opens it, so that a
machine without a network, or a name the hub does not have, fails within seconds with one
message, not after ~25 s of ``datasets`` and ``huggingface_hub`` retrying.

``hub_dataset_problem`` asks once each, without retries: offline (``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE``, or no TCP connection to ``HF_ENDPOINT`` within ``PROBE_TIMEOUT_S``,
skipped behind a proxy); then the dataset's metadata within ``ANSWER_TIMEOUT_S``: 401, 403
or 404 mean no such dataset for this machine (a typo, or private/gated without a token),
any other failure means out of reach.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Literal
from urllib.parse import quote, urlsplit

__all__ = [
    "ANSWER_TIMEOUT_S",
    "PROBE_TIMEOUT_S",
    "hub_dataset_problem",
    "hub_endpoint",
    "hub_unreachable",
]

PROBE_TIMEOUT_S = 1.0
ANSWER_TIMEOUT_S = 3.0
_DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "true", "yes", "on"}
_NOT_THERE = (401, 403, 404)  # the hub answers 401 for a missing repo to anonymous callers


def hub_endpoint() -> str:
    """The hub's address: ``HF_ENDPOINT`` as set now, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from here (a short phrase), or ``None`` when it may be."""
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(variable, "").strip().lower() in _TRUE:
            return f"{variable} is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urlsplit(hub_endpoint())
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as error:
        reason = error.strerror or type(error).__name__
        return f"no connection to {host}:{port} ({reason})"


def hub_dataset_problem(
    repo_id: str,
) -> tuple[Literal["unreachable", "missing"], str] | None:
    """``None`` when the hub serves ``repo_id``; else ``("unreachable", why)`` or
    ``("missing", why)``. One request, no retries, the hub loggers quiet."""
    offline = hub_unreachable()
    if offline is not None:
        return "unreachable", offline
    endpoint = hub_endpoint()
    request = urllib.request.Request(
        f"{endpoint}/api/datasets/{quote(repo_id, safe='/')}?expand=sha", headers=_headers()
    )
    try:
        with _quiet_hub_loggers(), urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S):
            return None
    except urllib.error.HTTPError as error:
        if error.code in _NOT_THERE:
            return "missing", f"HTTP {error.code}"
        return "unreachable", f"HTTP {error.code} from {endpoint}"
    except (OSError, ValueError) as error:  # URLError, timeouts, a malformed HF_ENDPOINT
        reason = getattr(error, "reason", None) or error
        return "unreachable", f"no answer from {endpoint}: {reason}"


def _headers() -> dict[str, str]:
    """The user's token (``HF_TOKEN`` or ``hf auth login``), as ``datasets`` would send it."""
    try:
        from huggingface_hub.utils import build_hf_headers

        with _quiet_hub_loggers():
            return dict(build_hf_headers())
    except Exception:  # no usable token setup: ask anonymously
        return {}


@contextlib.contextmanager
def _quiet_hub_loggers() -> Iterator[None]:
    """``huggingface_hub`` and ``datasets`` log at ERROR only, for the duration."""
    loggers = [logging.getLogger(name) for name in ("huggingface_hub", "datasets")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
