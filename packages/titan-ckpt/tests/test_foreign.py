"""Step directories titan did not write: recognised, never deleted, overwritten or written into.

Checked against real DCP directories on disk: plain DCP checkpoints, unknown files, and
checkpoints laid out as torchtitan writes them (its July 2025 and current ``lr_scheduler`` and
``train_state``, read from torchtitan's source). titan-train's tests resume from a checkpoint
that torchtitan itself wrote.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointManager,
    OptimizerState,
    check_folder_contents,
    storage_for,
)
from titan_ckpt.layout import OWNER_MARKER, classify_step, scan_steps


class Recorder:
    """A Stateful that keeps what it was asked to load."""

    def __init__(self, state=None) -> None:
        self.state = state or {"value": 0}
        self.loaded = None

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, sd):
        self.loaded = dict(sd)


def write_torchtitan(common, directory: Path, *, step: int = 3, layout: str = "current") -> None:
    """A full-state checkpoint with torchtitan's keys (model FQNs at the top level)."""
    model = common.make_model(seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    common.train_steps(model, opt, range(1, step + 1), rank=0)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    if layout == "current":
        lr_scheduler = {"last_epoch": step}
        train_state = {"step": step, "ntokens_seen": 96 * step}
        dataloader = {"version": 1, "dp_world_size": 1, "dp_rank_0": b"grain state"}
    else:  # July 2025: LambdaLR.state_dict() of the first scheduler, the step alone
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        for _ in range(step):
            scheduler.step()
        lr_scheduler = scheduler.state_dict()
        lr_scheduler.pop("lr_lambdas")
        train_state = {"step": step}
        dataloader = {"dp_rank_0": b"torchdata state", "world_size": 1}
    state = {
        **model.state_dict(),
        "optimizer": get_optimizer_state_dict(model, opt, options=flat),
        "lr_scheduler": lr_scheduler,
        "train_state": train_state,
        "dataloader": dataloader,
    }
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def write_plain_dcp(directory: Path) -> None:
    dcp.save({"weight": torch.ones(3)}, checkpoint_id=str(directory), no_dist=True)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` with its sha256: to prove nothing changed."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def manager(common, folder: Path, **config) -> tuple[CheckpointManager, dict]:
    model = common.make_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    states = {
        "optimizer": OptimizerState(model, opt),
        "lr_scheduler": Recorder({"step": 0}),
        "train_state": Recorder({"step": 0, "tokens_seen": 0}),
        "dataloader": Recorder(),
    }
    config.setdefault("interval", 1)
    cfg = CheckpointConfig(enable=True, folder=str(folder), **config)
    return CheckpointManager(cfg, model_parts=[model], states=states), {"model": model, **states}


def test_every_kind_of_step_directory_is_told_apart(common, tmp_path):
    storage = storage_for(str(tmp_path))
    run, _ = manager(common, tmp_path, keep_latest_k=0)
    run.save(1)
    run.save(2)
    run.close()
    (tmp_path / "step-2" / "titan-commit.json").unlink()  # ours, interrupted before commit
    (tmp_path / "step-3").mkdir()  # empty: nothing to lose
    write_torchtitan(common, tmp_path / "step-4", layout="2025-07")
    write_torchtitan(common, tmp_path / "step-5", layout="current")
    write_plain_dcp(tmp_path / "step-6")
    (tmp_path / "step-7").mkdir()
    (tmp_path / "step-7" / "notes.txt").write_text("mine")
    (tmp_path / "step-8").write_text("a file, not a directory")

    kinds = {s: classify_step(storage, str(tmp_path / f"step-{s}")) for s in range(1, 9)}
    assert kinds == {
        1: "committed",
        2: "interrupted",
        3: "interrupted",
        4: "torchtitan",
        5: "torchtitan",
        6: "foreign",
        7: "foreign",
        8: "foreign",
    }
    assert (tmp_path / "step-1" / OWNER_MARKER).is_file()
    scan = scan_steps(storage, str(tmp_path))
    assert (scan.committed, scan.uncommitted, scan.torchtitan, scan.foreign) == (
        [1],
        [2, 3],
        [4, 5],
        [6, 7, 8],
    )


def test_foreign_directory_stops_the_load_and_nothing_changes(common, tmp_path):
    write_plain_dcp(tmp_path / "step-4")
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    run, _ = manager(common, tmp_path)
    with pytest.raises(CheckpointConfigError) as error:
        run.load()
    message = str(error.value)
    assert str(tmp_path / "step-4") in message
    for way_out in ("another checkpoint.folder", "move these", "initial_load_path"):
        assert way_out in message
    assert "step-4 (a model-only DCP checkpoint" in message
    assert "step-5 (no titan marker and no readable DCP metadata)" in message
    with pytest.raises(CheckpointConfigError, match="step-4"):
        check_folder_contents(run.config)
    run.close()
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("layout", ["2025-07", "current"])
def test_resume_from_torchtitan_translates_its_states(common, tmp_path, caplog, layout):
    write_torchtitan(common, tmp_path / "step-3", layout=layout)
    before = snapshot(tmp_path)
    run, states = manager(common, tmp_path)
    with caplog.at_level(logging.WARNING, logger="titan_ckpt"):
        assert run.load()
    assert states["lr_scheduler"].loaded == {"step": 3}
    expected = {"step": 3, "ntokens_seen": 288} if layout == "current" else {"step": 3}
    assert states["train_state"].loaded == expected
    assert states["dataloader"].loaded is None  # not portable: skipped ...
    assert "dataloader state is not portable" in caplog.text  # ... with one warning
    assert caplog.text.count("not portable") == 1
    assert run.last_loaded_step == 3
    # The model and AdamW moments are torchtitan's.
    source = common.make_model(seed=5)
    opt = torch.optim.AdamW(source.parameters(), lr=0.01)
    common.train_steps(source, opt, range(1, 4), rank=0)
    for key, value in source.state_dict().items():
        assert torch.equal(states["model"].state_dict()[key], value)
    moments = states["optimizer"].state_dict()
    want = get_optimizer_state_dict(
        source, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    assert torch.equal(moments["state.0.weight.exp_avg"], want["state.0.weight.exp_avg"])
    run.close()
    assert snapshot(tmp_path) == before


def test_excluding_the_dataloader_skips_it_silently(common, tmp_path, caplog):
    write_torchtitan(common, tmp_path / "step-3")
    run, states = manager(common, tmp_path, exclude_from_loading=["dataloader"])
    with caplog.at_level(logging.WARNING, logger="titan_ckpt"):
        assert run.load()
    assert "not portable" not in caplog.text
    assert states["train_state"].loaded["step"] == 3
    run.close()


def test_saving_into_a_torchtitan_step_fails_before_writing(common, tmp_path):
    write_torchtitan(common, tmp_path / "step-3")
    before = snapshot(tmp_path)
    run, _ = manager(common, tmp_path)
    with pytest.raises(CheckpointConfigError, match=r"Cannot save step 3: .*step-3 .*torchtitan"):
        run.save(3)
    run.close()
    assert snapshot(tmp_path) == before


def test_preflight_refuses_saves_over_torchtitan_steps(common, tmp_path):
    write_torchtitan(common, tmp_path / "step-4")
    write_torchtitan(common, tmp_path / "step-8")
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=4)
    check_folder_contents(config, final_step=20)  # resumes from step 8: saves 12, 16, 20
    resume_at_4 = CheckpointConfig(enable=True, folder=str(tmp_path), interval=4, load_step=4)
    with pytest.raises(CheckpointConfigError, match=r"save step\(s\) \[8\].*load_step=8"):
        check_folder_contents(resume_at_4, final_step=20)
    check_folder_contents(resume_at_4, final_step=7)  # stops before step 8


def test_retention_never_deletes_what_is_not_ours(common, tmp_path):
    write_torchtitan(common, tmp_path / "step-1")
    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / "__0_0.distcp").write_bytes(b"someone else's partial save")
    before = snapshot(tmp_path)
    run, _ = manager(common, tmp_path, keep_latest_k=2)
    for step in range(3, 8):
        run.save(step)
    run.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2", "step-6", "step-7"]
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k.startswith(("step-1/", "step-2/"))} == before


def test_saving_over_a_step_that_is_a_symlink_leaves_its_target(common, tmp_path):
    folder = tmp_path / "ckpt"
    run, _ = manager(common, folder)
    run.save(3)
    run.close()
    archive = tmp_path / "archive"  # step-3 moved elsewhere and linked back: committed
    archive.mkdir()
    (folder / "step-3").rename(archive / "step-3")
    (folder / "step-3").symlink_to(archive / "step-3", target_is_directory=True)
    before = snapshot(archive)
    run, _ = manager(common, folder)
    with pytest.raises(CheckpointConfigError, match=r"Cannot save step 3: .*step-3"):
        run.save(3)
    run.close()
    assert snapshot(archive) == before
    assert (folder / "step-3").is_symlink()


def test_a_model_only_save_refuses_a_foreign_step_0(common, tmp_path):
    """A trainer's seed checkpoint (``save(0, force=True, model_only=True)``) over a plain
    DCP step 0: refused up front and at the save, nothing touched."""
    write_plain_dcp(tmp_path / "step-0")
    before = snapshot(tmp_path)
    run, _ = manager(common, tmp_path)
    with pytest.raises(CheckpointConfigError, match="step-0"):
        check_folder_contents(run.config)
    with pytest.raises(CheckpointConfigError, match="Cannot save step 0"):
        run.save(0, force=True, model_only=True)
    run.close()
    assert snapshot(tmp_path) == before


def test_interrupted_save_of_ours_is_still_cleaned_up(common, tmp_path):
    run, _ = manager(common, tmp_path)
    run.save(2)
    run.close()
    (tmp_path / "step-2" / "titan-commit.json").unlink()
    (tmp_path / "step-2" / "__0_0.distcp").write_bytes(b"half written")
    run, _ = manager(common, tmp_path)
    run.save(2)
    run.close()
    assert scan_steps(storage_for(str(tmp_path)), str(tmp_path)).committed == [2]
    assert (tmp_path / "step-2" / "__0_0.distcp").read_bytes() != b"half written"


def test_full_state_initial_load_of_plain_dcp_is_one_clear_error(common, tmp_path):
    source = tmp_path / "elsewhere"
    model = common.make_model(seed=3)
    dcp.save(model.state_dict(), checkpoint_id=str(source), no_dist=True)
    run, _ = manager(
        common, tmp_path / "run", initial_load_path=str(source), initial_load_model_only=False
    )
    with pytest.raises(CheckpointConfigError, match="initial_load_model_only=true"):
        run.load()
    run.close()
    run, states = manager(common, tmp_path / "run", initial_load_path=str(source))
    assert run.load()  # model only keeps working
    assert torch.equal(states["model"].state_dict()["0.weight"], model.state_dict()["0.weight"])
    run.close()


def test_verify_checks_torchtitan_steps_and_lists_foreign_ones(common, tmp_path):
    from titan_ckpt.commands.verify import verify_path

    write_torchtitan(common, tmp_path / "step-3")
    write_plain_dcp(tmp_path / "step-4")
    report = verify_path(str(tmp_path))
    assert report["ok"]
    assert [Path(s["path"]).name for s in report["steps"]] == ["step-3"]
    assert report["notes"] == ["step-4: not titan's or torchtitan's, not checked"]
    (tmp_path / "step-3" / "__0_0.distcp").write_bytes(b"truncated")
    assert not verify_path(str(tmp_path))["ok"]


def test_inspect_names_each_kind(common, tmp_path):
    from titan_ckpt.commands.inspect import inspect_path, render

    run, _ = manager(common, tmp_path)
    run.save(1)
    run.close()
    write_torchtitan(common, tmp_path / "step-3")
    write_plain_dcp(tmp_path / "step-4")
    report = inspect_path(str(tmp_path))
    assert [(s["step"], s["kind"]) for s in report["steps"]] == [
        (1, "committed"),
        (3, "torchtitan"),
        (4, "foreign"),
    ]
    text = render(report)
    assert "torchtitan checkpoint" in text
    assert "FOREIGN" in text
