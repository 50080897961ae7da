"""The one safetensors header reader: sizes and offsets are checked before anything is
allocated, for the command's reader and the manager's Hugging Face import alike. Files are
written by the real ``safetensors`` library and then edited as a damaged or hostile file
would be."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest
import torch

from titan_ckpt.errors import CheckpointReadError
from titan_ckpt.formats.safetensors import SafetensorsSource, read_header

safetensors_torch = pytest.importorskip("safetensors.torch")

TENSORS = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4).half()}


def _write(path: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _real(tmp_path: Path) -> tuple[dict, bytes]:
    """The header and data section of a file the safetensors library wrote."""
    path = tmp_path / "real.safetensors"
    safetensors_torch.save_file(TENSORS, str(path))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _both_readers(path: Path):
    """Open ``path`` with the command's reader and the manager's HF import reader."""
    from titan_ckpt.hf import hf_files
    from titan_ckpt.storage import LocalStorage

    yield lambda: SafetensorsSource(str(path))
    yield lambda: hf_files(LocalStorage(), str(path.parent))


def test_a_real_file_reads_back(tmp_path):
    header, data = _real(tmp_path)
    (tmp_path / "m").mkdir()
    path = _write(tmp_path / "m" / "model.safetensors", header, data)
    source = SafetensorsSource(str(path))
    out = source.read(["a", "b"])
    assert torch.equal(out["a"], TENSORS["a"])
    assert torch.equal(out["b"], TENSORS["b"])
    with open(path, "rb") as f:
        parsed = read_header(f, path.stat().st_size, str(path))
    assert parsed.tensors["a"].nbytes == 24
    assert parsed.tensors["b"].dtype == torch.float16


def _damaged(header: dict, data: bytes) -> list[tuple[str, dict, bytes, str]]:
    """(name, header, data, expected message) for each kind of bad header."""
    cases = []

    def case(name, change, message, body=data):
        h = json.loads(json.dumps(header))
        change(h)
        cases.append((name, h, body, message))

    huge = 10 << 40  # a 10 TB tensor
    case("10TB tensor", lambda h: h["a"].update(shape=[huge // 4], data_offsets=[0, huge]),
         "outside the")  # fmt: skip
    case("size mismatch", lambda h: h["a"].update(shape=[2, 4]), "span 24")
    case("end before begin", lambda h: h["a"].update(data_offsets=[24, 0]), "outside")
    case("negative offset", lambda h: h["a"].update(data_offsets=[-8, 16]), r"not \[begin, end\]")
    case("overlap", lambda h: h["b"].update(data_offsets=[16, 24]), "overlap")
    case("unknown dtype", lambda h: h["a"].update(dtype="F128"), "F128")
    case("shape of text", lambda h: h["a"].update(shape="2x3"), "shape")
    case("bool shape", lambda h: h["a"].update(shape=[True, 24]), "shape")
    case("spec not a map", lambda h: h.update(a=[1, 2]), "not a map")
    case("metadata not strings", lambda h: h.update(__metadata__={"k": 1}), "__metadata__")
    case("truncated data", lambda h: None, "outside the", body=data[:-1])
    return cases


@pytest.mark.parametrize("index", range(11))
def test_damaged_headers_are_refused_before_any_allocation(index, tmp_path):
    header, data = _real(tmp_path)
    _, bad, body, message = _damaged(header, data)[index]
    folder = tmp_path / "hf"
    folder.mkdir()
    path = _write(folder / "model.safetensors", bad, body)
    for open_it in _both_readers(path):
        with pytest.raises(CheckpointReadError, match=message):
            open_it()


@pytest.mark.parametrize(
    "prefix",
    [
        struct.pack("<Q", 1 << 63),  # a header "longer" than any disk
        struct.pack("<Q", 200),  # longer than the file
        b"\x01\x02",  # shorter than the length field
        struct.pack("<Q", 4) + b"[1]\n",  # JSON, but not a map
        struct.pack("<Q", 4) + b"\xff\xfe{}",  # not UTF-8
    ],
)
def test_header_length_and_text_are_checked(prefix, tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(prefix)
    started = time.perf_counter()
    with pytest.raises(CheckpointReadError, match=r"x\.safetensors"):
        SafetensorsSource(str(path))
    assert time.perf_counter() - started < 1.0  # refused, not read or allocated


def test_deeply_nested_header_is_an_error_not_a_crash(tmp_path):
    text = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(CheckpointReadError, match=r"not JSON|not a map"):
        SafetensorsSource(str(path))
