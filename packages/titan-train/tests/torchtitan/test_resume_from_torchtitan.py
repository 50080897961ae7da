"""titan resumes a run that torchtitan itself checkpointed, and never touches its files.

The reference in ``data/`` was written by torchtitan 6204cdff9 (July 2025) on CPU, once, by
``tools/torchtitan_reference/record.py``: a tiny Llama 3's full-state checkpoint after step 4
of a 10-step run, the batch of step 5, torchtitan's loss on it, the lr of every step and the
weights after step 5's optimizer step. Checked here: titan loads that checkpoint at step 4,
with torchtitan's lr for step 5, computes torchtitan's loss on the batch, and its first
update equals torchtitan's (so the AdamW moments carried over); titan-train resumes it from
the checkpoint folder without changing a byte of it, and stops with exit 2 on a foreign one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_ckpt import MODEL_RECORD, CheckpointConfig, CheckpointManager
from titan_ckpt.layout import COMMIT_MARKER
from titan_models.llama3 import Llama3
from titan_optim import LRSchedulerConfig, OptimizerConfig, build_lr_schedulers, build_optimizers
from titan_train import TrainState, cross_entropy_loss
from titan_train.cli import main

HERE = Path(__file__).parent
DATA = HERE / "data"
META = json.loads((DATA / "reference.json").read_text())
STEP = META["checkpoint_step"]


@pytest.fixture(scope="module")
def reference() -> dict:
    return torch.load(DATA / "reference.pt", weights_only=True)


def tiny_model() -> torch.nn.Module:
    import tt_tiny_plugin  # on sys.path through the plugin fixture

    with torch.device("meta"):
        model = Llama3(tt_tiny_plugin.FLAVORS["tiny"])
    model.to_empty(device="cpu")
    model.init_weights(buffer_device=torch.device("cpu"))
    return model


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> list[str]:
    """Install ``tt_tiny_plugin`` as a model package: a dist-info with its entry point.
    Returns the paths a subprocess needs on PYTHONPATH."""
    site = tmp_path / "site"
    info = site / "tt_tiny_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tt-tiny-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[titan.models]\ntt-tiny = tt_tiny_plugin:SPEC\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(HERE))
    return [str(site), str(HERE)]


def resumed_run(folder: Path, **checkpoint):
    model = tiny_model()
    opt = META["optimizer"]
    optimizers = build_optimizers(
        [model],
        OptimizerConfig(lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"], weight_decay=0.1),
    )
    sched = META["lr_scheduler"]
    schedulers = build_lr_schedulers(
        optimizers,
        LRSchedulerConfig(warmup_steps=sched["warmup_steps"], decay_ratio=sched["decay_ratio"]),
        training_steps=META["training"]["steps"],
    )
    train_state = TrainState()
    manager = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(folder), **checkpoint),
        model_parts=[model],
        states={"optimizer": optimizers, "lr_scheduler": schedulers, "train_state": train_state},
    )
    assert manager.load()
    manager.close()
    return model, optimizers, schedulers, train_state


def first_update(model, optimizers, reference) -> dict[str, torch.Tensor]:
    """One training step on the recorded batch; returns each weight's change."""
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    loss = cross_entropy_loss(model(reference["inputs"]), reference["labels"])
    loss.backward()
    optimizers.clip_grad_norm_(META["optimizer"]["max_norm"])
    optimizers.step()
    return {k: model.state_dict()[k] - before[k] for k in reference["weights_after"]}, loss


def test_titan_continues_torchtitans_run(plugin, reference, tmp_path):
    folder = tmp_path / "checkpoint"
    shutil.copytree(DATA / "checkpoint", folder)
    model, optimizers, schedulers, train_state = resumed_run(folder)

    assert train_state.step == STEP
    assert schedulers.get_last_lr() == [META["lrs"][STEP]]  # torchtitan's lr of step 5
    with torch.no_grad():
        loss = cross_entropy_loss(model(reference["inputs"]), reference["labels"])
    assert float(loss) == pytest.approx(float(reference["loss"]), abs=1e-5)
    assert float(loss) == pytest.approx(META["losses"][STEP], abs=1e-5)

    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    update, _ = first_update(model, optimizers, reference)
    for name, delta in update.items():
        torchtitan_delta = reference["weights_after"][name] - start[name]
        scale = torchtitan_delta.abs().max()
        assert scale > 0
        assert (delta - torchtitan_delta).abs().max() <= 1e-3 * scale, name


def test_without_torchtitans_moments_the_update_differs(plugin, reference, tmp_path):
    """The control: the same step with fresh AdamW state is far from torchtitan's update."""
    folder = tmp_path / "checkpoint"
    shutil.copytree(DATA / "checkpoint", folder)
    model, optimizers, _, _ = resumed_run(folder, exclude_from_loading=["optimizer", "dataloader"])
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    update, _ = first_update(model, optimizers, reference)
    worst = max(
        float((delta - (reference["weights_after"][k] - start[k])).abs().max()
              / (reference["weights_after"][k] - start[k]).abs().max())
        for k, delta in update.items()
    )  # fmt: skip
    assert worst > 0.1


def test_torchtitan_checkpoint_as_initial_load_path(plugin, tmp_path):
    source = DATA / "checkpoint"
    before = snapshot(source)
    _, _, schedulers, train_state = resumed_run(
        tmp_path / "full", initial_load_path=str(source), initial_load_model_only=False
    )
    assert train_state.step == STEP
    assert schedulers.get_last_lr() == [META["lrs"][STEP]]
    full_model = resumed_run(tmp_path / "full2", initial_load_path=str(source / f"step-{STEP}"),
                             initial_load_model_only=False)[0]  # fmt: skip
    model, _, schedulers, train_state = resumed_run(
        tmp_path / "model-only", initial_load_path=str(source / f"step-{STEP}")
    )
    assert train_state.step == 0  # model only: the run starts at step 1 ...
    assert schedulers.get_last_lr()[0] < META["lrs"][STEP]  # ... warming up again
    for key, value in full_model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value)
    assert snapshot(source) == before


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


TRAIN = [
    "--model.name", "tt-tiny", "--model.flavor", "tiny",
    "--training.seq_len", "32", "--training.local_batch_size", "2",
    "--training.steps", str(META["training"]["steps"]),
    "--lr_scheduler.warmup_steps", str(META["lr_scheduler"]["warmup_steps"]),
    "--lr_scheduler.decay_ratio", str(META["lr_scheduler"]["decay_ratio"]),
    "--optimizer.lr", str(META["optimizer"]["lr"]),
    "--checkpoint.interval", "100", "--metrics.log_freq", "1",
    "--metrics.no_enable_tensorboard",
    # torchtitan's reference ran in fp32; "auto" picks bf16 on CPUs with bf16 instructions.
    "--parallelize.param_dtype", "float32",
]  # fmt: skip


def test_titan_train_resumes_from_the_folder_and_leaves_it_unchanged(
    plugin, tmp_path, caplog, capsys
):
    out = tmp_path / "out"
    step_dir = out / "checkpoint" / f"step-{STEP}"
    shutil.copytree(DATA / "checkpoint" / f"step-{STEP}", step_dir)
    before = snapshot(step_dir)
    with caplog.at_level(logging.WARNING):
        code = main(["train", "--job.dump_folder", str(out), *TRAIN])
    assert code == 0, capsys.readouterr().err
    assert snapshot(step_dir) == before  # not one byte of torchtitan's step changed
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == list(range(STEP + 1, META["training"]["steps"] + 1))  # continues at 5
    assert caplog.text.count("dataloader state is not portable") == 1
    # The schedule position and the step carried over: the last save (step 10) holds 10, not
    # the 6 steps this run took; July 2025's torchtitan kept no token count (counted from 0).
    last = out / "checkpoint" / f"step-{META['training']['steps']}"
    state = {"lr_scheduler": {"step": 0}, "train_state": {"step": 0, "tokens_seen": 0}}
    dcp.load(state, checkpoint_id=str(last), no_dist=True)
    steps_run = META["training"]["steps"] - STEP
    assert state["lr_scheduler"]["step"] == META["training"]["steps"]
    assert state["train_state"] == {
        "step": META["training"]["steps"],
        "tokens_seen": steps_run * 64,
    }


@pytest.mark.parametrize(
    ("options", "said", "offered", "recorded"),
    [
        ([], "with plain RoPE", "--model.rope_scaling llama3", None),
        (["--model.rope_scaling", "llama3"], "with Llama 3.1 RoPE scaling", "none", 8.0),
    ],
)
def test_resuming_torchtitan_states_the_rope_and_offers_the_other(
    plugin, tmp_path, caplog, capsys, options, said, offered, recorded
):
    """torchtitan records no RoPE: the resumed run says which it applies, in one line, with
    the key for the other; that key takes effect (the checkpoint it saves records it)."""
    out = tmp_path / "out"
    shutil.copytree(DATA / "checkpoint" / f"step-{STEP}", out / "checkpoint" / f"step-{STEP}")
    steps = ["--training.steps", str(STEP + 1)]
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--job.dump_folder", str(out), *TRAIN, *steps, *options]) == 0
    lines = [r.getMessage() for r in caplog.records if "RoPE" in r.getMessage()]
    assert len(lines) == 1, lines
    assert said in lines[0]
    assert offered in lines[0]
    saved = out / "checkpoint" / f"step-{STEP + 1}" / COMMIT_MARKER
    scaling = json.loads(saved.read_text())["metadata"][MODEL_RECORD]["args"]["rope_scaling"]
    assert (scaling and scaling["factor"]) == recorded


def test_titan_train_stops_on_a_foreign_step_directory(plugin, tmp_path, capsys):
    out = tmp_path / "out"
    foreign = out / "checkpoint" / f"step-{STEP}"
    dcp.save({"weight": torch.ones(4)}, checkpoint_id=str(foreign), no_dist=True)
    before = snapshot(out)
    code = main(["train", "--job.dump_folder", str(out), *TRAIN])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("titan-train: error:") == 1
    assert str(foreign) in err
    assert "another checkpoint.folder" in err
    assert snapshot(out) == before  # nothing written, nothing removed


def test_two_fsdp_ranks_resume_torchtitans_single_process_checkpoint(plugin, tmp_path, capsys):
    """The same resume under FSDP on 2 ranks (resharded 1 -> 2): the same step-5 loss."""
    single, sharded = tmp_path / "single", tmp_path / "fsdp"
    for out in (single, sharded):
        shutil.copytree(DATA / "checkpoint", out / "checkpoint")
    short = [*TRAIN, "--training.steps", str(STEP + 2)]  # the last flag wins
    assert main(["train", "--job.dump_folder", str(single), *short]) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*plugin, os.environ.get("PYTHONPATH", "")])}
    fsdp = [
        "--nproc-per-node",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--training.local_batch_size",
        "1",
        "--parallelize.param_dtype",
        "float32",
    ]  # fmt: skip  (bf16 where "auto" picks it)
    command = [sys.executable, "-m", "titan_train.cli", "train", "--job.dump_folder", str(sharded)]
    done = subprocess.run([*command, *short, *fsdp], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert snapshot(sharded / "checkpoint" / f"step-{STEP}") == snapshot(
        DATA / "checkpoint" / f"step-{STEP}"
    )

    def losses(out: Path) -> dict[int, float]:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    one, two = losses(single), losses(sharded)
    assert list(two) == [STEP + 1, STEP + 2]
    for step in two:
        assert two[step] == pytest.approx(one[step], abs=1e-5)


def test_a_launcher_refuses_a_foreign_folder_once(plugin, tmp_path):
    """With --nproc-per-node 2 the folder is checked before any rank starts: one message."""
    out = tmp_path / "out"
    dcp.save({"weight": torch.ones(4)}, checkpoint_id=str(out / "checkpoint" / "step-3"),
             no_dist=True)  # fmt: skip
    before = snapshot(out)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*plugin, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "titan_train.cli", "train", "--job.dump_folder", str(out)]
    done = subprocess.run(
        [*command, *TRAIN, "--nproc-per-node", "2", "--parallelism.data_parallel_shard_degree", "2",
         "--training.local_batch_size", "1"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("titan-train: error:") == 1
    assert "step-3" in done.stderr
    assert snapshot(out) == before


def test_seed_checkpoint_refuses_a_foreign_step_0(tmp_path, capsys):
    out = tmp_path / "out"
    dcp.save({"weight": torch.ones(4)}, checkpoint_id=str(out / "checkpoint" / "step-0"),
             no_dist=True)  # fmt: skip
    before = snapshot(out)
    code = main(["train", "--job.dump_folder", str(out), "--checkpoint.create_seed_checkpoint"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("titan-train: error:") == 1
    assert "step-0 (a model-only DCP checkpoint" in err
    assert snapshot(out) == before


class Poison:
    """Pickles as ``os.system("touch <marker>")``: unpickling it creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_poisoned_torchtitan_step_runs_nothing_on_any_path(plugin, tmp_path, capsys):
    """torchtitan's step with a ``.metadata`` that would run code (no titan marker, so it is
    told apart by that metadata): resuming from its folder, loading it as initial_load_path
    and every titan-ckpt command stop with one message naming the global; nothing runs."""
    from titan_ckpt.commands.cli import main as titan_ckpt

    marker = tmp_path / "pwned"
    out = tmp_path / "out"
    step = out / "checkpoint" / f"step-{STEP}"
    shutil.copytree(DATA / "checkpoint" / f"step-{STEP}", step)
    metadata = pickle.loads((step / ".metadata").read_bytes())  # torchtitan's file: trusted
    metadata.planner_data = {"note": Poison(marker)}
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    pickle.loads((step / ".metadata").read_bytes())  # the control: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    before = snapshot(tmp_path)
    system = f"{os.system.__module__}.system"

    runs = {
        "resume": ["--job.dump_folder", str(out)],
        "initial_load_path": ["--job.dump_folder", str(tmp_path / "fresh"),
                              "--checkpoint.initial_load_path", str(step)],
    }  # fmt: skip
    for name, args in runs.items():
        assert main(["train", *TRAIN, *args]) == 2, name
        err = capsys.readouterr().err
        assert err.count("titan-train: error:") == 1, err
        assert f"{step / '.metadata'} asks to unpickle {system}" in err, err
        assert "WARNING" not in err  # one message, not a warning before it
    commands = [
        ["inspect", step], ["verify", step], ["verify", step.parent],
        ["diff", step, DATA / "checkpoint" / f"step-{STEP}"],
        ["convert", step, tmp_path / "hf", "--to", "hf", "--model", "llama3",
         "--rope-scaling", "none"],
    ]  # fmt: skip
    for command in commands:
        assert titan_ckpt([str(a) for a in command]) == 1, command
        err = capsys.readouterr().err
        assert err.count("titan-ckpt: error:") == 1, err
        assert system in err, err
    assert not marker.exists()
    assert snapshot(tmp_path) == before  # nothing written, nothing changed
    assert not (tmp_path / "fresh").exists()
    assert not (tmp_path / "hf").exists()


def test_current_torchtitan_layout_carries_the_token_count(plugin, tmp_path, capsys):
    """torchtitan since August 2025 saves ``train_state.ntokens_seen`` and the schedule as
    ``{"last_epoch": n}``: the recorded step rewritten in that layout resumes with its count."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    flat = tmp_path / "step.pt"
    dcp_to_torch_save(DATA / "checkpoint" / f"step-{STEP}", flat)
    state = torch.load(flat, weights_only=False)  # torchtitan's recorded file: trusted here
    state["lr_scheduler"] = {"last_epoch": STEP}
    state["train_state"] = {"step": STEP, "ntokens_seen": 1000}
    torch.save(state, flat)
    out = tmp_path / "out"
    torch_save_to_dcp(flat, out / "checkpoint" / f"step-{STEP}")

    last = STEP + 2
    run = ["train", "--job.dump_folder", str(out), *TRAIN, "--training.steps", str(last)]
    assert main(run) == 0
    capsys.readouterr()
    saved = {"lr_scheduler": {"step": 0}, "train_state": {"step": 0, "tokens_seen": 0}}
    dcp.load(saved, checkpoint_id=str(out / "checkpoint" / f"step-{last}"), no_dist=True)
    assert saved["lr_scheduler"]["step"] == last
    assert saved["train_state"] == {"step": last, "tokens_seen": 1000 + 2 * 64}


def test_every_step_trains_at_torchtitans_learning_rate(plugin, tmp_path):
    """The same 10-step run in titan-train: each step's lr is the one torchtitan's own
    trainer used at that step (recorded), warmup, decay and the last step included."""
    out = tmp_path / "out"
    assert main(["train", "--job.dump_folder", str(out), *TRAIN, "--checkpoint.no_enable"]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lrs = [r["lr"] for r in map(json.loads, lines) if "loss" in r]
    assert lrs == pytest.approx(META["lrs"], rel=1e-6)
