"""``DataSource`` and ``DataConfig``: where documents come from and how they are cut into
batches.

Keys follow torchtitan's ``[training]`` section; ``text_column`` and ``infinite`` are
titan's. The trainer's ``[training]`` and ``[validation]`` sections extend ``DataSource``,
and each turns into a ``DataConfig`` (``data_config``) that names its section in errors.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import ClassVar, Literal

from titan_train.errors import DataError, check_choice, check_int

__all__ = ["IGNORE_INDEX", "DataConfig", "DataError", "DataSource", "DatasetEntry", "check_mixture"]

IGNORE_INDEX = -100
"""The label of a token the loss does not train on (a chat prompt's); torch's
``cross_entropy`` skips it by default."""

DATASET_FORMATS = ("text", "chat")
TRAIN_ON = ("assistant", "last_assistant", "all")

SHARD_LAYOUTS = ("interleaved", "contiguous")
"""How documents are dealt to the virtual shards (``titan_train.data.shards``): document
``i`` to shard ``i mod S``, or shard ``s`` the ``s``-th of ``S`` contiguous runs of the
corpus."""


@dataclass(kw_only=True)
class DataSource:
    """Where documents come from: the keys ``[training]`` and ``[validation]`` share."""

    SECTION: ClassVar[str] = "training"
    """The config section these keys are set in (errors name it)."""

    dataset: str = "embedded"
    """``embedded`` (Python's documentation, no files needed), a local json/jsonl/parquet/
    txt/csv file or folder, a format name (json, parquet, text, csv) with ``dataset_path``,
    or a Hugging Face hub name such as ``allenai/c4`` (``c4`` for short; needs a network).
    ``c4_test`` is torchtitan's ``tests/assets/c4_test`` folder where the working directory
    has one (as in a torchtitan checkout), else C4 on the hub."""
    dataset_path: str | None = None
    """Where the dataset's files are, when ``dataset`` names a hub dataset or a format: a
    local copy of the hub repository, or a folder of plain data files (e.g. JSON lines with
    a ``text`` field), read as they are."""
    text_column: str = "text"
    """The column holding each document's text."""
    dataset_format: Literal["text", "chat"] = "text"
    """``text``: documents to pretrain on, every token trained; ``chat``: conversations
    (``messages_column``, or ``prompt_column`` and ``response_column``) rendered with
    ``chat_template``, the loss on the tokens ``train_on`` names. Not a torchtitan key."""
    chat_template: str | None = None
    """Chat data: the template; empty: the tokenizer folder's (``chat_template.jinja`` or
    ``tokenizer_config.json``'s ``chat_template``), else a built-in (``llama3``,
    ``qwen3``) or a path to a .jinja file."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """Chat data: the tokens the loss trains on: every assistant turn (its end-of-turn token
    included), the last assistant turn, or all tokens."""
    messages_column: str = "messages"
    """Chat data: the column holding each row's conversation, a list of ``{"role": ...,
    "content": ...}``."""
    prompt_column: str | None = None
    """Chat data given as one exchange per row: the column of the user's prompt (set with
    ``response_column``; then ``messages_column`` is not read)."""
    response_column: str | None = None
    """Chat data given as one exchange per row: the column of the assistant's response."""

    @property
    def section(self) -> str:
        """The config section these keys are set in (errors name it)."""
        return self.SECTION

    @property
    def chat_columns(self) -> tuple[str, ...]:
        """The columns a chat row is read from: ``(messages,)`` or ``(prompt, response)``."""
        if self.prompt_column is not None:
            return (self.prompt_column, str(self.response_column))
        return (self.messages_column,)

    def __post_init__(self) -> None:
        for key in ("dataset", "text_column", "messages_column"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise DataError(
                    f"{self.section}.{key}={value!r} is not allowed; it must be a non-empty string."
                )
        section = self.section
        for key, allowed in (("dataset_format", DATASET_FORMATS), ("train_on", TRAIN_ON)):
            check_choice(f"{section}.{key}", getattr(self, key), allowed, error=DataError)
        for key in ("chat_template", "prompt_column", "response_column"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise DataError(
                    f"{section}.{key}={value!r} is not allowed; it must be a non-empty string "
                    "or unset."
                )
        if (self.prompt_column is None) != (self.response_column is None):
            raise DataError(
                f"{section}.prompt_column={self.prompt_column!r} and "
                f"{section}.response_column={self.response_column!r}: set both (rows of one "
                f"exchange) or neither (rows of {section}.messages_column)."
            )

    def data_config(
        self,
        *,
        seq_len: int,
        local_batch_size: int,
        infinite: bool,
        num_shards: int = 1,
        prefetch: int = 0,
        shard_layout: str = "interleaved",
    ) -> DataConfig:
        """These documents cut into batches of ``local_batch_size x seq_len``."""
        return DataConfig(
            dataset=self.dataset,
            dataset_path=self.dataset_path,
            text_column=self.text_column,
            dataset_format=self.dataset_format,
            chat_template=self.chat_template,
            train_on=self.train_on,
            messages_column=self.messages_column,
            prompt_column=self.prompt_column,
            response_column=self.response_column,
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            infinite=infinite,
            num_shards=num_shards,
            prefetch=prefetch,
            shard_layout=shard_layout,
            source_section=self.section,
        )


@dataclass(kw_only=True)
class DataConfig(DataSource):
    """Documents in, ``(inputs, labels)`` batches of ``local_batch_size x seq_len`` out."""

    seq_len: int = 512
    """Tokens per sequence; documents are packed into windows of ``seq_len + 1`` tokens."""
    local_batch_size: int = 8
    """Sequences per rank per batch."""
    infinite: bool = True
    """Start over at the first document when the data runs out (counting epochs); if
    false, stop after the last complete batch."""
    num_shards: int = 1
    """Virtual shards the documents are dealt into (document i to shard i mod num_shards);
    the batches depend on it, not on the data-parallel degree, and each rank tokenizes
    1/gcd(dp, num_shards) of the documents. 1: one stream every rank reads whole."""
    prefetch: int = 0
    """Batches a background thread tokenizes and packs ahead; 0: none, made when asked."""
    shard_layout: str = "interleaved"
    """How documents are dealt to the shards: ``interleaved`` (document i to shard i mod
    num_shards) or ``contiguous`` (shard s is the s-th of num_shards contiguous runs of the
    corpus, so a rank reads only its part of the files: by bytes for local JSON lines and
    text, by rows for parquet and the embedded corpus, by whole files for what ``datasets``
    streams)."""
    source_section: str = "training"
    """The config section a user sets these keys in, named by errors (``training`` or
    ``validation`` for the trainer's)."""

    @property
    def section(self) -> str:
        return self.source_section

    def __post_init__(self) -> None:
        for key in ("seq_len", "local_batch_size"):
            check_int(f"{self.section}.{key}", getattr(self, key), minimum=1, error=DataError)
        check_int(f"{self.section}.data_shards", self.num_shards, minimum=1, error=DataError)
        check_int(f"{self.section}.data_prefetch", self.prefetch, minimum=0, error=DataError)
        if self.shard_layout not in SHARD_LAYOUTS:
            raise DataError(
                f"{self.section}.data_shard_layout={self.shard_layout!r} is not allowed; use "
                f"one of {', '.join(map(repr, SHARD_LAYOUTS))}."
            )
        super().__post_init__()


@dataclass(kw_only=True)
class DatasetEntry(DataSource):
    """One ``[[training.datasets]]`` entry of a weighted mixture: every key of a
    ``DataSource`` (so whatever a single dataset can say, an entry can), plus its weight."""

    SECTION: ClassVar[str] = "training.datasets"

    dataset: str = ""
    """As ``training.dataset``; required here (an entry without a source is refused)."""
    weight: float = 1.0
    """This source's share of the training windows (tokens): weight / the sum of the
    weights. 0 keeps the entry without reading it."""
    name: str = ""
    """The name of this source in the metrics (``tokens_seen/<name>``); empty: the last
    part of ``dataset`` (or of ``dataset_path``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset.strip():
            raise DataError(
                "a [[training.datasets]] entry has no source: set its dataset = 'embedded', a "
                "local json/jsonl/parquet/txt file or folder, or a Hugging Face hub name."
            )
        weight = self.weight
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not (math.isfinite(weight) and weight >= 0)
        ):
            raise DataError(
                f"[[training.datasets]] entry {self.dataset!r} has weight = {weight!r}; a "
                "weight must be a finite number >= 0 (its share is weight / the sum)."
            )
        super().__post_init__()

    @property
    def label(self) -> str:
        """The name of this source in the metrics."""
        if self.name:
            return self.name
        where = (self.dataset_path or self.dataset).rstrip("/\\")
        return where.replace("\\", "/").rsplit("/", 1)[-1] or where


def check_mixture(single: DataSource, entries: list[DatasetEntry]) -> None:
    """Refuse a mixture whose weights do not sum to a positive number, or given with
    single-source keys changed from their defaults."""
    if not entries:
        return
    set_keys = [
        f.name
        for f in fields(DataSource)
        if f.init
        and getattr(single, f.name)
        != (
            f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        )
    ]
    if set_keys:
        keys = ", ".join(f"{single.section}.{k}" for k in set_keys)
        raise DataError(
            f"[[training.datasets]] is given together with {keys}: a run reads either one "
            "dataset or a mixture. Move those keys into the [[training.datasets]] entries "
            "(each takes them) or drop the entries."
        )
    total = sum(e.weight for e in entries)
    if not total > 0:
        raise DataError(
            f"the [[training.datasets]] weights sum to {total!r}; they must sum to a positive "
            "number (give at least one entry a weight > 0)."
        )
    labels = [e.label for e in entries]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise DataError(
            f"[[training.datasets]] entries share the name(s) {twice}; give each a distinct "
            "name = '...' (it names the source in the metrics)."
        )
