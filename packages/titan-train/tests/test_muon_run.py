"""``titan-train --optimizer.name Muon``: a real run trains (its loss falls); a rule putting a
norm on Muon stops the run before any work.

Checked against the run's own metrics file; the optimizer's numerics are titan-optim's tests.
"""

import json

import pytest
import torch

from titan_optim import OptimizerConfig, OptimizerConfigError, ParamGroupRule
from titan_train import JobConfig, World, preflight
from titan_train.cli import main

ARGS = [
    "--training.seq_len", "64",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.name", "Muon",
    "--optimizer.lr", "3e-2",
    "--optimizer.muon.momentum", "0.9",
    # A narrow 2-block model: Newton-Schulz runs in bf16, whose matmuls are ~7x slower than
    # fp32 on CPUs without bf16 units (the debug model took 13 s a step here).
    "--model.args.dim", "64",
    "--model.args.n_layers", "2",
    "--model.args.n_heads", "4",
]  # fmt: skip


def losses(dump) -> dict[int, float]:
    lines = (dump / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_a_muon_run_trains(tmp_path):
    dump = tmp_path / "out"
    assert main(["train", "--job.dump_folder", str(dump), *ARGS, "--training.steps", "16"]) == 0
    seen = losses(dump)
    assert max(seen[i] for i in (14, 15, 16)) < seen[1] - 0.3


def test_a_rule_putting_a_norm_on_muon_stops_before_any_work(tmp_path, capsys):
    config = tmp_path / "muon.toml"
    config.write_text(
        '[optimizer]\nname = "Muon"\n'
        '[[optimizer.param_group_rules]]\npattern = "*norm*"\noptimizer = "Muon"\n'
    )
    dump = tmp_path / "out"
    argv = ["train", "--job.config_file", str(config), "--job.dump_folder", str(dump)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "param_group_rules['*norm*'] puts layers.0.attention_norm.weight" in err[0]
    assert "'AdamW'" in err[0]
    assert not dump.exists()


def test_preflight_refuses_a_rule_putting_a_norm_on_muon(tmp_path):
    config = JobConfig(
        optimizer=OptimizerConfig(
            name="Muon", param_group_rules=[ParamGroupRule(pattern="norm.*", optimizer="Muon")]
        )
    )
    config.job.dump_folder = str(tmp_path / "out")
    with pytest.raises(OptimizerConfigError, match=r"puts norm\.weight \(shape \(256,\)\) on Muon"):
        preflight(config, World(rank=0, world_size=1, device=torch.device("cpu")))
    config.optimizer.param_group_rules = [ParamGroupRule(pattern="output.*", optimizer="Muon")]
    assert preflight(config, World(rank=0, world_size=1, device=torch.device("cpu")))
