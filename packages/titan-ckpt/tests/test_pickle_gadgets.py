"""Hand-written pickle gadgets and a fuzz of random opcodes over the allowlists, through
every reader of titan-ckpt: nothing a checkpoint holds runs code or changes the process.

The gadgets are what an attacker who knows the allowlist writes (checked against
``titan_ckpt.formats.pickles``; each would run or change something in a "check, then
unpickle again" reader):

- *the cache pair*: two records in file order. The first replaces the cache of the
  allowlisted ``torch.serialization._get_layout`` (a ``BUILD`` on a function); the second
  calls ``_get_layout`` to compute a module and a name for ``STACK_GLOBAL`` and re-poisons the
  cache at its end, so a second unpickling of the same bytes resolves ``os.system``.
- ``BUILD`` on classes (``pathlib.PosixPath``, ``torch.Tensor``) and on an allowlisted
  function (``torch._utils._rebuild_tensor_v2``): each would change the process for every
  later use.

Each is put into real checkpoints (a record of a committed titan step, and ``.metadata``)
and read by ``CheckpointManager.load`` (resume and ``initial_load_path``), the torchft
dataloader reader and every ``titan-ckpt`` command; the marker file the pair would create
never appears and the objects it targets are unchanged.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import pickle
import random
import struct
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from titan_ckpt import CheckpointConfig, CheckpointManager, CheckpointReadError
from titan_ckpt.formats.pickles import (
    ALLOWED_GLOBALS,
    RECORD_GLOBALS,
    load_metadata,
    load_record,
)
from titan_ckpt.ft import read_entries
from titan_ckpt.layout import COMMIT_MARKER
from titan_ckpt.storage import LocalStorage

SYSTEM = (os.system.__module__, "system")


def _str(text: str) -> bytes:
    data = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _dict(items: dict[str, str]) -> bytes:
    body = b"".join(_str(k) + _str(v) for k, v in items.items())
    return pickle.EMPTY_DICT + pickle.MARK + body + pickle.SETITEMS


_GET_LAYOUT = _global("torch.serialization", "_get_layout")


def _set_cache(items: dict[str, str]) -> bytes:
    """``_get_layout.__dict__.update({"cache": items})``: a BUILD on the function."""
    state = pickle.EMPTY_DICT + pickle.MARK + _str("cache") + _dict(items) + pickle.SETITEMS
    return _GET_LAYOUT + state + pickle.BUILD + pickle.POP


def _layout_of(key: str) -> bytes:
    return _GET_LAYOUT + _str(key) + pickle.TUPLE1 + pickle.REDUCE


def cache_pair(marker: Path) -> tuple[bytes, bytes]:
    """The two records of the cache gadget (see the module docstring)."""
    prime = pickle.PROTO + b"\x02" + _set_cache({"m": "builtins", "n": "set"})
    prime += pickle.NONE + pickle.STOP
    fire = pickle.PROTO + b"\x02" + _layout_of("m") + _layout_of("n") + pickle.STACK_GLOBAL
    fire += _str(f"touch {marker}") + pickle.TUPLE1 + pickle.REDUCE + pickle.POP
    fire += _set_cache({"m": SYSTEM[0], "n": SYSTEM[1]}) + pickle.NONE + pickle.STOP
    return prime, fire


def build_on(module: str, name: str, attribute: str) -> bytes:
    """A BUILD on the global ``module.name`` that sets ``attribute`` (slot state: setattr)."""
    state = pickle.NONE + _dict({attribute: "changed"}) + pickle.TUPLE2
    return pickle.PROTO + b"\x02" + _global(module, name) + state + pickle.BUILD + pickle.STOP


BUILDS = {
    "PosixPath": ("pathlib", "PosixPath", "titan_gadget"),
    "Tensor": ("torch", "Tensor", "titan_gadget"),
    "rebuild": ("torch._utils", "_rebuild_tensor_v2", "__kwdefaults__"),
}


def untouched() -> None:
    """The objects the gadgets target are as torch and Python made them."""
    assert "m" not in torch.serialization._get_layout.cache
    assert not hasattr(pathlib.PosixPath, "titan_gadget")
    assert not hasattr(torch.Tensor, "titan_gadget")
    assert torch._utils._rebuild_tensor_v2.__kwdefaults__ is None


def torch_save_of(data_pkl: bytes) -> bytes:
    """A ``torch.save`` zip whose ``data.pkl`` is ``data_pkl``, as any writer can make."""
    module = types.ModuleType("raw_pickle")

    class Pickler:
        def __init__(self, file, protocol=None) -> None:
            self.file = file

        def dump(self, obj) -> None:
            self.file.write(data_pkl)

    module.Pickler = Pickler  # type: ignore[attr-defined]
    buffer = io.BytesIO()
    torch.save(None, buffer, pickle_module=module)
    return buffer.getvalue()


class Raw:
    """A record value written as the given ``data.pkl`` bytes (see ``raw_records``)."""

    def __init__(self, data_pkl: bytes) -> None:
        self.data = data_pkl


@pytest.fixture
def raw_records(monkeypatch):
    """While active, DCP's default save planner writes a ``Raw`` value's bytes as its record."""
    original = DefaultSavePlanner.transform_object

    def transform(self, write_item, obj):
        if isinstance(obj, Raw):
            return io.BytesIO(torch_save_of(obj.data))
        return original(self, write_item, obj)

    monkeypatch.setattr(DefaultSavePlanner, "transform_object", transform)


class Stateful:
    def __init__(self, **values) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict) -> None:
        self.values = dict(state_dict)


def _committed_step(folder: Path, common, **values) -> Path:
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), interval=1, last_save_model_only=False),
        model_parts=[common.make_model(seed=0)],
        states={"dataloader": Stateful(**values)},
    )
    manager.save(1, last_step=True)
    manager.close()
    return folder / "step-1"


def _with_metadata_prefix(step: Path, prefix: bytes) -> None:
    """Run ``prefix`` (opcodes leaving nothing on the stack) before DCP's ``.metadata``, and
    update the commit marker's manifest as an attacker editing a checkpoint would."""
    path = step / ".metadata"
    data = path.read_bytes()
    assert data[:1] == pickle.PROTO
    path.write_bytes(data[:2] + prefix + data[2:])
    marker = step / COMMIT_MARKER
    body = json.loads(marker.read_text())
    for rel in body["files"]:
        data = (step / rel).read_bytes()
        body["files"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    marker.write_text(json.dumps(body))


def _readers(step: Path, common, tmp_path: Path, titan_ckpt) -> list[tuple[str, str]]:
    """Read ``step`` with every reader; returns (reader, error text) for each, after asserting
    that each refused with one titan-ckpt error."""
    outcomes = []

    def manager(**config) -> str:
        m = CheckpointManager(
            CheckpointConfig(enable=True, **config),
            model_parts=[common.make_model(seed=1)],
            states={"dataloader": Stateful(a=None, b=None)},
        )
        try:
            with pytest.raises(CheckpointReadError) as error:
                m.load()
        finally:
            m.close()
        return str(error.value)

    outcomes.append(("resume", manager(folder=str(step.parent))))
    initial = manager(
        folder=str(tmp_path / "fresh"), initial_load_path=str(step), initial_load_model_only=False
    )
    outcomes.append(("initial_load_path", initial))
    with pytest.raises(CheckpointReadError) as error:
        read_entries(LocalStorage(), str(step), prefix="dataloader.")
    outcomes.append(("torchft dataloader", str(error.value)))
    out = tmp_path / "out"
    for command in (
        ["inspect", step],
        ["inspect", step, "--stats"],
        ["verify", step],
        ["diff", step, step],
        ["convert", step, out / "model.safetensors", "--to", "safetensors"],
        ["convert", step, out / "model.pt", "--to", "torch"],
        ["convert", step, out / "dcp", "--to", "dcp"],
    ):
        code, stdout, err = titan_ckpt(*command)
        assert code == 1, (command, stdout, err)
        assert err.count("titan-ckpt: error:") == 1, err
        assert "Traceback" not in err
        outcomes.append((" ".join(map(str, command[:1] + command[3:])), err))
    return outcomes


def test_the_cache_pair_in_records_runs_nothing_through_any_reader(
    tmp_path, common, raw_records, titan_ckpt
):
    marker = tmp_path / "pwned"
    prime, fire = cache_pair(marker)
    step = _committed_step(tmp_path / "run", common, a=Raw(prime), b=Raw(fire))
    for reader, error in _readers(step, common, tmp_path, titan_ckpt):
        assert "asks to unpickle" in error, (reader, error)
        assert "'dataloader.a'" in error, (reader, error)  # the first record: nothing before
    assert not marker.exists()
    untouched()


def test_the_cache_pair_in_metadata_runs_nothing_through_any_reader(tmp_path, common, titan_ckpt):
    marker = tmp_path / "pwned"
    step = _committed_step(tmp_path / "run", common, a=1, b=2)
    prime, fire = cache_pair(marker)
    # Both halves before DCP's own metadata, in the one pickle a reader sees.
    _with_metadata_prefix(step, prime[2:-2] + fire[2:-2])
    for reader, error in _readers(step, common, tmp_path, titan_ckpt):
        assert "change to the state of function _get_layout" in error, (reader, error)
        assert ".metadata" in error, (reader, error)
    assert not marker.exists()
    untouched()


@pytest.mark.parametrize("gadget", sorted(BUILDS))
def test_a_build_on_a_global_is_refused_in_records_and_metadata(gadget, tmp_path):
    module, name, attribute = BUILDS[gadget]
    data = build_on(module, name, attribute)
    with pytest.raises(CheckpointReadError, match="asks to unpickle"):
        load_record(io.BytesIO(torch_save_of(data)), "record")
    # .metadata's list has no tensor machinery: a BUILD on the PosixPath class, the name of
    # the others.
    refused = rf"asks to unpickle (a change to the state of class {name}|{module}\.{name}),"
    with pytest.raises(CheckpointReadError, match=refused):
        load_metadata(io.BytesIO(data), ".metadata")
    untouched()


def test_plain_unpickling_of_the_gadgets_does_change_the_process(tmp_path):
    # The control: the gadgets are real. A "check first, load again" reader ran both records
    # twice; two plain loads of the pair already run the marker's command.
    marker = tmp_path / "pwned"
    prime, fire = cache_pair(marker)
    saved = dict(torch.serialization._get_layout.cache)
    try:
        pickle.loads(prime)
        pickle.loads(fire)  # resolves builtins.set: harmless, then re-poisons the cache
        pickle.loads(fire)  # resolves os.system
        assert marker.exists()
    finally:
        torch.serialization._get_layout.cache = saved
    module, name, attribute = BUILDS["PosixPath"]
    pickle.loads(build_on(module, name, attribute))
    try:
        assert pathlib.PosixPath.titan_gadget == "changed"  # type: ignore[attr-defined]
    finally:
        del pathlib.PosixPath.titan_gadget  # type: ignore[attr-defined]
    untouched()


# The fuzz: random opcode sequences over both allowlists, a few forbidden names, literal and
# computed names for STACK_GLOBAL, and every opcode that builds or changes an object.
_NAMES = sorted(ALLOWED_GLOBALS | {tuple(n.rsplit(".", 1)) for _, n in RECORD_GLOBALS})
_NAMES += [SYSTEM, ("builtins", "eval"), ("torch.serialization", "_get_layout"),
           ("torch._utils", "_rebuild_tensor_v2"), ("torch", "float32"),
           ("torch", "Tensor")]  # fmt: skip
_WORDS = ["m", "n", "cache", "torch", "Size", "builtins", "set", SYSTEM[0], SYSTEM[1],
          "titan_gadget", "__kwdefaults__", "__dict__", "__class__", "touch {marker}"]  # fmt: skip


def _fuzz_case(rng: random.Random, marker: Path) -> bytes:
    out = [pickle.PROTO + bytes([rng.choice([2, 4])])]
    for _ in range(rng.randint(1, 24)):
        r = rng.random()
        if r < 0.2:
            out.append(_global(*rng.choice(_NAMES)))
        elif r < 0.35:
            out.append(_str(rng.choice(_WORDS).format(marker=marker)))
        elif r < 0.42:
            out.append(pickle.BININT1 + bytes([rng.randrange(256)]))
        elif r < 0.5:
            out.append(_set_cache({"m": SYSTEM[0], "n": SYSTEM[1]}))
        else:
            out.append(rng.choice([
                pickle.MARK, pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.EMPTY_TUPLE,
                pickle.EMPTY_DICT, pickle.EMPTY_LIST, pickle.EMPTY_SET, pickle.NONE,
                pickle.REDUCE, pickle.BUILD, pickle.NEWOBJ, pickle.STACK_GLOBAL,
                pickle.SETITEM, pickle.SETITEMS, pickle.APPEND, pickle.APPENDS,
                pickle.ADDITEMS, pickle.DUP, pickle.POP, pickle.BINPUT + b"\x00",
                pickle.BINGET + b"\x00", pickle.FROZENSET, pickle.LIST, pickle.DICT,
            ]))  # fmt: skip
    out.append(pickle.STOP)
    return b"".join(out)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_random_opcodes_over_the_allowlists_never_run_code_or_escape(tmp_path):
    marker = tmp_path / "pwned"
    rng = random.Random(27)
    outcomes = {"value": 0, "refused": 0, "damaged": 0}
    for _ in range(3000):
        data = _fuzz_case(rng, marker)
        for read, stream in (
            (load_record, io.BytesIO(torch_save_of(data))),
            (load_metadata, io.BytesIO(data)),
        ):
            try:
                read(stream, "fuzzed")
                outcomes["value"] += 1
            except CheckpointReadError as error:  # UnsafeCheckpointError is one
                outcomes["refused" if "asks to unpickle" in str(error) else "damaged"] += 1
    assert not marker.exists()
    untouched()
    # The fuzz reached all three ends, so it exercised the readers rather than their errors.
    assert min(outcomes.values()) > 100, outcomes
