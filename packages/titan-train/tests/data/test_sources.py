"""Document sources: local jsonl/parquet/text files and folders read through ``datasets``
(streaming, offline), the embedded corpus, DataConfig validation, and one clear error when
a hub name cannot be reached (offline mode forced, or the hub's address pointed at this
machine, so the test never touches the network)."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from titan_train.data import DataConfig, DataError, embedded_documents, open_documents


def _jsonl(path, texts, column="text"):
    path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def test_embedded_corpus_is_pythons_documentation():
    docs = embedded_documents()
    assert len(docs) > 50
    assert sum(map(len, docs)) > 300_000
    assert any('The "for" statement' in d or "for_stmt" in d for d in docs)
    assert list(open_documents(DataConfig()).iter_from(len(docs) - 1)) == docs[-1:]


def test_jsonl_file_in_order_and_restartable(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ["one", "two", "three"])
    source = open_documents(DataConfig(dataset=str(path)))
    assert list(source.iter_from(0)) == ["one", "two", "three"]
    assert list(source.iter_from(2)) == ["three"]
    assert list(source.iter_from(5)) == []


def test_folder_of_jsonl_files_is_read_in_name_order(tmp_path):
    _jsonl(tmp_path / "b.jsonl", ["b0"])
    _jsonl(tmp_path / "a.jsonl", ["a0", "a1"])
    source = open_documents(DataConfig(dataset="json", dataset_path=str(tmp_path)))
    assert list(source.iter_from(0)) == ["a0", "a1", "b0"]


def test_parquet_with_another_text_column(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"content": ["x y", "z"], "n": [1, 2]}), path)
    source = open_documents(DataConfig(dataset=str(path), text_column="content"))
    assert list(source.iter_from(0)) == ["x y", "z"]


def test_text_file_one_document_per_paragraph(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("First paragraph,\nstill first.\n\nSecond one.\n")
    docs = list(open_documents(DataConfig(dataset=str(path))).iter_from(0))
    assert docs == ["First paragraph,\nstill first.", "Second one.\n"]


def test_missing_text_column_lists_the_columns(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", ["a"], column="body")
    source = open_documents(DataConfig(dataset=str(path)))
    with pytest.raises(DataError, match=r"has no column 'text'; its columns are \['body', 'id'\]"):
        next(source.iter_from(0))


def test_missing_local_file_is_named(tmp_path):
    with pytest.raises(DataError, match=r"training.dataset=.*nope.jsonl.*: no such file"):
        open_documents(DataConfig(dataset=str(tmp_path / "nope.jsonl")))
    with pytest.raises(DataError, match=r"training.dataset_path=.*gone.* does not exist"):
        open_documents(DataConfig(dataset="json", dataset_path=str(tmp_path / "gone")))


def test_folder_without_data_files(tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match=r"holds no .csv, .json.* files; give one format"):
        open_documents(DataConfig(dataset=str(tmp_path)))


class Hub(http.server.BaseHTTPRequestHandler):
    """A stand-in for the hub: every request answered with ``status`` (the dataset API's
    with ``api_status``), each request's path recorded."""

    status, api_status, paths = 404, 404, []

    def do_GET(self):
        self.paths.append(self.path)
        status = self.api_status if self.path.startswith("/api/datasets/") else self.status
        body = b'{"error": "Repository not found"}' if status >= 400 else b'{"id": "x"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch):
    """A local HTTP server as ``HF_ENDPOINT``; set its class's statuses in the test."""
    handler = type("AHub", (Hub,), {"paths": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield handler
    server.shutdown()
    server.server_close()


def test_a_failed_hub_load_is_one_clear_error(monkeypatch, hub):
    """The hub answers that it has the dataset but the load fails (datasets forced offline
    here): the error of datasets, in one message."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub.api_status = 200
    with pytest.raises(DataError) as info:
        open_documents(DataConfig(dataset="c4"))
    message = str(info.value)
    assert message.startswith(
        "training.dataset='c4' is not a local file or folder, and loading 'allenai/c4' from "
        "the Hugging Face hub failed (ConnectionError: "
    )
    assert message.endswith(
        "Without a network use training.dataset='embedded' or a local json/jsonl/parquet/txt file."
    )


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as server:
        return server.getsockname()[1]


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "no connection"])
def test_an_unreachable_hub_fails_at_once_in_one_message(offline, monkeypatch, caplog):
    """Offline (by the variables, or no answer from the hub's host) a hub name fails in about
    a second, before datasets retries: no retry warnings."""
    port = _closed_port()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    if offline != "no connection":
        monkeypatch.setenv(offline, "1")
    started = time.monotonic()
    with pytest.raises(DataError) as info:
        open_documents(DataConfig(dataset="allenai/c4"))
    assert time.monotonic() - started < 3
    why = (
        f"{offline} is set" if offline != "no connection" else f"no connection to 127.0.0.1:{port}"
    )
    assert str(info.value).startswith(
        "training.dataset='allenai/c4' is not a local file or folder, and the Hugging Face hub "
        f"is out of reach ({why}"
    )
    assert "\n" not in str(info.value)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    ("hub_answer", "why"),
    [
        (404, "has no dataset 'nobody/nothing-here' that this machine may read (HTTP 404)"),
        (401, "has no dataset 'nobody/nothing-here' that this machine may read (HTTP 401)"),
        (503, "is out of reach (HTTP 503 from http://127.0.0.1:"),
        (None, "is out of reach (no connection to 127.0.0.1:"),
    ],
)
def test_an_unknown_hub_dataset_fails_at_once_in_one_line(hub_answer, why, hub, monkeypatch,
                                                           caplog, capfd):  # fmt: skip
    """A name the hub does not have (404, or 401 as the hub answers anonymous callers), a
    hub in trouble (503: huggingface_hub retried it for 24 s, each retry a warning printed
    twice) and a hub that is not there: one line within seconds, one request, no warning."""
    if hub_answer is None:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    else:
        hub.status = hub.api_status = hub_answer
    started = time.monotonic()
    with caplog.at_level(logging.INFO), pytest.raises(DataError) as info:
        open_documents(DataConfig(dataset="nobody/nothing-here"))
    assert time.monotonic() - started < 5
    message = str(info.value)
    assert message.startswith("training.dataset='nobody/nothing-here' is not a local file or ")
    assert why in message
    assert "\n" not in message
    assert len(hub.paths) == (0 if hub_answer is None else 1), hub.paths
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    out, err = capfd.readouterr()
    assert "Retry" not in out + err
    assert "Warning" not in out + err


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_len": 0}, r"training.seq_len=0 is not allowed; it must be a whole number >= 1"),
        ({"local_batch_size": 2.5}, r"training.local_batch_size=2.5 is not allowed"),
        ({"dataset": " "}, r"training.dataset=' ' is not allowed; it must be a non-empty"),
        ({"text_column": ""}, r"training.text_column='' is not allowed"),
    ],
)
def test_config_errors_name_key_and_value(kwargs, match):
    with pytest.raises(DataError, match=match):
        DataConfig(**kwargs)


def test_compressed_jsonl(tmp_path):
    import gzip

    path = tmp_path / "part-0.json.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"text": "zipped"}) + "\n")
    assert list(open_documents(DataConfig(dataset=str(path))).iter_from(0)) == ["zipped"]


def test_hub_name_with_a_local_copy(tmp_path):
    _jsonl(tmp_path / "train.jsonl", ["local", "copy"])
    config = DataConfig(dataset="my-org/my-data", dataset_path=str(tmp_path))
    assert list(open_documents(config).iter_from(1)) == ["copy"]
    with pytest.raises(DataError, match=r"training.dataset_path='missing/dir' does not exist"):
        open_documents(DataConfig(dataset="my-org/my-data", dataset_path="missing/dir"))
