"""Local JSON-lines, parquet and text files read by rank (``titan_train.data.local_files``): the
documents each data-parallel rank gets, and where a resumed run starts, are exactly those of
``datasets``' streaming reader with its by-example node split (the path before), while a
rank parses only its own rows."""

from __future__ import annotations

import gzip
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_train.data import DataConfig, DataError, TextDataLoader, local_files, open_documents
from titan_train.data.sources import _HFSource, _load_streaming, iter_strided
from titan_train.tokenizer import load_tokenizer

_WORDS = ["alpha", "beta", "é", "😀", 'quote "q"', "back\\slash", "line\nbreak", "tab\t", "x"]


def _texts(count, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choices(_WORDS, k=rng.randint(1, 12))) for _ in range(count)]


def _write_jsonl(folder):
    """Three files in name order, with a BOM, CRLF line ends, blank and whitespace lines,
    a null text, a row without the text key and a last line without a newline."""
    texts = _texts(60, seed=1)
    rows = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)]
    rows[7] = json.dumps({"text": None, "id": 7})
    rows[11] = json.dumps({"id": 11})
    (folder / "a.jsonl").write_bytes(
        b"\xef\xbb\xbf" + "\n".join(rows[:20]).replace("\n", "\n\n", 3).encode() + b"\n"
    )
    (folder / "b.jsonl").write_bytes(("\r\n".join(rows[20:35]) + "\r\n  \r\n\t\n").encode())
    (folder / "c.jsonl").write_text("\n \n" + "\n".join(rows[35:]))
    return sorted(str(p) for p in folder.glob("*.jsonl"))


def _write_parquet(folder):
    texts = _texts(70, seed=2)
    texts[5] = None
    pq.write_table(pa.table({"id": range(30), "text": texts[:30]}), folder / "a.parquet",
                   row_group_size=7)  # fmt: skip
    pq.write_table(pa.table({"id": range(30, 70), "text": texts[30:]}), folder / "b.parquet",
                   row_group_size=16)  # fmt: skip
    return sorted(str(p) for p in folder.glob("*.parquet"))


def _write_text(folder):
    """Paragraphs split by blank lines: LF, CRLF and CR line ends, runs of blank lines, a
    BOM, a paragraph with inner line breaks and a last one without a newline."""
    paragraphs = [t.replace("\n", " ") for t in _texts(50, seed=4)]
    paragraphs[3] = "first line\nsecond line"
    (folder / "a.txt").write_bytes(("\ufeff" + "\n\n".join(paragraphs[:20]) + "\n").encode())
    (folder / "b.txt").write_bytes(("\r\n\r\n".join(paragraphs[20:32]) + "\r\n\r\n\r\n").encode())
    (folder / "c.txt").write_bytes(("\n\n\n\n" + "\r\r".join(paragraphs[32:])).encode())
    return sorted(str(p) for p in folder.glob("*.txt"))


_WRITERS = {"json": _write_jsonl, "parquet": _write_parquet, "text": _write_text}


@pytest.fixture(params=list(_WRITERS))
def corpus(request, tmp_path, monkeypatch):
    """``(new source, old source)`` over the same small files; small chunks and batches so
    rows of one rank span many of them."""
    monkeypatch.setattr(local_files, "_CHUNK", 300)
    monkeypatch.setattr(local_files, "_BATCH", 5)
    files = _WRITERS[request.param](tmp_path)
    new = open_documents(DataConfig(dataset=request.param, dataset_path=str(tmp_path)))
    assert isinstance(new, local_files._RowSource)
    extra = {"sample_by": "paragraph"} if request.param == "text" else {}
    old = _HFSource(
        str(tmp_path), _load_streaming(request.param, data_files=files, **extra), "text"
    )
    return new, old


def test_strided_rows_equal_datasets_node_split(corpus):
    new, old = corpus
    total = len(list(old.iter_from(0)))
    assert total in (60, 70, 51)  # text: a run of 3 newlines leaves a "\n" paragraph
    for start, stride in [(0, 1), (0, 2), (1, 2), (0, 4), (3, 4), (1, 3), (2, 3), (17, 1),
                          (23, 4), (total - 2, 3), (total, 1), (total + 5, 2)]:  # fmt: skip
        assert list(iter_strided(new, start, stride)) == list(iter_strided(old, start, stride))
    assert list(new.iter_from(13)) == list(old.iter_from(13))
    if not isinstance(new, local_files.TextSource):
        assert "None" in list(new.iter_from(0))  # a null text reads as today: str(None)


class _Recording:
    """The shipped tokenizer, recording the documents it encodes."""

    def __init__(self):
        self.tokenizer = load_tokenizer()
        self.bos_id, self.eos_id = self.tokenizer.bos_id, self.tokenizer.eos_id
        self.vocab_size = self.tokenizer.vocab_size
        self.texts = []

    def encode(self, text, *, bos=False, eos=False):
        self.texts.append(text)
        return self.tokenizer.encode(text, bos=bos, eos=eos)


def _run(source, dp, rank, steps, state=None):
    tokenizer = _Recording()
    loader = TextDataLoader(source, tokenizer, seq_len=12, local_batch_size=2, dp_rank=rank,
                            dp_degree=dp, num_shards=4)  # fmt: skip
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    inputs = [next(batches)[0].tolist() for _ in range(steps)]
    return inputs, tokenizer.texts, loader.state_dict()


@pytest.mark.parametrize("dp", [1, 2, 4, 3])
def test_each_rank_gets_the_same_documents_and_resumes_alike(corpus, dp):
    new, old = corpus
    for rank in range(dp):
        batches, texts, state = _run(new, dp, rank, steps=6)
        assert (batches, texts, state) == _run(old, dp, rank, steps=6)
        # Resumed mid-stream (from the state after 6 steps), both paths go on alike.
        assert _run(new, dp, rank, 5, state) == _run(old, dp, rank, 5, state)


def test_a_rank_parses_only_its_own_lines(tmp_path, monkeypatch):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(12)]
    lines[5] = '{"text": broken'
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    source = open_documents(DataConfig(dataset=str(path)))  # checks the first line is JSON
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(local_files.json, "loads", lambda s: parsed.append(s) or real_loads(s))
    assert list(iter_strided(source, 0, 4)) == [(0, "doc 0"), (4, "doc 4"), (8, "doc 8")]
    assert len(parsed) == source.rows_parsed == 3  # rows 0, 4, 8; the others are not parsed
    assert list(source.iter_from(6)) == [f"doc {i}" for i in range(6, 12)]  # skips row 5
    with pytest.raises(DataError, match=r"document 5 of .*d.jsonl.* is not valid JSON \("):
        list(iter_strided(source, 1, 4))


def test_missing_text_column_is_the_same_error_as_before(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "a", "id": 0}\n{"body": "b", "id": 1}\n')
    pq.write_table(pa.table({"body": ["a"], "id": [0]}), tmp_path / "d.parquet")
    for name, builder in [("d.jsonl", "json"), ("d.parquet", "parquet")]:
        target = str(tmp_path / name)
        old = _HFSource(target, _load_streaming(builder, data_files=[target]), "text")
        with pytest.raises(DataError) as before:
            next(old.iter_from(0))
        new = open_documents(DataConfig(dataset=target))
        with pytest.raises(DataError) as now:
            next(iter_strided(new, 1, 2))
        assert str(now.value) == str(before.value)
        assert "has no column 'text'; its columns are ['body', 'id']" in str(now.value)


def test_compressed_and_whole_json_files_keep_the_datasets_reader(tmp_path):
    packed = tmp_path / "d.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write('{"text": "a"}\n{"text": "b"}\n')
    array = tmp_path / "e.json"
    array.write_text('[{"text": "c"}, {"text": "d"}]')
    spread = tmp_path / "f.json"  # one object over several lines
    spread.write_text('\n{\n  "text": "e"\n}\n')
    for path, texts in [(packed, ["a", "b"]), (array, ["c", "d"]), (spread, ["e"])]:
        source = open_documents(DataConfig(dataset=str(path)))
        assert isinstance(source, _HFSource)
        assert list(source.iter_from(0)) == texts


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_local_copy_of_a_hub_dataset_is_read_by_rank(tmp_path, fmt):
    data = tmp_path / "data"
    data.mkdir()
    texts = _texts(20, seed=3)
    for k in range(3):  # datasets' layout: train-* files, and a test split left out
        part = {"text": texts[k * 6 : k * 6 + 6], "id": list(range(6))}
        if fmt == "parquet":
            pq.write_table(pa.table(part), data / f"train-0000{k}-of-00003.parquet")
        else:
            rows = [json.dumps({"text": t, "id": i}) for i, t in enumerate(part["text"])]
            (data / f"train-0000{k}-of-00003.jsonl").write_text("\n".join(rows) + "\n")
    (data / f"test-00000-of-00001.{fmt}").write_bytes(
        (data / f"train-00000-of-00003.{fmt}").read_bytes()
    )
    config = DataConfig(dataset="my-org/my-data", dataset_path=str(tmp_path))
    new = open_documents(config)
    assert isinstance(new, local_files.JsonLinesSource | local_files.ParquetSource)
    old = _HFSource(str(tmp_path), _load_streaming(str(tmp_path)), "text")
    assert list(new.iter_from(0)) == texts[:18]
    for start, stride in [(0, 1), (1, 2), (2, 4), (5, 3), (17, 2)]:
        assert list(iter_strided(new, start, stride)) == list(iter_strided(old, start, stride))


def test_a_file_that_is_not_parquet_is_refused_when_opened(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"cannot read .*d.parquet.* as parquet: "):
        open_documents(DataConfig(dataset=str(path)))
