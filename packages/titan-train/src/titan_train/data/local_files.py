"""Local JSON-lines, parquet and text files read by data-parallel rank: a rank parses only its
own rows (``datasets``' streaming readers parse every row and then drop other ranks').

Same documents, order and indices as ``datasets``; other ranks' rows stay bytes:
JSON lines are read in ~8 MB chunks cut at line ends, newlines found in one vectorized pass,
only this rank's lines ``json.loads``-ed (blank lines are not rows, as in ``datasets``); text
(``.txt``, ``.md``) is split into paragraphs on the bytes; parquet row groups without this
rank's rows are skipped (row counts from the metadata), only the text column read. A resume
counts earlier rows without parsing them. Hub copies are read so too (``open_hub_copy``);
compressed files, non-line JSON and csv keep ``datasets``' reader (``None``).

Region ``s`` of ``S`` (``iter_region``, the ``contiguous`` layout): the rows whose first byte
lies in ``[s B / S, (s + 1) B / S)`` of the files' ``B`` bytes (JSON lines, text), or rows
``[s N / S, (s + 1) N / S)`` of ``N`` (parquet), read from its own bytes alone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

from titan_train.data.chat import chat_row
from titan_train.data.config import DataError

__all__ = [
    "JsonLinesSource",
    "ParquetSource",
    "TextSource",
    "open_hub_copy",
    "open_local_files",
]

_CHUNK = 8 << 20
"""Bytes read at a time (then to the end of the line)."""
_REGION_CHUNK = 1 << 20
"""Bytes a region reads at a time (each shard holds one: 64 MiB for 64 shards at dp 1)."""
_SCHEMA_CHUNK = 10 << 20
"""``datasets`` infers a JSON file's columns from its first 10 MB (then to the line end)."""
_BATCH = 8192
"""Parquet rows decoded at a time."""
_BOM = b"\xef\xbb\xbf"
_WS = (32, 9, 13)
"""Space, tab, CR: the bytes a blank line (which pyarrow skips) may hold."""
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")
_PARAGRAPH_BREAK = re.compile(rb"(?:\r\n?+|\n)(?:\r\n?+|\n)")
"""Two line ends: what ends a paragraph, on raw bytes (``\n?+`` is possessive, so that
``\r\n`` is one line end, never a ``\r`` and a ``\n``)."""


def _one_line_end(text: bytes) -> bytes:
    """``text`` with ``\r\n`` and ``\r`` read as ``\n``."""
    return text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def open_local_files(
    name: str,
    builder: str,
    files: list[str],
    text_column: str,
    section: str,
    columns: tuple[str, ...] = (),
) -> _RowSource | None:
    """The rank-aware source of local ``files`` of ``builder``'s format, or ``None`` where
    ``datasets``' reader must stay. With ``columns`` (chat data) a document is a dict."""
    if any(f.endswith(_COMPRESSED) for f in files):
        return None
    if builder == "parquet":
        return ParquetSource(name, files, text_column, section, columns)
    if builder == "text":
        return TextSource(name, files, "text", section)
    if builder == "json" and all(_is_json_lines(f) for f in files):
        return JsonLinesSource(name, files, text_column, section, columns)
    return None


def open_hub_copy(
    name: str,
    path: str,
    subset: str | None,
    text_column: str,
    section: str,
    columns: tuple[str, ...] = (),
) -> _RowSource | None:
    """The rank-aware source of a local hub dataset copy whose ``train`` files (as ``datasets``
    resolves them) are plain jsonl or parquet; else ``None``."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(path, name=subset)
    except Exception:  # datasets' reader says what is wrong, with today's message
        return None
    config, features = builder.config, builder.info.features
    files = list((config.data_files or {}).get("train") or [])
    if builder.name not in ("json", "parquet") or not files:
        return None
    if not all(isinstance(f, str) and os.path.isfile(f) for f in files):
        return None
    # Options that change which rows or values datasets gives: keep its reader.
    if any(getattr(config, key, None) for key in ("field", "filters", "columns")):
        return None
    text = features.get(text_column) if features is not None and not columns else None
    if text is not None and getattr(text, "dtype", None) not in ("string", "large_string"):
        return None
    return open_local_files(name, builder.name, files, text_column, section, columns)


def _is_json_lines(path: str) -> bool:
    """Whether ``path``'s first non-blank line is one JSON object (or it has none)."""
    with open(path, "rb") as f:
        head = f.read(1 << 16).removeprefix(_BOM)
        while head and not head.strip(b" \t\r\n"):
            head = f.read(1 << 16)
        if not head:
            return True
        head = head.lstrip(b" \t\r\n")
        if not head.startswith(b"{"):  # an array, or not JSON: not read as lines here
            return False
        line = head.split(b"\n", 1)[0] if b"\n" in head else head + f.readline()
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


class _RowSource:
    """Documents ``i = start, start + stride, ...`` of the rows over all files in order;
    subclasses read one file's rows."""

    def __init__(
        self,
        name: str,
        files: list[str],
        text_column: str,
        section: str,
        columns: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.files = files
        self.text_column = text_column
        self.section = section
        self.columns = columns
        """Chat data: the columns a document is read from (a dict of them); else text."""
        self.rows_parsed = 0
        """Rows turned into text so far (all iterators together): what this rank parsed."""
        self.bytes_read = 0
        """Bytes of the files read so far by ``iter_region`` (JSON lines only)."""

    def iter_from(self, index: int) -> Iterator[str]:
        """The documents from ``index`` on (earlier rows counted, not parsed)."""
        return (text for _, text in self.iter_strided(index, 1))

    def iter_strided(self, start: int, stride: int) -> Iterator[tuple[int, str]]:
        """``(i, text)`` of documents ``i = start, start + stride, ...``, the others unparsed."""
        if start < 0 or stride < 1:
            raise ValueError(f"start={start}, stride={stride}: need start >= 0, stride >= 1")
        first, want = 0, start  # index of the file's first row; the next index to yield
        for path in self.files:
            for count, texts in self._file_rows(path, first, want, stride):
                self.rows_parsed += len(texts)
                for text in texts:
                    yield want, text
                    want += stride
                first += count

    def _file_rows(
        self, path: str, first: int, want: int, stride: int
    ) -> Iterator[tuple[int, list[str]]]:
        """Per piece of ``path`` (first row ``first``): its row count and rows ``want, want +
        stride, ...`` in it."""
        raise NotImplementedError

    def iter_region(self, region: int, regions: int, first: int) -> Iterator[tuple[int, str]]:
        """``(k, text)`` of rows ``k = first, ...`` of one of ``regions``: earlier rows counted, not
        parsed; of other regions only the ends of rows crossing its edges read."""
        row = 0  # the region's next row
        for path, begin, end in self._byte_spans(region, regions):
            for rows in self._region_rows(path, begin, end, _REGION_CHUNK):
                if row + len(rows) > first:  # else before the resume point: only counted
                    for k in range(max(first - row, 0), len(rows)):
                        self.rows_parsed += 1
                        yield row + k, self._row_text(rows[k], path, row + k)
                row += len(rows)

    def region_has_rows(self, region: int, regions: int) -> bool:
        """Whether a region holds a row, read a line at a time from its start."""
        spans = self._byte_spans(region, regions)
        return any(rows for path, a, b in spans for rows in self._region_rows(path, a, b, 1))

    def _byte_spans(self, region: int, regions: int) -> list[tuple[str, int, int]]:
        """``(path, begin, end)``: the bytes of each file inside the region's share of all."""
        sizes = [os.path.getsize(path) for path in self.files]
        total = sum(sizes)
        low, high = region * total // regions, (region + 1) * total // regions
        spans, base = [], 0  # base: the file's first byte among all
        for path, size in zip(self.files, sizes, strict=True):
            begin, end = max(low - base, 0), min(high - base, size)
            if begin < end:
                spans.append((path, begin, end))
            base += size
        return spans

    def _region_rows(self, path: str, begin: int, end: int, size: int) -> Iterator[list[bytes]]:
        """The raw rows of ``path`` starting in ``[begin, end)``, ~``size`` bytes at a time."""
        raise NotImplementedError

    def _row_text(self, raw: bytes, path: str, index: int) -> str:
        """The document of the raw row ``raw`` (document ``index`` of its region)."""
        raise NotImplementedError

    def _text(self, value: Any) -> str:
        return value if isinstance(value, str) else str(value)

    def _no_column(self, columns: list[str]) -> DataError:
        """The error ``datasets``' path raises for a missing text column."""
        return DataError(
            f"dataset {self.name!r} has no column {self.text_column!r}; its columns are "
            f"{sorted(columns)}. Set {self.section}.text_column to one of them."
        )


class JsonLinesSource(_RowSource):
    """Local JSON-lines files, a document per non-blank line; a row without the text column
    gives ``"None"`` if the column is in the first 10 MB (as ``datasets``), else its error."""

    _columns: list[str] | None = None
    """The columns ``datasets`` would infer (``_first_columns``), once found."""

    def _file_rows(
        self, path: str, first: int, want: int, stride: int
    ) -> Iterator[tuple[int, list[str]]]:
        for chunk in _chunks(path, _CHUNK):
            starts, ends = _row_bounds(chunk)
            count = len(starts)
            if want >= first + count:  # no row of this rank
                yield count, []
                first += count
                continue
            own = slice(want - first, None, stride)
            bounds = zip(starts[own].tolist(), ends[own].tolist(), strict=True)
            texts = [  # only these rows are parsed; the others stay bytes
                self._parse(chunk[a:b], path, want + k * stride) for k, (a, b) in enumerate(bounds)
            ]
            yield count, texts
            first, want = first + count, want + stride * len(texts)

    def _region_rows(self, path: str, begin: int, end: int, size: int) -> Iterator[list[bytes]]:
        """The non-blank lines of ``path`` starting in ``[begin, end)``, a list per ~``size``
        bytes of whole lines."""
        with open(path, "rb") as f:
            if begin > 0:
                f.seek(begin - 1)
                if f.read(1) != b"\n":
                    self.bytes_read += len(f.readline())  # a row that started before begin
            position = f.tell()
            while position < end:
                chunk = f.read(min(size, end - position))
                if not chunk:
                    break
                if not chunk.endswith(b"\n"):
                    chunk += f.readline()  # the last row started before end: read it whole
                self.bytes_read += len(chunk)
                if position == 0:
                    chunk = chunk.removeprefix(_BOM)
                position = f.tell()
                starts, ends = _row_bounds(chunk)
                yield [chunk[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]

    def _row_text(self, raw: bytes, path: str, index: int) -> str:
        return self._parse(raw, path, index)

    def _parse(self, line: bytes, path: str, index: int) -> str:
        try:
            row = json.loads(line)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise DataError(
                f"document {index} of {self.name!r} (in {path}) is not valid JSON ({e}); a "
                "JSON-lines file holds one object per line. Fix or remove that line."
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"document {index} of {self.name!r} (in {path}) is a JSON "
                f"{type(row).__name__}, not an object; a JSON-lines file holds one object "
                "per line."
            )
        if self.columns:
            where = f"row {index} of {self.name!r} (in {path})"
            return chat_row(row, self.columns, self.section, where)  # type: ignore[return-value]
        if self.text_column in row:
            return self._text(row[self.text_column])
        columns = self._first_columns()
        if self.text_column not in columns:
            raise self._no_column(columns)
        return self._text(None)

    def _first_columns(self) -> list[str]:
        """The columns ``datasets`` infers: every key in the first 10 MB holding rows."""
        if self._columns is None:
            keys: dict[str, None] = {}
            for path in self.files:
                for chunk in _chunks(path, _SCHEMA_CHUNK):
                    for line in chunk.split(b"\n"):
                        try:
                            row = json.loads(line) if line.strip(b" \t\r") else None
                        except ValueError:
                            continue
                        if isinstance(row, dict):
                            keys.update(dict.fromkeys(row))
                    if keys:
                        break
                if keys:
                    break
            self._columns = list(keys)
        return self._columns


def _row_bounds(chunk: bytes) -> tuple[Any, Any]:
    """Where each non-blank row of ``chunk`` (whole lines) starts and ends: one vectorized
    pass over the newlines."""
    import numpy as np

    data = np.frombuffer(chunk, np.uint8)
    ends = np.flatnonzero(data == 10)
    if not chunk.endswith(b"\n"):
        ends = np.append(ends, len(chunk))
    starts = np.empty_like(ends)
    starts[:1], starts[1:] = 0, ends[:-1] + 1
    # A blank line is empty or starts with a space, tab or CR; check those few one by one.
    # (Every start is inside the chunk: a line ends at a newline or at the chunk's end.)
    maybe = np.flatnonzero((ends == starts) | np.isin(data[starts], _WS))
    blank = [k for k in maybe.tolist() if not chunk[starts[k] : ends[k]].strip(b" \t\r")]
    if blank:
        starts, ends = np.delete(starts, blank), np.delete(ends, blank)
    return starts, ends


def _chunks(path: str, size: int) -> Iterator[bytes]:
    """``path``'s bytes in ~``size`` pieces ending at line ends, without a leading BOM."""
    with open(path, "rb") as f:
        start = True
        while chunk := f.read(size):
            chunk += f.readline()
            if start:
                chunk, start = chunk.removeprefix(_BOM), False
                if not chunk:
                    continue
            yield chunk


class ParquetSource(_RowSource):
    """Local parquet files, one document per row; a first file that is not parquet fails
    when the source is made."""

    def __init__(
        self,
        name: str,
        files: list[str],
        text_column: str,
        section: str,
        columns: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, files, text_column, section, columns)
        self._read = list(columns) or [text_column]  # the columns read from each file
        if files:
            self._open(files[0])

    def _open(self, path: str) -> Any:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"cannot read {self.name!r} as parquet: {path}: {e}") from e

    def _with_text(self, path: str) -> Any:
        """``path`` opened, checked to hold the text column (the chat columns)."""
        parquet = self._open(path)
        columns = parquet.schema_arrow.names
        for column in self._read:
            if column in columns:
                continue
            if path == self.files[0] and self.columns:
                where = f"row 0 of {self.name!r} (in {path})"
                chat_row(dict.fromkeys(columns, 0), self.columns, self.section, where)
            if path == self.files[0]:
                raise self._no_column(columns)
            raise DataError(
                f"{path} of {self.name!r} has no column {column!r} (its columns are "
                f"{sorted(columns)}), unlike {self.files[0]}; give files of one schema."
            )
        return parquet

    def _documents(self, table: Any, take: Any) -> list[Any]:
        """Rows ``take`` of ``table`` (holding the columns read): texts, or chat rows."""
        if self.columns:
            return table.take(take).to_pylist()  # a dict of the chat columns per row
        return [self._text(v) for v in table.column(0).take(take).to_pylist()]

    def _file_rows(
        self, path: str, first: int, want: int, stride: int
    ) -> Iterator[tuple[int, list[str]]]:
        import pyarrow as pa

        parquet = self._with_text(path)
        for group in range(parquet.num_row_groups):
            count = parquet.metadata.row_group(group).num_rows
            if want >= first + count:  # no row of this rank: not read
                yield count, []
                first += count
                continue
            batches = parquet.iter_batches(
                batch_size=_BATCH, row_groups=[group], columns=self._read
            )
            for batch in batches:
                rows = batch.num_rows
                own = range(want - first, rows, stride) if want < first + rows else range(0)
                yield rows, self._documents(batch, pa.array(own, pa.int64())) if own else []
                first, want = first + rows, want + stride * len(own)

    def iter_region(self, region: int, regions: int, first: int) -> Iterator[tuple[int, str]]:
        """``iter_region`` by the files' row counts: only row groups holding its rows are
        read, only its rows become strings."""
        import pyarrow as pa

        counts, (low, high) = self._row_span(region, regions)
        want, base = low + first, 0  # the next row wanted, over all files; the file's first
        for path, count in zip(self.files, counts, strict=True):
            if want >= high:
                return
            if want >= base + count:
                base += count
                continue
            parquet = self._with_text(path)
            group_first = base
            for group in range(parquet.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                group_end = group_first + rows
                if want < group_end and group_first < high:  # rows of the region in it
                    table = parquet.read_row_group(group, columns=self._read)
                    take = range(want - group_first, min(high, group_end) - group_first)
                    for document in self._documents(table, pa.array(take, pa.int64())):
                        self.rows_parsed += 1
                        yield want - low, document
                        want += 1
                group_first = group_end
            base += count

    def region_has_rows(self, region: int, regions: int) -> bool:
        low, high = self._row_span(region, regions)[1]
        return high > low

    def _row_span(self, region: int, regions: int) -> tuple[list[int], tuple[int, int]]:
        """Each file's row count (from its metadata), and the region's rows among all."""
        counts = [self._open(path).metadata.num_rows for path in self.files]
        total = sum(counts)
        return counts, (region * total // regions, (region + 1) * total // regions)


class TextSource(_RowSource):
    """Local text files, one document per non-empty paragraph (split at blank lines, any line
    ends), as ``datasets``' ``sample_by="paragraph"``; only this rank's are decoded."""

    def _file_rows(
        self, path: str, first: int, want: int, stride: int
    ) -> Iterator[tuple[int, list[str]]]:
        with open(path, "rb") as f:
            rest = b""
            # A chunk ends at a "\n" (or the file's end), so no "\r\n" is cut in two.
            while chunk := f.read(_CHUNK):
                chunk = (chunk + f.readline()).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
                pieces = (rest + chunk).split(b"\n\n")
                rest = pieces.pop()  # the paragraph going on in the next chunk
                rows = [piece for piece in pieces if piece]
                own = rows[want - first :: stride] if want < first + len(rows) else []
                yield len(rows), [self._decode(row, path) for row in own]
                first, want = first + len(rows), want + stride * len(own)
        if rest:
            yield 1, [self._decode(rest, path)] if want == first else []

    def _region_rows(self, path: str, begin: int, end: int, size: int) -> Iterator[list[bytes]]:
        """The raw paragraphs of ``path`` that start in ``[begin, end)``, a list per ~``size``
        bytes read, cut by ``_PARAGRAPH_BREAK`` where ``_file_rows`` cuts. A break depends on
        the line ends before it only back to the last other byte, so the scan starts there,
        and its first piece began before it unless it is the file's first."""
        with open(path, "rb") as f:
            scan = self._after_text(f, begin)
            f.seek(scan)
            first_is_tail = scan > 0
            offset, rest = scan, b""  # the file offset of rest's first byte
            searched = 0  # no break starts in rest before this (its trailing line ends)
            while True:
                position = f.tell()
                # Whole lines (a chunk ends at "\n"), so no "\r\n" is cut in two; past the
                # region a line at a time, which only finishes its last paragraph.
                chunk = f.read(min(size, end - position)) if position < end else b""
                chunk += f.readline()
                self.bytes_read += len(chunk)
                rest += chunk
                pieces: list[tuple[int, bytes]] = []
                cut = 0
                for match in _PARAGRAPH_BREAK.finditer(rest, searched):
                    pieces.append((offset + cut, rest[cut : match.start()]))
                    cut = match.end()
                if not chunk:  # the file's end ends its last paragraph
                    pieces.append((offset + cut, rest[cut:]))
                rest, offset = rest[cut:], offset + cut
                # A break not found yet can only start in rest's trailing line ends.
                searched = len(rest.rstrip(b"\r\n"))
                if first_is_tail and pieces:
                    first_is_tail = False
                    del pieces[0]
                rows = [piece for start, piece in pieces if piece and begin <= start < end]
                if rows:
                    yield rows
                if not chunk or offset >= end or any(start >= end for start, _ in pieces):
                    return

    def _row_text(self, raw: bytes, path: str, index: int) -> str:
        return self._decode(_one_line_end(raw), path)

    def _after_text(self, f: Any, begin: int) -> int:
        """The offset after the last byte before ``begin`` that is no line end (0 if none)."""
        position = begin
        while position > 0:
            step = min(256, position)
            f.seek(position - step)
            window = f.read(step)
            self.bytes_read += len(window)
            text = window.rstrip(b"\r\n")
            if text:
                return position - step + len(text)
            position -= step
        return 0

    def _decode(self, row: bytes, path: str) -> str:
        try:
            return row.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path} of {self.name!r} is not UTF-8 text ({e}).") from None
