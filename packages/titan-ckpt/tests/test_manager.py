"""CheckpointManager in one process: the policy (interval, first step, last step, a
model-only save, initial load, exclusions) checked against the real files it writes and the
state it restores."""

from __future__ import annotations

import gc
import json
import logging
import threading

import pytest
import torch

from titan_ckpt import (
    CheckpointConfig,
    CheckpointConfigError,
    CheckpointManager,
    OptimizerState,
    storage_for,
)
from titan_ckpt.layout import COMMIT_MARKER, scan_steps


class Counter:
    """A Stateful standing in for a dataloader or LR scheduler: one integer."""

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value = sd["value"]


class Run:
    """A tiny training run: model, AdamW, train state, lr scheduler and dataloader states."""

    def __init__(self, common, folder, seed=0, dataloader=True, **config):
        self.common = common
        self.model = common.make_model(seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.train_state = common.TrainState()
        self.lr = Counter()
        self.data = Counter() if dataloader else None
        states = {
            "optimizer": OptimizerState(self.model, self.opt),
            "lr_scheduler": self.lr,
            "train_state": self.train_state,
            "dataloader": self.data,
        }
        config.setdefault("interval", 2)
        self.config = CheckpointConfig(enable=True, folder=str(folder), **config)
        self.manager = CheckpointManager(self.config, model_parts=[self.model], states=states)

    def train(self, steps, *, last=None):
        for step in steps:
            self.common.train_steps(self.model, self.opt, range(step, step + 1), 0)
            self.train_state.step = step
            self.lr.value = step
            if self.data:
                self.data.value = step
            self.manager.save(step, last_step=step == last)

    def params(self):
        return {k: v.clone() for k, v in self.model.state_dict().items()}


def steps_on_disk(folder):
    return scan_steps(storage_for(str(folder)), str(folder)).committed


def test_round_trip_restores_model_optimizer_and_states(common, tmp_path):
    a = Run(common, tmp_path)
    a.train(range(1, 5))
    params, opt = a.params(), a.opt.state_dict()
    a.manager.close()

    b = Run(common, tmp_path, seed=7)
    assert b.manager.load()
    assert b.manager.last_loaded_step == 4
    assert all(torch.equal(v, params[k]) for k, v in b.model.state_dict().items())
    assert (b.train_state.step, b.lr.value, b.data.value) == (4, 4, 4)
    for pid, st in b.opt.state_dict()["state"].items():
        assert torch.equal(st["exp_avg"], opt["state"][pid]["exp_avg"])
    b.manager.close()


def test_interval_first_step_and_layout(common, tmp_path):
    run = Run(common, tmp_path, interval=3, enable_first_step_checkpoint=True, keep_latest_k=0)
    run.train(range(1, 8))
    run.manager.close()
    assert steps_on_disk(tmp_path) == [1, 3, 6]
    marker = json.loads((tmp_path / "step-6" / COMMIT_MARKER).read_text())
    assert marker["states"] == ["model", "dataloader", "lr_scheduler", "optimizer", "train_state"]
    assert (tmp_path / "step-6" / ".metadata").is_file()
    assert set(marker["files"]) == {".metadata", "__0_0.distcp"}


def test_load_nothing_returns_false_and_bad_load_step_is_refused(common, tmp_path):
    run = Run(common, tmp_path)
    assert not run.manager.load()
    with pytest.raises(CheckpointConfigError, match=r"load_step=4, but .* holds no committed"):
        run.manager.load(step=4)
    run.train(range(1, 3))
    with pytest.raises(CheckpointConfigError, match=r"load_step=3 is not a committed .*\[2\]"):
        run.manager.load(step=3)
    run.manager.close()


def test_load_step_picks_an_older_step(common, tmp_path):
    a = Run(common, tmp_path, keep_latest_k=0)
    a.train(range(1, 3))
    at_two = a.params()
    a.train(range(3, 5))
    a.manager.close()
    b = Run(common, tmp_path, seed=3, load_step=2)
    assert b.manager.load()
    assert b.train_state.step == 2
    assert all(torch.equal(v, at_two[k]) for k, v in b.model.state_dict().items())


def test_exclude_from_loading_keeps_those_states_fresh(common, tmp_path):
    Run(common, tmp_path).train(range(1, 3))
    b = Run(common, tmp_path, exclude_from_loading=["dataloader", "lr_scheduler"])
    assert b.manager.load()
    assert (b.train_state.step, b.lr.value, b.data.value) == (2, 0, 0)


def test_exclude_from_loading_typo_and_model_are_refused(common, tmp_path):
    with pytest.raises(CheckpointConfigError, match=r"names \['dataloder'\].*states are"):
        Run(common, tmp_path, exclude_from_loading=["dataloder"])
    with pytest.raises(CheckpointConfigError, match="always restores the model"):
        Run(common, tmp_path, exclude_from_loading=["model"])


def test_missing_state_in_checkpoint_is_refused_before_loading(common, tmp_path):
    a = Run(common, tmp_path, dataloader=False)
    a.train(range(1, 3))
    a.manager.close()
    b = Run(common, tmp_path, seed=5)
    before = b.params()
    with pytest.raises(CheckpointConfigError, match=r"holds no \['dataloader'\].*exclude_from"):
        b.manager.load()
    assert all(torch.equal(v, before[k]) for k, v in b.model.state_dict().items())


def test_last_save_is_model_only_in_export_dtype(common, tmp_path):
    run = Run(common, tmp_path, export_dtype="bfloat16")
    run.train(range(1, 4), last=3)
    run.manager.close()
    marker = json.loads((tmp_path / "step-3" / COMMIT_MARKER).read_text())
    assert marker["model_only"] is True
    assert marker["states"] == ["model"]
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tmp_path / "step-3")).read_metadata()
    assert set(meta.state_dict_metadata) == set(run.model.state_dict())
    assert {m.properties.dtype for m in meta.state_dict_metadata.values()} == {torch.bfloat16}


def test_model_only_save_then_load(common, tmp_path):
    """A trainer's seed checkpoint: ``save(0, force=True, model_only=True)`` writes the model
    alone (no optimizer, scheduler or dataloader), which a run then resumes from."""
    seed = Run(common, tmp_path, async_mode="async")
    assert seed.manager.save(0, force=True, model_only=True)
    # Written and committed when save returns, in an async mode too.
    marker = json.loads((tmp_path / "step-0" / COMMIT_MARKER).read_text())
    assert marker["model_only"]
    assert (marker["step"], marker["states"]) == (0, ["model"])
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(tmp_path / "step-0")).read_metadata()
    assert set(meta.state_dict_metadata) == set(seed.model.state_dict())
    seed.manager.close()

    run = Run(common, tmp_path, seed=9)
    assert run.manager.load()
    assert all(torch.equal(v, seed.params()[k]) for k, v in run.model.state_dict().items())
    assert run.train_state.step == 0
    assert run.opt.state_dict()["state"] == {}


def test_initial_load_path_model_only_and_full(common, tmp_path):
    src = Run(common, tmp_path / "pretrain")
    src.train(range(1, 3))
    src.manager.close()

    model_only = Run(
        common, tmp_path / "finetune", seed=4, initial_load_path=str(tmp_path / "pretrain")
    )
    assert model_only.manager.load()
    assert all(torch.equal(v, src.params()[k]) for k, v in model_only.model.state_dict().items())
    assert model_only.train_state.step == 0

    full = Run(
        common,
        tmp_path / "resume",
        seed=4,
        initial_load_path=str(tmp_path / "pretrain" / "step-2"),
        initial_load_model_only=False,
    )
    assert full.manager.load()
    assert full.train_state.step == 2
    # The run's own folder wins once it has a checkpoint: saves go there, not to the source.
    full.train(range(3, 5))
    full.manager.close()
    assert steps_on_disk(tmp_path / "resume") == [4]
    assert steps_on_disk(tmp_path / "pretrain") == [2]


def test_initial_load_path_that_is_not_a_checkpoint(common, tmp_path):
    (tmp_path / "empty").mkdir()
    run = Run(common, tmp_path / "run", initial_load_path=str(tmp_path / "empty"))
    with pytest.raises(CheckpointConfigError, match="neither a DCP checkpoint"):
        run.manager.load()
    run.manager.close()
    run = Run(common, tmp_path / "run", initial_load_path=str(tmp_path / "nope"))
    with pytest.raises(CheckpointConfigError, match="does not exist"):
        run.manager.load()


def test_uncommitted_step_is_ignored_and_logged(common, tmp_path, caplog):
    run = Run(common, tmp_path, keep_latest_k=0)
    run.train(range(1, 5))
    run.manager.close()
    (tmp_path / "step-4" / COMMIT_MARKER).unlink()  # as if the process died before committing
    b = Run(common, tmp_path, seed=2)
    with caplog.at_level(logging.WARNING, logger="titan_ckpt"):
        assert b.manager.load()
    assert b.train_state.step == 2
    assert "uncommitted" in caplog.text
    assert "step-4" in caplog.text
    with pytest.raises(CheckpointConfigError, match="present but uncommitted"):
        b.manager.load(step=4)


def test_disabled_manager_does_nothing(common, tmp_path):
    model = common.make_model()
    config = CheckpointConfig(enable=False, folder=str(tmp_path / "c"))
    manager = CheckpointManager(config, model_parts=model)
    assert manager.save(500) is False
    assert not manager.load()
    assert not (tmp_path / "c").exists()


def test_load_only_never_saves(common, tmp_path):
    run = Run(common, tmp_path, load_only=True)
    run.train(range(1, 5))
    assert not any(tmp_path.iterdir())


def test_states_without_state_dict_are_refused(common, tmp_path):
    with pytest.raises(TypeError, match=r"states\['train_state'\] is a int"):
        CheckpointManager(
            CheckpointConfig(enable=True, folder=str(tmp_path)),
            model_parts=common.make_model(),
            states={"train_state": 3},
        )


def test_checkpoint_of_another_model_is_refused_up_front(common, tmp_path):
    Run(common, tmp_path).train(range(1, 3))
    other = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(tmp_path)), model_parts=other
    )
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(
        CheckpointConfigError, match=r"0.weight \(32, 16\) in the checkpoint, \(64, 16\)"
    ):
        manager.load()
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_full_last_save_when_last_save_model_only_is_off(common, tmp_path):
    run = Run(common, tmp_path, last_save_model_only=False, export_dtype="bfloat16")
    run.train(range(1, 4), last=3)
    run.manager.close()
    marker = json.loads((tmp_path / "step-3" / COMMIT_MARKER).read_text())
    assert marker["model_only"] is False
    assert "optimizer" in marker["states"]
    b = Run(common, tmp_path, seed=6)
    assert b.manager.load()
    assert b.train_state.step == 3
    assert all(torch.equal(v, run.params()[k]) for k, v in b.model.state_dict().items())


class GcProbe(Counter):
    """A Stateful that records whether Python's garbage collector ran automatically while
    DCP asked for its state (inside ``dcp.save``) and gave it back (inside ``dcp.load``)."""

    def __init__(self) -> None:
        super().__init__(3)
        self.seen: list[bool] = []

    def state_dict(self):
        self.seen.append(gc.isenabled())
        return super().state_dict()

    def load_state_dict(self, state):
        self.seen.append(gc.isenabled())
        super().load_state_dict(state)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_garbage_collection_is_paused_inside_dcp_calls_and_restored(common, tmp_path, mode):
    # A full collection over the heap set off inside a load or save costs ~0.1 s there;
    # the manager pauses the collector around DCP's calls and restores what it found.
    probe = GcProbe()
    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode=mode)
    manager = CheckpointManager(config, model_parts=common.make_model(), states={"probe": probe})
    assert gc.isenabled()
    manager.save(1)
    manager.wait()
    assert gc.isenabled()
    assert manager.load()
    assert gc.isenabled()
    assert len(probe.seen) >= 2  # its state was saved and loaded
    assert not any(probe.seen)  # paused in every call DCP made
    gc.disable()  # a trainer that manages collection itself (titan-train) keeps it off
    try:
        manager.save(2)
        manager.wait()
        assert manager.load()
        assert not gc.isenabled()
    finally:
        gc.enable()
        manager.close()


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_dcp_events_are_made_only_for_a_handler_that_hears_them(common, tmp_path, mode):
    # DCP logs two debug records per call and per state entry to a logger that torch gives
    # a NullHandler and no propagation: the manager skips making them while nothing else
    # listens (a few milliseconds of every save), and leaves them to a handler attached.
    from torch.distributed.checkpoint.logger import _dcp_logger as events

    made: list[logging.LogRecord] = []
    factory = logging.getLogRecordFactory()

    def counting(*args, **kwargs):
        record = factory(*args, **kwargs)
        if record.name == events.name:
            made.append(record)
        return record

    config = CheckpointConfig(enable=True, folder=str(tmp_path), interval=1, async_mode=mode)
    manager = CheckpointManager(config, model_parts=common.make_model(), states={"c": Counter()})
    # As torch leaves it: pytest's log capture attaches handlers of its own.
    attached = events.handlers
    events.handlers = [h for h in attached if type(h) is logging.NullHandler]
    logging.setLogRecordFactory(counting)
    try:
        manager.save(1)
        manager.wait()
        assert manager.load()
        # None on this thread; an async save's upload thread logs on after save() returned.
        assert [r for r in made if r.thread == threading.get_ident()] == []
        assert not events.disabled  # restored
        made.clear()

        heard: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = heard.append  # type: ignore[method-assign]
        events.addHandler(handler)
        try:
            manager.save(2)
            manager.wait()
        finally:
            events.removeHandler(handler)
        assert any("step-2" in r.getMessage() for r in heard if r.thread == threading.get_ident())
        assert made == heard
    finally:
        logging.setLogRecordFactory(factory)
        events.handlers = attached
        manager.close()
