"""One error family: every error titan-ckpt raises on purpose is a ``CheckpointError``;
integrity errors carry their problems as a list; the library names ``ConvertOptions`` fields
and the command shows its flags; the shared checks (``check_int``, ``check_number``,
``check_choice``, ``check_bool``) raise the config error with the message every titan package's
``errors.py`` uses (those cases, at the end, are the same in every ``test_errors.py``)."""

from __future__ import annotations

import pickle

import pytest
import torch

import titan_ckpt
from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointManager,
    CheckpointReadError,
    CheckpointWriteError,
    DiskFullError,
    LocalStorage,
    ModelState,
    OptimizerState,
    UnsafeCheckpointError,
)
from titan_ckpt.commands.cli import flag_text
from titan_ckpt.commands.convert import ConvertOptions, convert
from titan_ckpt.errors import check_bool, check_choice, check_int, check_number
from titan_ckpt.formats.base import select_keys
from titan_ckpt.layout import commit_step, hash_files, read_manifest, verify_step

CONFIG_ERROR = CheckpointConfigError


def test_one_root_and_the_old_bases():
    for cls in (CheckpointConfigError, CheckpointFormatError):
        assert issubclass(cls, CheckpointError)
        assert issubclass(cls, ValueError)
    for cls in (CheckpointReadError, CheckpointIntegrityError, CheckpointWriteError):
        assert issubclass(cls, CheckpointError)
        assert issubclass(cls, RuntimeError)
    assert issubclass(UnsafeCheckpointError, CheckpointReadError)
    assert issubclass(DiskFullError, CheckpointWriteError)


def test_errors_keep_their_fields_between_ranks():
    # Rank 0 broadcasts the error every rank raises: a pickle round trip keeps its fields.
    error = CheckpointIntegrityError("damaged", problems=["a: missing", "b: 3 bytes"])
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.problems) == (
        CheckpointIntegrityError, "damaged", ["a: missing", "b: 3 bytes"])  # fmt: skip
    full = pickle.loads(pickle.dumps(DiskFullError("full", path="/x", needed=5, free=1)))
    assert (full.path, full.needed, full.free) == ("/x", 5, 1)


def test_integrity_problems_are_a_list_one_per_file(common, tmp_path):
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path), interval=1),
        model_parts=common.make_model(),
    )
    manager.save(1)
    manager.close()
    step = tmp_path / "step-1"
    data = sorted(p for p in step.iterdir() if p.suffix == ".distcp")
    data[0].unlink()
    (step / ".metadata").write_bytes((step / ".metadata").read_bytes() + b"x")
    manifest = read_manifest(LocalStorage(), str(step))
    with pytest.raises(CheckpointIntegrityError) as caught:
        verify_step(LocalStorage(), str(step), manifest, checksums=True)
    size = (step / ".metadata").stat().st_size
    assert caught.value.problems == sorted(
        [f"{data[0].name}: missing", f".metadata: {size} bytes, the manifest says {size - 1}"]
    )


def test_bad_input_to_the_states_is_a_config_error():
    with pytest.raises(CheckpointConfigError, match="model_parts is empty"):
        ModelState([])
    with pytest.raises(CheckpointConfigError, match="one optimizer per model part"):
        OptimizerState([torch.nn.Linear(2, 2)] * 2, [])
    model = ModelState(torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointConfigError, match=r"lacks model keys \['weight', 'bias'\]"):
        model.load_state_dict({})


def test_commit_step_takes_other_ranks_hashes_and_hashes_the_rest(tmp_path):
    storage = LocalStorage()
    (tmp_path / "__0_0.distcp").write_bytes(b"rank zero")
    (tmp_path / "__1_0.distcp").write_bytes(b"rank one")
    (tmp_path / ".tmp-partial").write_bytes(b"skipped")
    theirs = hash_files(storage, str(tmp_path), prefix="__1_")
    assert list(theirs) == ["__1_0.distcp"]
    (algorithm,) = (k for k in theirs["__1_0.distcp"] if k != "size")
    theirs["__1_0.distcp"][algorithm] = "0" * 32  # taken as given: not hashed again
    manifest = titan_ckpt.layout.Manifest(step=1, world_size=2, states=["model"], model_only=True)
    commit_step(storage, str(tmp_path), manifest, theirs)
    written = read_manifest(storage, str(tmp_path))
    assert sorted(written.files) == ["__0_0.distcp", "__1_0.distcp"]
    assert written.files["__1_0.distcp"][algorithm] == "0" * 32
    assert (
        written.files["__0_0.distcp"]
        == hash_files(storage, str(tmp_path), prefix="__0_")["__0_0.distcp"]
    )


def test_select_keys_keeps_order_and_applies_both_globs():
    keys = ["tok.weight", "layers.0.w", "layers.1.w", "optimizer.state.x"]
    assert select_keys(keys) == keys
    assert select_keys(keys, ["layers.*"], ["*.1.*"]) == ["layers.0.w"]
    assert select_keys(keys, exclude=["optimizer.*"]) == keys[:3]


def test_library_errors_name_options_and_the_command_shows_flags(tmp_path, saved_folder):
    step = str(saved_folder / "step-2")
    with pytest.raises(CheckpointConfigError) as caught:
        convert(step, str(tmp_path / "o"), ConvertOptions(to="hf"))
    message = str(caught.value)
    assert message.startswith("options.to='hf' needs options.model (an installed")
    assert "--" not in message
    assert flag_text(message).startswith("--to hf needs --model (an installed")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("library", "command"),
    [
        ("options.hf_config needs options.model.", "--hf-config needs --model."),
        ("pass options.overwrite=True to replace it", "pass --overwrite to replace it"),
        ("after options.model_only/options.include/options.exclude.",
         "after --model-only/--include/--exclude."),
        ("choose with options.rope_scaling='none' or", "choose with --rope-scaling none or"),
        ("/data/options.model/x and my_options.to", "/data/options.model/x and my_options.to"),
    ],
)  # fmt: skip
def test_flag_text(library, command):
    assert flag_text(library) == command


def test_progress_reaches_the_total_once_more_at_the_end(tmp_path, saved_folder):
    calls: list[tuple[int, int]] = []
    options = ConvertOptions(
        to="safetensors", model_only=True, on_progress=lambda *a: calls.append(a)
    )
    summary = convert(str(saved_folder / "step-2"), str(tmp_path / "m.safetensors"), options)
    total = calls[-1][1]
    assert calls[-1] == (total, total)
    assert total == summary["bytes"]
    done = [d for d, _ in calls[:-1]]
    assert done == sorted(done)
    assert done[-1] == total


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: check_int("a.n", 0, minimum=1),
            "a.n=0 is not allowed; it must be a whole number >= 1.",
        ),
        (
            lambda: check_int("a.n", 2.0, minimum=1),
            "a.n=2.0 is not allowed; it must be a whole number >= 1.",
        ),
        (
            lambda: check_int("a.n", True, minimum=0),
            "a.n=True is not allowed; it must be a whole number >= 0.",
        ),
        (
            lambda: check_int("a.n", -2, minimum=1, sentinel=(-1, "all of them")),
            "a.n=-2 is not allowed; it must be -1 (all of them) or a whole number >= 1.",
        ),
        (
            lambda: check_int("a.n", "3", minimum=0, hint="0 turns it off"),
            "a.n='3' is not allowed; it must be a whole number >= 0 (0 turns it off).",
        ),
        (
            lambda: check_number("a.x", -0.5, low=0),
            "a.x=-0.5 is not allowed; it must be a finite number >= 0.",
        ),
        (
            lambda: check_number("a.x", 0, low=0, low_open=True),
            "a.x=0 is not allowed; it must be a finite number > 0.",
        ),
        (
            lambda: check_number("a.x", 1.0, low=0, high=1, high_open=True),
            "a.x=1.0 is not allowed; it must be a finite number in [0, 1).",
        ),
        (
            lambda: check_number("a.x", float("nan")),
            "a.x=nan is not allowed; it must be a finite number.",
        ),
        (
            lambda: check_number("a.x", "1e-3", high=1),
            "a.x='1e-3' is not allowed; it must be a finite number <= 1.",
        ),
        (
            lambda: check_choice("a.c", "z", ("x", "y")),
            "a.c='z' is not allowed; choose one of 'x', 'y'.",
        ),
        (
            lambda: check_bool("a.b", "false"),
            "a.b='false' is not allowed; it must be true or false.",
        ),
    ],
)
def test_checks_raise_the_config_error_with_one_message_shape(call, message):
    with pytest.raises(CONFIG_ERROR) as error:
        call()
    assert str(error.value) == message


def test_checks_return_good_values():
    assert check_int("n", 3, minimum=1) == 3
    assert check_int("n", -1, minimum=1, sentinel=(-1, "rest")) == -1
    assert check_number("x", 1, low=0, high=1) == 1.0
    assert isinstance(check_number("x", 1, low=0), float)
    assert check_choice("c", "y", ["x", "y"]) == "y"
    assert check_bool("b", False) is False


def test_checks_raise_another_error_when_asked():
    with pytest.raises(KeyError):
        check_int("n", 0, minimum=1, error=KeyError)
    with pytest.raises(ValueError) as error:
        check_number("max_norm", -1.0, low=0, error=ValueError)
    assert type(error.value) is ValueError
