"""Integrity without a second read: every rank hashes its files while DCP writes them, and the
commit marker merges the digests (``titan_ckpt.formats.hashing``).

Checked against: reads counted during saves on 2 gloo ranks in every async mode, both through
the storage seam and by an audit hook on every ``open`` of the process; hashlib or xxhash over the
files on disk; a flipped byte in each rank's file caught by ``load(verify_checksums=True)``
and by ``titan-ckpt verify`` (also when it breaks DCP's read, with the ranks hashing while
DCP reads); how the files are shared among the ranks; an fsspec (``memory://``) save; and the
fallbacks (a stream written out of order, a file changed after it was written)."""

from __future__ import annotations

import io
import json
import shutil
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt import (
    CheckpointConfig,
    CheckpointIntegrityError,
    CheckpointManager,
    FsspecStorage,
    LocalStorage,
    OptimizerState,
)
from titan_ckpt.formats import hashing
from titan_ckpt.formats.hashing import HashingStream
from titan_ckpt.formats.pickles import stored_member
from titan_ckpt.formats.torch_save import TorchSource
from titan_ckpt.layout import COMMIT_MARKER, Manifest, commit_step
from titan_ckpt.load_plan import shares
from titan_ckpt.lock import LOCK_FILE

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MODES = ("disabled", "async", "async_with_pinned_mem")
FILES = [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.fixture(scope="module")
def two_rank_saves(tmp_path_factory, torchrun, results):
    """Step 1 saved by 2 FSDP2 ranks in each mode, with the reads each rank made."""
    out = tmp_path_factory.mktemp("no_readback")
    folder = out / "ckpt"
    proc = torchrun("no_readback.py", 2, str(out), str(folder), timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return folder, results(out, "no_readback", 2)


@pytest.mark.slow
def test_no_byte_of_a_data_file_is_read_while_saving(two_rank_saves):
    _, reports = two_rank_saves
    for report in reports:
        for mode in MODES:
            seen = report[mode]
            # The one small read left: the retention thread (keep_latest_k) lists committed
            # steps by their commit markers, rank 0 only. No DCP file is ever opened to read.
            opened = {p.rsplit("/", 1)[-1] for p in seen["opened_for_reading"]}
            via_storage = {p.rsplit("/", 1)[-1] for p in seen["bytes_read"]}
            assert opened <= {COMMIT_MARKER}, (report["rank"], mode, seen)
            assert via_storage <= {COMMIT_MARKER}, (report["rank"], mode, seen)
            assert sum(seen["bytes_read"].values()) < 4096
            if report["rank"] != 0:
                assert not opened
                assert not via_storage


def test_manifest_equals_an_independent_hash_of_every_ranks_files(two_rank_saves, entry_of):
    folder, _ = two_rank_saves
    for mode in MODES:
        step = folder / mode / "step-1"
        files = json.loads((step / COMMIT_MARKER).read_text())["files"]
        assert sorted(files) == FILES
        for name, info in files.items():
            data = (step / name).read_bytes()
            assert info == entry_of(data)


def test_two_ranks_verify_their_shares_on_load_and_agree_on_a_damaged_file(
    two_rank_saves, default_checksum
):
    _, reports = two_rank_saves
    for report in reports:
        assert report["load"]["intact"] == {"loaded": True}
        # Verified before any tensor is read: the damaged file is named on every rank and
        # nothing of the damaged step reached the model or the optimizer.
        assert report["load"]["damaged"] == {
            "problems": [
                f"__1_0.distcp: {default_checksum} differs from the manifest (contents changed)"
            ],
            "states_unchanged": True,
        }


def _load(common, folder, step):
    model = common.make_model(seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder)),
        model_parts=[model],
        states={"optimizer": OptimizerState(model, opt), "train_state": common.TrainState()},
    )
    try:
        return manager.load(step, verify_checksums=True)
    finally:
        manager.close()


@pytest.mark.parametrize("name", FILES)
def test_a_flipped_byte_in_any_ranks_file_is_caught(
    two_rank_saves, common, titan_ckpt, tmp_path, name, default_checksum
):
    folder, _ = two_rank_saves
    copy = tmp_path / "ckpt"
    shutil.copytree(folder / "async", copy)
    assert _load(common, copy, 1)
    path = copy / "step-1" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=f"{name}: {default_checksum} differs"):
        _load(common, copy, 1)
    code, out, _ = titan_ckpt("verify", copy / "step-1")
    assert code == 1
    assert "DAMAGED" in out
    assert name in out


def test_fsspec_save_hashes_while_writing(common, entry_of):
    fsspec = pytest.importorskip("fsspec")
    url = "memory://integrity-test/run"
    storage = FsspecStorage(url)
    fs = fsspec.filesystem("memory")
    read: list[str] = []
    original = fs.open

    def counting_open(path, mode="rb", **kwargs):
        if "r" in mode:
            read.append(path)
        return original(path, mode, **kwargs)

    fs.open = counting_open
    try:
        model = common.make_model(seed=0)
        config = CheckpointConfig(enable=True, folder=url, interval=1, keep_latest_k=0)
        with CheckpointManager(config, model_parts=[model], storage=storage) as manager:
            manager.save(1)
        assert not [p for p in read if not p.endswith(LOCK_FILE)]  # the lock's own read-back
        step = "memory://integrity-test/run/step-1"
        files = json.loads(fs.cat(f"{step}/{COMMIT_MARKER}"))["files"]
        assert sorted(files) == [".metadata", "__0_0.distcp"]
        for name, info in files.items():
            data = fs.cat(f"{step}/{name}")
            assert info == entry_of(data)
    finally:
        fs.open = original
        fs.rm("memory://integrity-test", recursive=True)


@pytest.mark.parametrize("helper", [True, False])
@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_hashing_stream_gives_no_digest_when_written_out_of_order(
    algorithm, helper, entry_of, monkeypatch
):
    if algorithm == "xxh3_128":
        pytest.importorskip("xxhash")
    # Large writes are hashed in a helper thread where a core is spare, else inline.
    monkeypatch.setattr(hashing, "_helper_has_a_core", lambda: helper)
    raw = io.BytesIO()
    stream = HashingStream(raw, algorithm)
    big = bytes(range(256)) * 8192  # 2 MiB: hashed beside the write, in the helper thread
    stream.write(b"head")
    stream.write(big)
    assert (stream._helper is not None) == helper
    assert stream.digest() == entry_of(b"head" + big, algorithm)
    assert raw.getvalue() == b"head" + big
    stream.seek(0)
    stream.write(b"HEAD")  # overwrites hashed bytes: the hash no longer says what is there
    assert stream.digest() is None


@pytest.mark.parametrize(
    ("cores", "local_world_size", "spare"),
    [(4, "2", True), (4, "3", False), (2, "2", False), (2, None, True), (1, None, False),
     (8, "not a number", True)],
)  # fmt: skip
def test_hashing_helper_only_where_each_rank_has_a_core_to_spare(
    cores, local_world_size, spare, monkeypatch
):
    monkeypatch.setattr(hashing.os, "sched_getaffinity", lambda _: set(range(cores)))
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    hashing._helper_has_a_core.cache_clear()
    try:
        assert hashing._helper_has_a_core() is spare
    finally:
        hashing._helper_has_a_core.cache_clear()


def test_commit_takes_digests_reads_the_rest_and_refuses_a_changed_file(tmp_path, entry_of):
    storage = LocalStorage()
    (tmp_path / "a.distcp").write_bytes(b"a" * 10)
    (tmp_path / "b.distcp").write_bytes(b"b" * 7)
    written = {"a.distcp": {"size": 10, "sha256": "0" * 64}}  # taken as given, not read
    # b.distcp was not reported by a writer: the commit reads it, with checksum=sha256.

    def manifest():
        return Manifest(step=1, world_size=1, states=["model"], model_only=True)

    files = commit_step(storage, str(tmp_path), manifest(), written, checksum="sha256").files
    assert files["a.distcp"] == {"size": 10, "sha256": "0" * 64}
    assert files["b.distcp"] == entry_of(b"b" * 7, "sha256")
    (tmp_path / COMMIT_MARKER).unlink()
    (tmp_path / "a.distcp").write_bytes(b"a" * 9)  # torn after it was written
    with pytest.raises(OSError, match="9 bytes on storage but 10 were written"):
        commit_step(storage, str(tmp_path), manifest(), written)
    (tmp_path / "a.distcp").unlink()
    with pytest.raises(OSError, match="lacks files the save wrote"):
        commit_step(storage, str(tmp_path), manifest(), written)
    assert not (tmp_path / COMMIT_MARKER).exists()


class _ReadCounting(LocalStorage):
    """The local filesystem, recording every file opened through it for reading."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def open(self, path, mode="rb"):
        if "r" in mode:
            self.read.append(path)
        return super().open(path, mode)


def test_hugging_face_export_is_hashed_as_written(common, tmp_path, entry_of):
    storage = _ReadCounting()
    # keep_latest_k=0: no retention thread, whose listing reads the commit markers.
    config = CheckpointConfig(
        enable=True, folder=str(tmp_path), last_save_in_hf=True, keep_latest_k=0
    )
    adapter = common.StreamingRenamingAdapter()
    model = common.make_model()
    with CheckpointManager(
        config, model_parts=model, state_dict_adapter=adapter, storage=storage
    ) as manager:
        manager.save(9, last_step=True)
    assert storage.read == []
    step = tmp_path / "step-9"
    files = json.loads((step / COMMIT_MARKER).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "hf/config.json", "hf/model.safetensors"]
    for name, info in files.items():
        data = (step / name).read_bytes()
        assert info == entry_of(data)


def test_verification_shares_balance_bytes_and_cover_every_file_once():
    files = {
        ".metadata": {"size": 5, "sha256": "a"},
        "__0_0.distcp": {"size": 100, "sha256": "b"},
        "__1_0.distcp": {"size": 60, "sha256": "c"},
        "__2_0.distcp": {"size": 50, "sha256": "d"},
    }
    # Largest first, each to the lighter rank: 100 | 60, then 50 -> 110, then 5 -> 105.
    assert [sorted(share) for share in shares(files, 2)] == [
        [".metadata", "__0_0.distcp"],
        ["__1_0.distcp", "__2_0.distcp"],
    ]
    assert shares(files, 2)[0][".metadata"] == files[".metadata"]
    # More ranks than files: the extra ranks hash nothing; every file exactly once.
    split = shares(files, 6)
    assert sorted(rel for share in split for rel in share) == sorted(files)
    assert [len(share) for share in split] == [1, 1, 1, 1, 0, 0]


def test_records_carry_no_zip_crc32_and_load_as_ever(common, tmp_path):
    # torch.save's per-record CRC-32s are never checked by torch.load; our writer skips
    # computing them (the manifest's checksum is the check) and restores the option after.
    model = common.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    common.train_steps(model, opt, range(1, 3), rank=0)
    states = {"optimizer": OptimizerState(model, opt)}
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1)
    assert torch.serialization.get_crc32_options()
    with CheckpointManager(config, model_parts=model, states=states) as manager:
        manager.save(1)
    assert torch.serialization.get_crc32_options()  # restored
    step = tmp_path / "step-1"
    metadata = dcp.FileSystemReader(str(step)).read_metadata()
    crcs, payloads = [], 0
    for info in metadata.storage_data.values():
        with open(step / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = io.BytesIO(f.read(info.length))
        for member in zipfile.ZipFile(raw).infolist():
            crcs.append(member.CRC)
            payloads += len(stored_member(raw, member))
    assert payloads > 0
    assert set(crcs) == {0}
    # DCP's own reader (what torchtitan loads with) restores every value bit for bit.
    expected = model.state_dict()
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=str(step), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    # torch.save elsewhere in the process still writes them.
    plain = io.BytesIO()
    torch.save(torch.ones(4), plain)
    assert all(m.CRC != 0 for m in zipfile.ZipFile(plain).infolist() if m.file_size)


def test_torch_save_files_without_crc32_are_read(tmp_path):
    # A user's torch.save file written with the CRC-32s off reads like any other.
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": torch.tensor(7)}
    path = tmp_path / "model.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, path)
    finally:
        torch.serialization.set_crc32_options(True)
    source = TorchSource(str(path))
    values = source.read(list(source.entries))
    assert all(torch.equal(values[k], v) for k, v in state.items())


def test_stored_member_refuses_a_size_past_the_end_before_reading():
    # A damaged zip directory may claim gigabytes: refused, without allocating them.
    buffer = io.BytesIO()
    torch.save(torch.ones(3), buffer)
    member = next(m for m in zipfile.ZipFile(buffer).infolist() if m.filename.endswith("data.pkl"))
    assert stored_member(buffer, member) == zipfile.ZipFile(buffer).read(member)
    member.file_size = 4 << 30
    with pytest.raises(ValueError, match="ends early"):
        stored_member(buffer, member)
