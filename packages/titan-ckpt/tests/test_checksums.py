"""``checkpoint.checksum``: which algorithm a save records, and loading steps of either kind.

Checked against digests computed straight by hashlib and xxhash; a missing ``xxhash`` is a
real failed import (``sys.modules["xxhash"] = None``), as on a machine without it.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointIntegrityError,
    CheckpointManager,
    LocalStorage,
)
from titan_ckpt.formats.checksums import entry_algorithm, resolve_checksum
from titan_ckpt.layout import COMMIT_MARKER, file_digest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def no_xxhash(monkeypatch):
    """This process without the xxhash package: ``import xxhash`` fails."""
    monkeypatch.setitem(sys.modules, "xxhash", None)


def _save(common, folder, **config):
    model = common.make_model(seed=0)
    with CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=1, **config), model_parts=model
    ) as manager:
        manager.save(1)
    return folder / "step-1"


def _files(step):
    return json.loads((step / COMMIT_MARKER).read_text())["files"]


class _OpenCounting(LocalStorage):
    """The local filesystem, recording every checkpoint data file opened through it to read."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def open(self, path, mode="rb"):
        if "r" in mode and not path.endswith(".json"):
            self.read.append(path)
        return super().open(path, mode)


def _reader(common, folder, storage=None, **config):
    model = common.make_model(seed=3)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), **config),
        model_parts=model,
        storage=storage,
    )
    return model, manager


@pytest.mark.parametrize("checksum", ["sha256", "xxh3_128"])
def test_a_save_records_the_chosen_checksum_and_a_load_checks_it(
    common, tmp_path, entry_of, checksum
):
    if checksum == "xxh3_128":
        pytest.importorskip("xxhash")
    step = _save(common, tmp_path, checksum=checksum)
    files = _files(step)
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    for name, info in files.items():
        assert info == entry_of((step / name).read_bytes(), checksum)
    # A reader set to the other algorithm still verifies what the step recorded.
    other = "sha256" if checksum == "xxh3_128" else "auto"
    _, manager = _reader(common, tmp_path, checksum=other)
    with manager:
        assert manager.load(verify_checksums=True)
    data = step / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    data.write_bytes(bytes(raw))
    model, manager = _reader(common, tmp_path, checksum=other)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with manager, pytest.raises(CheckpointIntegrityError) as caught:
        manager.load(verify_checksums=True)
    assert caught.value.problems == [
        f"__0_0.distcp: {checksum} differs from the manifest (contents changed)"
    ]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_auto_takes_xxh3_where_xxhash_imports():
    pytest.importorskip("xxhash")
    assert resolve_checksum("auto") == "xxh3_128"
    assert CheckpointConfig().checksum == "auto"


def test_without_xxhash_auto_falls_back_to_sha256(common, tmp_path, entry_of, no_xxhash):
    assert resolve_checksum("auto") == "sha256"
    step = _save(common, tmp_path)
    for name, info in _files(step).items():
        assert info == entry_of((step / name).read_bytes(), "sha256")


def test_without_xxhash_asking_for_xxh3_is_refused_up_front(tmp_path, no_xxhash):
    with pytest.raises(CheckpointConfigError, match=r"pip install 'titan-ckpt\[xxhash\]'"):
        CheckpointConfig(enable=True, folder=str(tmp_path), checksum="xxh3_128")
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_checksum_name_lists_the_choices(tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"checkpoint\.checksum") as caught:
        CheckpointConfig(enable=True, folder=str(tmp_path), checksum="md5")
    for name in ("auto", "xxh3_128", "sha256"):
        assert name in str(caught.value)


def test_verifying_an_xxh3_step_without_xxhash_says_how_before_reading(
    common, tmp_path, titan_ckpt, monkeypatch
):
    pytest.importorskip("xxhash")
    step = _save(common, tmp_path, checksum="xxh3_128")
    monkeypatch.setitem(sys.modules, "xxhash", None)
    storage = _OpenCounting()
    model, manager = _reader(common, tmp_path, storage=storage)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with manager, pytest.raises(CheckpointConfigError, match=r"xxh3_128 checksums.*pip install"):
        manager.load(verify_checksums=True)
    assert storage.read == []  # refused before any data file was opened
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # Without verification (sizes only) the step loads.
    model, manager = _reader(common, tmp_path)
    with manager:
        assert manager.load()
    code, _, err = titan_ckpt("verify", step)
    assert code == 2
    assert "xxh3_128 checksums" in err
    assert "pip install" in err


def test_a_newer_algorithm_keeps_the_step_committed_and_refuses_only_verification(common, tmp_path):
    step = _save(common, tmp_path)
    marker = step / COMMIT_MARKER
    body = json.loads(marker.read_text())
    body["files"] = {
        rel: {"size": info["size"], "blake3": "00" * 32} for rel, info in body["files"].items()
    }
    marker.write_text(json.dumps(body))
    _, manager = _reader(common, tmp_path)
    with manager:
        assert manager.load()  # committed; sizes checked
    _, manager = _reader(common, tmp_path)
    with manager, pytest.raises(CheckpointConfigError, match=r"blake3.*Upgrade titan-ckpt"):
        manager.load(verify_checksums=True)


def test_entry_algorithm_prefers_xxh3_and_ignores_unknown_keys():
    assert entry_algorithm({"size": 1, "sha256": "a", "xxh3_128": "b"}) == "xxh3_128"
    assert entry_algorithm({"size": 1, "sha256": "a"}) == "sha256"
    assert entry_algorithm({"size": 1, "blake3": "a"}) is None


class _StreamOnly(LocalStorage):
    """The local filesystem handing out in-memory streams (as a remote storage would):
    nothing to map, so files are hashed in chunks."""

    def open(self, path, mode="rb"):
        if mode == "rb":
            with open(path, "rb") as f:
                return io.BytesIO(f.read())
        return super().open(path, mode)


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("size", [0, 1, (4 << 20) + 3])
def test_file_digest_of_files_and_streams_agrees_with_an_independent_hash(
    tmp_path, entry_of, algorithm, size
):
    if algorithm == "xxh3_128":
        pytest.importorskip("xxhash")
    data = bytes((i * 7 + 3) % 251 for i in range(size))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    expected = entry_of(data, algorithm)[algorithm]
    assert file_digest(LocalStorage(), str(path), algorithm) == expected
    assert file_digest(_StreamOnly(), str(path), algorithm) == expected
