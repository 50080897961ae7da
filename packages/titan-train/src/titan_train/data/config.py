"""``DataConfig``: where documents come from and how they are cut into batches.

Keys follow torchtitan's ``[training]`` section (``dataset``, ``dataset_path``,
``seq_len``, ``local_batch_size``); ``text_column`` and ``infinite`` are titan's.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_train.errors import DataError, check_int

__all__ = ["DataConfig", "DataError"]


@dataclass(kw_only=True)
class DataConfig:
    """Documents in, ``(inputs, labels)`` batches of ``local_batch_size x seq_len`` out."""

    dataset: str = "embedded"
    """``embedded`` (Python's documentation, no files needed), a local json/jsonl/parquet/
    txt/csv file or folder, a format name (json, parquet, text, csv) with ``dataset_path``,
    or a Hugging Face hub name such as ``allenai/c4`` (``c4`` for short; needs a network)."""
    dataset_path: str | None = None
    """Where the dataset's files are, when ``dataset`` names a hub dataset or a format."""
    text_column: str = "text"
    """The column holding each document's text."""
    seq_len: int = 512
    """Tokens per sequence; documents are packed into windows of ``seq_len + 1`` tokens."""
    local_batch_size: int = 8
    """Sequences per rank per batch."""
    infinite: bool = True
    """Start over at the first document when the data runs out (counting epochs); if
    false, stop after the last complete batch."""

    def __post_init__(self) -> None:
        for key in ("seq_len", "local_batch_size"):
            check_int(f"training.{key}", getattr(self, key), minimum=1, error=DataError)
        for key in ("dataset", "text_column"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise DataError(
                    f"training.{key}={value!r} is not allowed; it must be a non-empty string."
                )
