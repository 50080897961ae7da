"""A checkpoint from a stranger runs no code: every command and load path refuses a poisoned
pickle (one whose unpickling would create a marker file), names the class it asked for, and
never creates the marker; ``--trust-pickles`` / ``checkpoint.trust_pickles`` load a
checkpoint with custom objects. The allowlist is checked against real titan checkpoints of
every kind (full state, model-only, ``memory://``, ``convert --to dcp`` output)."""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import pickle
import shutil
import time
import zipfile
from pathlib import Path

import pytest
import torch

from titan_ckpt import (
    CheckpointConfig,
    CheckpointManager,
    OptimizerState,
    UnsafeCheckpointError,
)
from titan_ckpt.formats.pickles import (
    ALLOWED_GLOBALS,
    RECORD_GLOBALS,
    RestrictedUnpickler,
    stored_member,
)
from titan_ckpt.layout import COMMIT_MARKER, OWNER_MARKER

SYSTEM = f"{os.system.__module__}.system"  # how the poison's global is spelled: posix.system


class Poison:
    """Pickles as ``os.system("touch <marker>")``: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Stateful:
    """A state whose state_dict is whatever the test puts in it."""

    def __init__(self, **values) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict) -> None:
        self.values = dict(state_dict)


def _save(folder: Path, common, *, steps=(1,), model_only=False, **states) -> Path:
    model = common.make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(
        CheckpointConfig(
            enable=True, folder=str(folder), interval=1, last_save_model_only=model_only
        ),
        model_parts=[model],
        states={"optimizer": OptimizerState(model, opt), **states},
    )
    for step in steps:
        common.train_steps(model, opt, range(step, step + 1), rank=0)
        manager.save(step, last_step=step == steps[-1])
    manager.close()
    return folder / f"step-{steps[-1]}"


def _rehash(step_dir: Path) -> None:
    """Update the commit marker's manifest to the files as they are now (as an attacker
    who edits a checkpoint would), so that only the pickle check stands in the way."""
    marker = step_dir / COMMIT_MARKER
    body = json.loads(marker.read_text())
    for rel in body["files"]:
        data = (step_dir / rel).read_bytes()
        body["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    marker.write_text(json.dumps(body))


def poison_metadata(step_dir: Path, marker: Path) -> None:
    """Add a Poison to a real ``.metadata`` (its planner_data), keeping it loadable by DCP."""
    path = step_dir / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own file: trusted here
    metadata.planner_data = {"note": Poison(marker)}
    path.write_bytes(pickle.dumps(metadata))
    if (step_dir / COMMIT_MARKER).exists():
        _rehash(step_dir)


@pytest.fixture
def poisoned(tmp_path, saved_folder) -> tuple[Path, Path]:
    """(step directory with a poisoned .metadata, marker path that must never appear)."""
    step = tmp_path / "poisoned" / "step-2"
    shutil.copytree(saved_folder / "step-2", step)
    marker = tmp_path / "pwned"
    poison_metadata(step, marker)
    return step, marker


def test_plain_unpickling_of_the_poison_does_run_it(poisoned):
    # The control: the fixture is a real exploit, so the refusals below mean something.
    step, marker = poisoned
    pickle.loads((step / ".metadata").read_bytes())
    assert marker.exists()


def _refused(code: int, err: str, marker: Path) -> None:
    assert code == 1, err
    assert not marker.exists()
    assert err.count("titan-ckpt: error:") == 1
    assert SYSTEM in err
    assert ".metadata" in err
    assert "--trust-pickles" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "command",
    [
        ["inspect", "{step}"],
        ["inspect", "{step}", "--stats"],
        ["verify", "{step}"],
        ["verify", "{folder}"],
        ["diff", "{step}", "{clean}"],
        ["diff", "{clean}", "{step}"],
        ["convert", "{step}", "{out}", "--to", "safetensors"],
        ["convert", "{step}", "{out}", "--to", "dcp"],
        ["convert", "{step}", "{out}", "--to", "torch"],
    ],
)
def test_every_command_refuses_a_poisoned_metadata(
    command, poisoned, saved_folder, tmp_path, titan_ckpt
):
    step, marker = poisoned
    places = {"step": step, "folder": step.parent, "clean": saved_folder / "step-2"}
    places["out"] = tmp_path / "out"
    code, _, err = titan_ckpt(*[a.format(**places) for a in command])
    _refused(code, err, marker)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_trust_pickles_runs_what_it_is_told(poisoned, titan_ckpt):
    # --trust-pickles means it: the metadata is unpickled as torch would, poison included.
    step, marker = poisoned
    code, _, err = titan_ckpt("inspect", step, "--trust-pickles")
    assert code == 0, err
    assert marker.exists()


def test_resume_refuses_a_poisoned_metadata(poisoned, common):
    step, marker = poisoned
    model = common.make_model(seed=1)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(step.parent)), model_parts=[model]
    )
    with pytest.raises(UnsafeCheckpointError, match=SYSTEM) as caught:
        manager.load()
    manager.close()
    assert caught.value.found == SYSTEM
    assert caught.value.file.endswith(".metadata")
    assert not marker.exists()


def test_initial_load_path_refuses_a_poisoned_metadata(poisoned, common, tmp_path):
    step, marker = poisoned
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path / "fresh"), initial_load_path=str(step)),
        model_parts=[common.make_model(seed=1)],
    )
    with pytest.raises(UnsafeCheckpointError, match=SYSTEM):
        manager.load()
    manager.close()
    assert not marker.exists()


def test_a_poisoned_record_is_refused_on_resume_and_by_the_commands(tmp_path, common, titan_ckpt):
    # The poison in a non-tensor record, which DCP loads with torch.load(weights_only=False).
    marker = tmp_path / "pwned"
    step = _save(tmp_path / "run", common, train_state=Stateful(step=1, note=Poison(marker)))
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path / "run")),
        model_parts=[common.make_model(seed=1)],
        states={"train_state": Stateful(step=0, note=None)},
    )
    with pytest.raises(UnsafeCheckpointError, match=rf"__0_0\.distcp .*train_state.*{SYSTEM}"):
        manager.load()
    manager.close()
    for command in (["inspect", step], ["verify", step], ["convert", step, tmp_path / "o", "--to",
                                                          "torch"]):  # fmt: skip
        code, _, err = titan_ckpt(*command)
        assert code == 1, err
        assert SYSTEM in err
        assert "train_state" in err
    assert not marker.exists()


def test_trust_pickles_loads_a_checkpoint_with_custom_objects(tmp_path, common, titan_ckpt):
    started = datetime.datetime(2026, 12, 1, 12, 30)
    step = _save(tmp_path / "run", common, train_state=Stateful(step=1, started=started))

    code, _, err = titan_ckpt("inspect", step)
    assert code == 1
    assert "datetime.datetime" in err
    assert "--trust-pickles" in err
    code, out, err = titan_ckpt("inspect", step, "--trust-pickles")
    assert code == 0, err
    assert "2026" in out
    code, out, err = titan_ckpt("verify", step, "--trust-pickles")
    assert code == 0, out

    def resume(trust: bool) -> Stateful:
        state = Stateful(step=0, started=None)
        manager = CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path / "run"), trust_pickles=trust),
            model_parts=[common.make_model(seed=1)],
            states={"train_state": state},
        )
        try:
            assert manager.load()
        finally:
            manager.close()
        return state

    with pytest.raises(UnsafeCheckpointError, match=r"datetime\.datetime"):
        resume(trust=False)
    assert resume(trust=True).values == {"step": 1, "started": started}


def test_config_key_is_a_bool():
    from titan_ckpt import CheckpointConfigError

    assert CheckpointConfig().trust_pickles is False
    with pytest.raises(CheckpointConfigError, match="trust_pickles"):
        CheckpointConfig(trust_pickles="yes")  # type: ignore[arg-type]


def test_help_of_every_command_mentions_trust_pickles(titan_ckpt):
    for command in ("inspect", "verify", "diff", "convert"):
        code, out, _ = titan_ckpt(command, "--help")
        assert code == 0
        assert "--trust-pickles" in out


# --- the allowlist, derived from real checkpoints --------------------------------------------


class _Stub:
    """Whatever a recorded global is called with or built from: nothing real is built."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


class _Recorder(pickle.Unpickler):
    """Records every global a pickle names, and resolves each to ``_Stub``."""

    def __init__(self, data: bytes, seen: set) -> None:
        super().__init__(io.BytesIO(data))
        self.seen = seen

    def find_class(self, module, name):
        self.seen.add((module, name))
        return _Stub

    def persistent_load(self, pid):
        return None


def _globals_of(step_dir: Path) -> tuple[set, set]:
    """Every global that the .metadata and that the records (tensor or not) of a DCP step
    refer to; records are located by the metadata's own offsets."""
    in_metadata: set = set()
    in_records: set = set()
    metadata = pickle.loads((step_dir / ".metadata").read_bytes())  # ours: trusted
    _Recorder((step_dir / ".metadata").read_bytes(), in_metadata).load()
    for info in metadata.storage_data.values():
        with open(step_dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            raw = io.BytesIO(f.read(info.length))
        record = zipfile.ZipFile(raw)
        (pkl,) = [i for i in record.infolist() if i.filename.endswith("data.pkl")]
        _Recorder(stored_member(raw, pkl), in_records).load()  # its CRC-32 is not computed
    return in_metadata, in_records


def _allowed_in_metadata(module: str, name: str) -> bool:
    try:
        RestrictedUnpickler(io.BytesIO(b"")).find_class(module, name)
    except Exception:
        return False
    return True


def _allowed_in_records(module: str, name: str) -> bool:
    """torch's weights-only list, or one of ours (protocol 2 names builtins __builtin__)."""
    from torch._weights_only_unpickler import _get_allowed_globals

    full = f"{'builtins' if module == '__builtin__' else module}.{name}"
    return full in _get_allowed_globals() or full in {n for _, n in RECORD_GLOBALS}


def test_every_kind_of_titan_checkpoint_needs_only_allowed_globals(tmp_path, common, titan_ckpt):
    class Loader(Stateful):
        supports_resharding = True

    scheduler_model = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD(scheduler_model.parameters(), lr=0.1), lambda s: 0.9**s
    )
    full = _save(
        tmp_path / "full",
        common,
        steps=(1, 2),
        lr_scheduler=scheduler,
        dataloader=Loader(position=7, shard=b"\x00pickled-bytes", seen=[1, 2], rng=(3, 4.5)),
        train_state=Stateful(step=2, tokens=1 << 40, name="run", flags={"a": True, "b": None}),
        # As torchtitan writes them: its dataloader's pickle.dumps bytes, and (before 2025)
        # BytesIO values in its train state.
        tt_like=Stateful(dp_rank_0=pickle.dumps({"sample": 3}), losses=io.BytesIO(b"\x00\x01")),
    )
    model_only = _save(tmp_path / "model-only", common, model_only=True)
    converted = tmp_path / "converted"
    code, _, err = titan_ckpt("convert", full, converted, "--to", "dcp")
    assert code == 0, err
    kinds = {"full": full, "model-only": model_only, "converted": converted}

    in_metadata: set = set()
    in_records: set = set()
    for name, step in kinds.items():
        metadata_globals, record_globals = _globals_of(step)
        assert metadata_globals, name
        assert record_globals, name
        in_metadata |= metadata_globals
        in_records |= record_globals
        code, out, err = titan_ckpt("verify", step)  # under the allowlist: every record loads
        assert code == 0, (name, out, err)
    assert sorted(g for g in in_metadata if not _allowed_in_metadata(*g)) == []
    assert sorted(g for g in in_records if not _allowed_in_records(*g)) == []
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in in_metadata
    assert {("_io", "BytesIO"), ("_codecs", "encode"), ("torch._utils", "_rebuild_tensor_v2")} <= (
        in_records
    )
    # Beyond the named list, only torch's constants (dtypes, layouts, memory formats).
    assert {m for m, _ in in_metadata - ALLOWED_GLOBALS} <= {"torch"}


def test_fsspec_memory_checkpoint_loads_and_refuses_poison(tmp_path, common):
    pytest.importorskip("fsspec")
    import fsspec

    folder = "memory://sec-test/run"
    model = common.make_model(seed=0)
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=folder, interval=1, last_save_model_only=False),
        model_parts=[model],
        states={"train_state": Stateful(step=1)},
    )
    manager.save(1)
    manager.close()

    fs = fsspec.filesystem("memory")
    metadata = fs.cat(f"{folder}/step-1/.metadata")
    seen: set = set()
    _Recorder(metadata, seen).load()
    assert [g for g in seen if not _allowed_in_metadata(*g)] == []

    def load() -> bool:
        loader = CheckpointManager(
            CheckpointConfig(enable=True, folder=folder),
            model_parts=[common.make_model(seed=1)],
            states={"train_state": Stateful(step=0)},
        )
        try:
            return loader.load()
        finally:
            loader.close()

    assert load()
    marker = tmp_path / "pwned"
    parsed = pickle.loads(metadata)
    parsed.planner_data = {"note": Poison(marker)}
    fs.pipe(f"{folder}/step-1/.metadata", pickle.dumps(parsed))
    local = tmp_path / "copy"
    fs.get(f"{folder}/step-1", str(local), recursive=True)
    _rehash(local)
    fs.pipe(f"{folder}/step-1/{COMMIT_MARKER}", (local / COMMIT_MARKER).read_bytes())
    with pytest.raises(UnsafeCheckpointError, match=SYSTEM):
        load()
    assert not marker.exists()
    fs.rm("memory://sec-test", recursive=True)


def test_torch_save_file_with_a_foreign_class_is_refused_naming_it(tmp_path, titan_ckpt):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2), "note": Poison(marker)}, path)
    code, _, err = titan_ckpt("inspect", path)
    assert code == 1, err
    assert SYSTEM in err
    assert "model.pt" in err
    assert not marker.exists()


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x8e" + (1 << 40).to_bytes(8, "little") + b".", "runs past the end"),  # 1 TiB bytes
        (b"\x96" + (1 << 33).to_bytes(8, "little") + b".", "runs past the end"),  # bytearray
        (b"B" + (1 << 31).to_bytes(4, "little") + b".", "runs past the end"),  # 2 GiB bytes
        (b"]r" + (1 << 31).to_bytes(4, "little") + b".", "memo index"),  # a 32 GiB memo
        (b"]p99999999999\n.", "memo index"),
        (b"\x80\x04\x95" + (1 << 50).to_bytes(8, "little") + b"N.", "frame"),
        (b"\x80\x04N", "ends before its STOP"),
        (b"\xffN.", "not a pickle opcode"),
    ],
)
def test_pickles_that_would_allocate_beyond_their_size_are_refused_unrun(data, why, tmp_path):
    # The C unpickler allocates a BINBYTES8 body, and zeroes a memo up to the largest index,
    # before it reads: these few bytes would ask for gigabytes. The walk refuses them first.
    from titan_ckpt import CheckpointReadError
    from titan_ckpt.formats.pickles import load_metadata

    with pytest.raises(CheckpointReadError, match=why):
        load_metadata(io.BytesIO(data), str(tmp_path / ".metadata"))


def test_the_opcode_walk_accepts_every_protocol():
    from titan_ckpt.formats.pickles import prescan

    value = {"a": [1, 2.5, None, True, "x" * 300, b"y" * 70000, (1,) * 300, 10**40, {1, 2}]}
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        prescan(pickle.dumps(value, protocol=protocol))
        prescan(pickle.dumps(list(range(1000)), protocol=protocol))


# --- hostile metadata that unpickles under the allowlist -----------------------------------


def _edit_metadata(step: Path, edit) -> None:
    """Rewrite a copy's .metadata through ``edit`` and drop titan's markers (a plain DCP
    step then: no manifest stands between the metadata and the readers)."""
    metadata = pickle.loads((step / ".metadata").read_bytes())  # ours: trusted
    edit(metadata)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    (step / COMMIT_MARKER).unlink()
    (step / OWNER_MARKER).unlink()


def test_a_data_file_outside_the_checkpoint_is_refused(saved_folder, tmp_path, titan_ckpt):
    # A record "stored" in another file of the machine: reading it would copy that file's
    # bytes into whatever the checkpoint is converted to.
    step = tmp_path / "step-2"
    shutil.copytree(saved_folder / "step-2", step)
    secret = tmp_path / "secret.txt"
    secret.write_text("password")

    def point_outside(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../secret.txt"

    _edit_metadata(step, point_outside)
    code, _, err = titan_ckpt("convert", step, tmp_path / "out.pt", "--to", "torch")
    assert code == 1
    assert "outside the checkpoint" in err
    assert not (tmp_path / "out.pt").exists()


def test_verify_of_many_thousand_chunks_is_fast_and_finds_an_overlap(saved_folder, tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    from titan_ckpt.commands.verify import verify_path

    step = tmp_path / "step-2"
    shutil.copytree(saved_folder / "step-2", step)
    n = 20_000

    def many_chunks(metadata):
        entry = metadata.state_dict_metadata["0.weight"]
        entry.size = torch.Size([n + 1, 16])
        entry.chunks = [
            ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 16]))
            for i in range(n)
        ] + [ChunkStorageMetadata(offsets=torch.Size([n - 1, 0]), sizes=torch.Size([2, 16]))]

    _edit_metadata(step, many_chunks)
    started = time.perf_counter()
    report = verify_path(str(step))
    assert time.perf_counter() - started < 20  # pairwise, 2e8 comparisons: minutes
    assert not report["ok"]
    assert any(
        f"0.weight: shards at offsets [{n - 1}, 0] and [{n - 1}, 0] overlap" in p
        for p in report["problems"]
    ), report["problems"][:3]
