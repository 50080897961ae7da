"""``model.rope_scaling`` from TOML and the command line into the model's args, the model
record that goes into every commit manifest, and the HF adapter built from the real args.
Checked against the real Llama 3 spec (titan-models) and a spec of a model without RoPE, to
show the seam stays model-agnostic."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from titan_models import ModelSpec
from titan_models.llama3 import LLAMA3, RopeScaling
from titan_train.config import parse_job_config
from titan_train.config.loader import ConfigError
from titan_train.config.model_args import (
    build_model_args,
    check_resumed_model,
    model_metadata,
    state_dict_adapter,
)


def test_rope_scaling_from_toml_and_cli(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nrope_scaling = "none"\n')
    assert parse_job_config([]).model.rope_scaling == "flavor"
    assert parse_job_config(["--job.config_file", str(toml)]).model.rope_scaling == "none"
    config = parse_job_config(["--job.config_file", str(toml), "--model.rope_scaling", "llama3"])
    assert config.model.rope_scaling == "llama3"
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\nrope_scaling = "yarn"\n')
    with pytest.raises(ConfigError, match=r"model\.rope_scaling.*'flavor'.*'none'.*'llama3'"):
        parse_job_config(["--job.config_file", str(bad)])
    with pytest.raises(SystemExit) as exit_:
        parse_job_config(["--model.rope_scaling", "yarn"])
    assert exit_.value.code == 2
    assert "'flavor', 'none', 'llama3'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flavor", "choice", "expected"),
    [
        ("debugmodel", "flavor", RopeScaling()),
        ("debugmodel", "none", None),
        ("1B", "llama3", RopeScaling(factor=32.0)),
    ],
)
def test_rope_scaling_reaches_the_args(flavor, choice, expected):
    section = parse_job_config(["--model.flavor", flavor, "--model.rope_scaling", choice]).model
    args = build_model_args(LLAMA3, section, vocab_size=2000, max_seq_len=64)
    assert (args.rope_scaling, args.vocab_size, args.max_seq_len) == (expected, 2000, 64)


def test_record_and_adapter_carry_the_real_args():
    section = parse_job_config(["--model.rope_scaling", "none"]).model
    args = build_model_args(LLAMA3, section, vocab_size=2000, max_seq_len=64)
    record = model_metadata(LLAMA3, "debugmodel", args)["model"]
    assert json.loads(json.dumps(record)) == record
    assert (record["name"], record["flavor"]) == ("llama3", "debugmodel")
    assert (record["args"]["vocab_size"], record["args"]["rope_scaling"]) == (2000, None)
    config = state_dict_adapter(LLAMA3, "debugmodel", args).hf_config()
    assert (config["vocab_size"], config["max_position_embeddings"]) == (2000, 64)
    assert config["rope_scaling"] is None


@dataclass
class BagArgs:
    vocab_size: int = 10
    max_seq_len: int = 8


def _bag_args(flavor: str, **overrides: object) -> BagArgs:
    return BagArgs(**overrides)  # a model without RoPE: rope_scaling would be a TypeError


class _BagAdapter:
    def __init__(self, flavor: str) -> None:
        self.flavor = flavor

    def to_hf(self, state_dict):
        return dict(state_dict)

    def from_hf(self, hf_state_dict):
        return dict(hf_state_dict)

    def hf_config(self):
        return {"flavor": self.flavor}


BAG = ModelSpec(
    name="bag",
    flavors={"tiny": BagArgs()},
    model_cls=lambda args: None,  # never built here
    parallelize_fn=lambda model, *a, **k: model,
    state_dict_adapter=lambda *, flavor=None, hf_config=None: _BagAdapter(flavor),
    args_fn=_bag_args,
)


def test_another_model_gets_only_what_it_asked_for():
    # The default "flavor" passes no rope_scaling; an adapter factory without model_args
    # gets the flavor.
    section = parse_job_config(["--model.name", "bag", "--model.flavor", "tiny"]).model
    args = build_model_args(BAG, section, vocab_size=5, max_seq_len=4)
    assert args == BagArgs(vocab_size=5, max_seq_len=4)
    assert model_metadata(BAG, "tiny", args)["model"]["args"] == {"vocab_size": 5, "max_seq_len": 4}
    assert state_dict_adapter(BAG, "tiny", args).hf_config() == {"flavor": "tiny"}


def test_resuming_with_other_model_args_is_said_in_one_warning(caplog):
    def record(*flags: str, seq: int = 64) -> dict:
        section = parse_job_config(list(flags)).model
        return model_metadata(LLAMA3, "debugmodel", build_model_args(
            LLAMA3, section, vocab_size=2000, max_seq_len=seq))  # fmt: skip

    trained = record("--model.rope_scaling", "none")
    assert check_resumed_model(trained, record("--model.rope_scaling", "none", seq=128)) == []
    assert check_resumed_model(None, trained) == []  # nothing loaded, or no record
    assert check_resumed_model({}, trained) == []
    other_flavor = {"model": {**trained["model"], "flavor": None}}  # e.g. converted from HF
    assert check_resumed_model(other_flavor, record()) == []
    with caplog.at_level("WARNING", logger="titan_train"):
        changed = check_resumed_model(trained, record())
    assert changed == [
        'rope_scaling: null -> {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": '
        '4.0, "original_max_position_embeddings": 8192}'
    ]
    assert len(caplog.records) == 1
    assert "--model.rope_scaling" in caplog.records[0].getMessage()


def test_expert_balancing_from_the_command_line():
    """``model.load_balance_coeff`` (0 turns the bias off) and ``model.aux_loss_alpha`` reach
    an MoE model's args; unset, the flavor's stand; a dense model refuses them."""
    from titan_models.qwen3 import QWEN3

    def args(*argv: str, spec: ModelSpec = QWEN3, flavor: str = "debugmodel_moe"):
        config = parse_job_config(["--model.flavor", flavor, *argv])
        return build_model_args(spec, config.model, vocab_size=None, max_seq_len=64)

    assert (args().load_balance_coeff, args().aux_loss_alpha) == (1e-3, 0.0)
    assert args("--model.load_balance_coeff", "0").load_balance_coeff is None
    tuned = args("--model.load_balance_coeff", "0.01", "--model.aux_loss_alpha", "0.001")
    assert (tuned.load_balance_coeff, tuned.aux_loss_alpha) == (0.01, 0.001)
    with pytest.raises(ConfigError, match=r"model.load_balance_coeff=-1.0 is not allowed"):
        args("--model.load_balance_coeff", "-1")
    with pytest.raises(ConfigError, match="qwen3 debugmodel has no mixture-of-experts blocks"):
        args("--model.aux_loss_alpha", "0.1", flavor="debugmodel")
    with pytest.raises(ConfigError, match="llama3 debugmodel has no mixture-of-experts"):
        args("--model.load_balance_coeff", "0", spec=LLAMA3, flavor="debugmodel")


def test_hf_export_states_the_ropes_context_not_the_runs_seq_len(tmp_path):
    """A run at seq_len 32 with the flavor's Llama 3.1 scaling, exported with ``titan-ckpt
    convert --to hf``: config.json's max_position_embeddings is the context the scaling
    serves (Llama 3.1's 131072, above its original 8192, so transformers does not warn).
    Plain RoPE keeps the run's (``test_record_and_adapter_carry_the_real_args``)."""
    from titan_ckpt.commands.cli import main as titan_ckpt
    from titan_train.cli import main

    out = tmp_path / "run"
    run = ["train", "--job.dump_folder", str(out), "--training.steps", "1",
           "--training.seq_len", "32", "--training.local_batch_size", "1",
           "--training.data_shards", "1", "--checkpoint.enable", "--checkpoint.interval", "1",
           "--metrics.no_enable_tensorboard"]  # fmt: skip
    assert main(run) == 0
    hf = tmp_path / "hf"
    assert titan_ckpt(["convert", str(out / "checkpoint" / "step-1"), str(hf), "--to", "hf"]) == 0
    config = json.loads((hf / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072
    assert config["rope_scaling"]["original_max_position_embeddings"] == 8192
