"""Document sources: the embedded corpus, local files and hub datasets, read as text in a
fixed order that can restart at any document index.

Local JSON-lines, parquet and text files are read by ``titan_train.data.local_files``: a
data-parallel rank parses only its own rows, and a restart at document ``i`` counts the
earlier rows instead of parsing them. Every other source streams (``datasets`` with
``streaming=True``): nothing is copied into a cache, a hub dataset starts without
downloading all of it, a rank's rows come from ``datasets``' own node splitting, and a
restart at document ``i`` skips ``i`` rows without tokenizing them.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from titan_train.data.config import DataConfig, DataError
from titan_train.data.embedded import (
    CHAT_SAMPLE_DATASET,
    EMBEDDED_DATASET,
    chat_sample_path,
    embedded_documents,
)
from titan_train.data.hub import hub_dataset_problem, hub_endpoint
from titan_train.data.local_files import open_hub_copy, open_local_files

__all__ = ["DocumentSource", "iter_strided", "open_documents"]

logger = logging.getLogger(__name__)

_FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".csv": "csv",
}
_COMPRESSED = {".gz", ".bz2", ".xz", ".zst"}
_HUB_ALIASES = {"c4": ("allenai/c4", "en"), "c4_test": ("allenai/c4", "en")}
_C4_TEST = os.path.join("tests", "assets", "c4_test")
"""Where torchtitan's ``c4_test`` is: a folder of its checkout, relative to the working
directory. Used when it exists there; else ``c4_test`` means C4 on the hub."""


class DocumentSource(Protocol):
    """Documents in a fixed order; the ``contiguous`` layout also needs ``iter_region(region,
    regions, first)`` (``(k, text)`` of rows ``k = first, ...`` of one of ``regions``
    contiguous runs, the others unread), and may refuse early with ``region_has_rows`` or
    ``check_regions``."""

    name: str

    def iter_from(self, index: int) -> Iterator[str]:
        """The documents from ``index`` (0-based) on; none if ``index`` is past the end."""
        ...


def iter_strided(source: DocumentSource, start: int, stride: int) -> Iterator[tuple[int, str]]:
    """``(i, text)`` of documents ``i = start, start + stride, ...``: the source's own
    ``iter_strided`` (skipping the others cheaply), else ``iter_from`` filtered."""
    own = getattr(source, "iter_strided", None)
    if own is not None:
        yield from own(start, stride)
        return
    for i, text in enumerate(source.iter_from(start), start=start):
        if (i - start) % stride == 0:
            yield i, text


class _ListSource:
    def __init__(self, name: str, documents: list[str]) -> None:
        self.name = name
        self.documents = documents

    def iter_from(self, index: int) -> Iterator[str]:
        return iter(self.documents[index:])

    def iter_strided(self, start: int, stride: int) -> Iterator[tuple[int, str]]:
        indices = range(start, len(self.documents), stride)
        return zip(indices, self.documents[start::stride], strict=True)

    def iter_region(self, region: int, regions: int, first: int) -> Iterator[tuple[int, str]]:
        """Documents ``[region N / regions, (region + 1) N / regions)`` from the ``first``-th."""
        low, high = self._bounds(region, regions)
        return enumerate(self.documents[low + first : high], start=first)

    def region_has_rows(self, region: int, regions: int) -> bool:
        low, high = self._bounds(region, regions)
        return high > low

    def _bounds(self, region: int, regions: int) -> tuple[int, int]:
        count = len(self.documents)
        return region * count // regions, (region + 1) * count // regions


class _HFSource:
    """A streaming ``datasets.IterableDataset``; ``text_column`` checked on the first row.
    With ``columns`` (chat data) a document is the row, a dict (``ChatEncoder`` reads it)."""

    def __init__(
        self,
        name: str,
        dataset: Any,
        text_column: str,
        section: str = "training",
        columns: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.dataset = dataset
        self.text_column = text_column
        self.section = section
        self.columns = columns

    def iter_from(self, index: int) -> Iterator[str]:
        rows = self.dataset.skip(index) if index else self.dataset
        return self._texts(rows)

    def iter_strided(self, start: int, stride: int) -> Iterator[tuple[int, str]]:
        """Rows ``start, start + stride, ...`` by ``datasets``' node splitting by examples (its
        "shards" strategy hands out whole files: a rank's documents would follow dp)."""
        rows = self.dataset.skip(start) if start else self.dataset
        split = _split_by_examples(rows, stride) if stride > 1 else rows
        if split is None:  # no by-example split in this datasets version: drop rows here
            return itertools.islice(zip(itertools.count(start), self._texts(rows)), 0, None, stride)
        return zip(itertools.count(start, stride), self._texts(split))

    def iter_region(self, region: int, regions: int, first: int) -> Iterator[tuple[int, str]]:
        """``iter_region`` by whole files (``datasets``' contiguous ``shard``): a rank opens
        only its shards' files."""
        return ((k, text) for k, text, _, _ in self.iter_region_states(region, regions, first))

    def iter_region_states(
        self, region: int, regions: int, first: int, state: str = ""
    ) -> Iterator[tuple[int, str, str, str]]:
        """``iter_region``'s rows as ``(k, text, before, after)`` with ``datasets``' iteration
        state around each; ``state`` (saved with row ``first``) resumes there without
        opening earlier files, else the first ``first`` rows are read past."""
        part = self.dataset.shard(num_shards=regions, index=region, contiguous=True)
        if state:
            part.load_state_dict(json.loads(state))
        rows = iter(part)
        k = first if state else 0
        before = state
        for text in self._texts(rows):
            after = json.dumps(part.state_dict())
            if k >= first:
                yield k, text, before, after
            before, k = after, k + 1

    def check_regions(self, regions: int) -> None:
        """Refuse ``regions`` contiguous runs where the dataset has fewer files: its rows are
        dealt to regions by whole files."""
        files = _num_files(self.dataset)
        if files < regions:
            raise DataError(
                f"dataset {self.name!r} is read by datasets' streaming reader in {files} "
                f"file(s), and the contiguous shard layout gives each of the {regions} data "
                f"shards whole files of it, so it needs at least as many files as shards. "
                f"Set training.data_shards to at most {files}, or training.data_shard_layout "
                "= 'interleaved' (every shard gets every data_shards-th row)."
            )

    def _texts(self, rows: Any) -> Iterator[str]:
        if self.columns:  # chat rows, checked by the encoder, which knows their indices
            yield from (dict(row) for row in rows)  # type: ignore[misc]
            return
        for row in rows:
            try:
                text = row[self.text_column]
            except KeyError:
                raise DataError(
                    f"dataset {self.name!r} has no column {self.text_column!r}; its columns are "
                    f"{sorted(row)}. Set {self.section}.text_column to one of them."
                ) from None
            yield text if isinstance(text, str) else str(text)


def _num_files(dataset: Any) -> int:
    """The data sources (files) of a streaming dataset, as ``datasets`` shards it."""
    count = getattr(dataset, "num_shards", None)
    return int(count if count is not None else dataset.n_shards)


def _split_by_examples(rows: Any, stride: int) -> Any:
    """Rows 0, stride, 2 stride, ... of ``rows`` through ``split_dataset_by_node``; ``None``
    where the installed ``datasets`` would split by files instead (before its ``strategy``)."""
    from datasets.distributed import split_dataset_by_node

    try:
        return split_dataset_by_node(rows, rank=0, world_size=stride, strategy="examples")
    except TypeError:
        if rows.num_shards % stride:  # "auto" splits by examples then
            return split_dataset_by_node(rows, rank=0, world_size=stride)
        return None


def _format_of(path: Path) -> str | None:
    """The builder for a data file by its extension (``.json.gz`` counts as ``.json``)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return _FORMATS.get(suffixes[-1]) if suffixes else None


def _local_files(path: Path, fmt: str | None) -> tuple[str, list[str]]:
    """The ``datasets`` builder name and the sorted data files of a local file or folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    found = {_format_of(p) for p in files} - {None}
    if fmt is None:
        if len(found) != 1:
            kinds = ", ".join(sorted(_FORMATS))
            what = "files of several formats" if found else f"no {kinds} files"
            raise DataError(f"{os.fspath(path)!r} holds {what}; give one format ({kinds}).")
        fmt = found.pop()
    chosen = [os.fspath(p) for p in files if _format_of(p) == fmt or path.is_file()]
    if not chosen:
        raise DataError(f"{os.fspath(path)!r} holds no {fmt} files.")
    return fmt, chosen


def _load_streaming(builder: str, **kwargs: Any) -> Any:
    import datasets

    return datasets.load_dataset(builder, split="train", streaming=True, **kwargs)


def _by_rank(source: Any) -> Any:
    logger.info(
        "reading %r by data-parallel rank: %d %s file(s), each rank parses only its rows",
        source.name,
        len(source.files),
        type(source).__name__.removesuffix("Source"),
    )
    return source


def open_documents(config: DataConfig) -> DocumentSource:
    """The document source ``config.dataset`` / ``config.dataset_path`` name."""
    name, path = config.dataset, config.dataset_path
    columns = config.chat_columns if config.dataset_format == "chat" else ()
    if name == EMBEDDED_DATASET and not path:
        if columns:
            raise DataError(
                f"{config.section}.dataset='embedded' is text (Python's documentation), not chat "
                f"data; use {config.section}.dataset='{CHAT_SAMPLE_DATASET}' (the shipped chat "
                f"sample) or your own, or {config.section}.dataset_format='text'."
            )
        return _ListSource(EMBEDDED_DATASET, embedded_documents())
    if name == CHAT_SAMPLE_DATASET and not path:
        name = os.fspath(chat_sample_path())

    fmt = name if name in set(_FORMATS.values()) else None
    hub_name, subset = _HUB_ALIASES.get(name, (name, None))
    if name == "c4_test" and not path and Path(_C4_TEST).is_dir():
        path = _C4_TEST  # torchtitan's: its checkout's folder, relative to the working directory
        logger.info("reading %r from %s (torchtitan's c4_test)", name, os.path.abspath(path))
    target = path or name
    local = Path(target).expanduser()
    if path and fmt is None and name != EMBEDDED_DATASET and local.is_dir():
        if (
            subset is not None
            and not (local / "README.md").is_file()
            and not (local / subset).is_dir()
        ):
            subset = None  # plain data files, not a copy of the hub repository's subsets
        # A local copy of a hub dataset's repository: datasets reads its layout and configs.
        own_rows = open_hub_copy(
            path, os.fspath(local), subset, config.text_column, config.section, columns
        )
        if own_rows is not None:  # plain jsonl or parquet files: each rank parses its rows
            return _by_rank(own_rows)
        try:
            dataset = _load_streaming(os.fspath(local), name=subset)
        except Exception as e:
            raise DataError(f"cannot read {path!r} as a copy of {hub_name!r}: {e}") from e
        return _HFSource(path, dataset, config.text_column, config.section, columns)
    if local.exists():
        builder, files = _local_files(local, fmt)
        if columns and builder in ("text", "csv"):
            raise DataError(
                f"{target!r} is {builder} files; chat data ({config.section}.dataset_format="
                "'chat') is read from rows with columns: json, jsonl or parquet files."
            )
        own_rows = open_local_files(
            target, builder, files, config.text_column, config.section, columns
        )
        if own_rows is not None:  # each rank parses only its rows
            return _by_rank(own_rows)
        kwargs: dict[str, Any] = {"data_files": files}
        if builder == "text":
            kwargs["sample_by"] = "paragraph"  # a blank line ends a document
        try:
            dataset = _load_streaming(builder, **kwargs)
        except Exception as e:  # datasets raises many kinds; the message is what matters
            raise DataError(f"cannot read {target!r} as {builder}: {e}") from e
        return _HFSource(
            target,
            dataset,
            "text" if builder == "text" else config.text_column,
            config.section,
            columns,
        )
    if path or fmt is not None or _format_of(local) or target.startswith((".", "/", "~")):
        raise DataError(
            f"{config.section}.dataset_path={target!r} does not exist; give an existing file or "
            f"folder, or {config.section}.dataset='embedded' for the built-in corpus."
            if path
            else f"{config.section}.dataset={target!r}: no such file or folder."
        )

    problem = hub_dataset_problem(hub_name)
    if problem is not None and problem[0] == "unreachable":
        raise DataError(
            f"{config.section}.dataset={target!r} is not a local file or folder, and the "
            f"Hugging Face hub is out of reach ({problem[1]}). Use {config.section}.dataset="
            "'embedded', a local json/jsonl/parquet/txt file, or a local copy of the dataset "
            f"({config.section}.dataset_path)."
        )
    if problem is not None:
        raise DataError(
            f"{config.section}.dataset={target!r} is not a local file or folder, and the "
            f"Hugging Face hub ({hub_endpoint()}) has no dataset {hub_name!r} that this "
            f"machine may read ({problem[1]}). Check the name (owner/name, as in the "
            "dataset's address on the hub); a private or gated dataset needs a token "
            f"(hf auth login, or HF_TOKEN). Or use {config.section}.dataset='embedded' or a "
            "local json/jsonl/parquet/txt file."
        )
    logger.info("loading %r from the Hugging Face hub (streaming)", hub_name)
    try:
        dataset = _load_streaming(hub_name, name=subset)
    except Exception as e:
        raise DataError(
            f"{config.section}.dataset={target!r} is not a local file or folder, and loading "
            f"{hub_name!r} from the Hugging Face hub failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Without a network use "
            f"{config.section}.dataset='embedded' or a local json/jsonl/parquet/txt file"
            + (
                f" (torchtitan's c4_test is the folder {_C4_TEST} of its checkout: run from the "
                f"checkout, or set {config.section}.dataset_path to that folder)."
                if name == "c4_test"
                else "."
            )
        ) from e
    return _HFSource(hub_name, dataset, config.text_column, config.section, columns)
