"""The embedded corpus: the prose of Python's own documentation, shipped with every Python;
and the chat sample titan-train ships for supervised fine-tuning (``chat_sample``).

``pydoc_data.topics`` holds the text ``help()`` shows for language topics (the reference
manual's chapters on statements, operators, types, ...): about 80 documents, 0.46 MB of
English. Documents come in sorted topic order, so the corpus is the same on every rank.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["CHAT_SAMPLE_DATASET", "EMBEDDED_DATASET", "chat_sample_path", "embedded_documents"]

EMBEDDED_DATASET = "embedded"
"""The dataset name that selects this corpus."""

CHAT_SAMPLE_DATASET = "chat_sample"
"""The dataset name that selects the shipped chat sample (``chat_sample_path``)."""


def embedded_documents() -> list[str]:
    """The documents of the embedded corpus, in sorted topic-name order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def chat_sample_path() -> Path:
    """The shipped chat sample: 400 short synthetic conversations, one ``{"messages":
    [...]}`` per line, made by ``tools/make_chat_sample.py`` (for SFT examples and tests)."""
    return Path(str(resources.files("titan_train") / "assets" / "chat_sample.jsonl"))
