"""The embedded corpus: the prose of Python's own documentation, shipped with every Python.

``pydoc_data.topics`` holds the text ``help()`` shows for language topics (the reference
manual's chapters on statements, operators, types, ...): about 80 documents, 0.46 MB of
English. Documents come in sorted topic order, so the corpus is the same on every rank.
"""

from __future__ import annotations

__all__ = ["EMBEDDED_DATASET", "embedded_documents"]

EMBEDDED_DATASET = "embedded"
"""The dataset name that selects this corpus."""


def embedded_documents() -> list[str]:
    """The documents of the embedded corpus, in sorted topic-name order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]
