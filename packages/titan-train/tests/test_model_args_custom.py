"""A model size of one's own: ``[model.args]`` in TOML and ``--model.args.KEY VALUE`` on the
command line (``titan_train.config.model_args``), checked against the real Llama 3, Qwen3 and
DeepSeek-V3 specs of titan-models: the models they build on the meta device have the asked
shapes, and every key or value the family's args refuse stops a run in preflight, with one
line, before anything is written."""

from __future__ import annotations

import pytest
import torch

from titan_train.cli import main
from titan_train.config import parse_job_config, split_model_args
from titan_train.config.model_args import build_model_args
from titan_train.config.registry import load_model_spec
from titan_train.errors import ConfigError


def _shapes(config, vocab_size=None):
    spec = load_model_spec(config.model.name)
    args = build_model_args(
        spec, config.model, vocab_size=vocab_size, max_seq_len=config.training.seq_len
    )
    with torch.device("meta"):
        model = spec.model_cls(args)
    return args, {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_toml_table_sets_the_llama3_shapes(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[model.args]\ndim = 128\nn_layers = 3\nn_heads = 8\nn_kv_heads = 2\n")
    config = parse_job_config(["--job.config_file", str(toml)])
    assert config.model.args == {"dim": 128, "n_layers": 3, "n_heads": 8, "n_kv_heads": 2}
    args, shapes = _shapes(config, vocab_size=2048)
    assert (args.dim, args.n_layers, args.vocab_size) == (128, 3, 2048)
    assert shapes["tok_embeddings.weight"] == (2048, 128)
    assert sum(k.endswith("attention.wq.weight") for k in shapes) == 3
    assert shapes["layers.0.attention.wk.weight"] == (2 * 16, 128)  # 2 kv heads of 16 channels
    # the command line wins over the file, key by key
    config = parse_job_config(
        ["--job.config_file", str(toml), "--model.args.n_layers", "2", "--model.args.dim=64"]
    )
    assert config.model.args == {"dim": 64, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2}
    _, shapes = _shapes(config)
    assert shapes["tok_embeddings.weight"][1] == 64
    assert sum(k.endswith("attention.wq.weight") for k in shapes) == 2


def test_vocab_size_replaces_the_tokenizers_count():
    config = parse_job_config(["--model.args.vocab_size", "4096"])
    args, shapes = _shapes(config, vocab_size=2048)
    assert args.vocab_size == 4096
    assert shapes["output.weight"] == (4096, 256)
    with pytest.raises(ConfigError, match="smaller than the tokenizer's 2048 tokens"):
        _shapes(parse_job_config(["--model.args.vocab_size", "1000"]), vocab_size=2048)


@pytest.mark.parametrize(
    ("name", "flavor", "given", "expected"),
    [
        (
            "qwen3",
            "debugmodel_moe",
            [
                "--model.args.num_experts",
                "4",
                "--model.args.top_k",
                "1",
                "--model.args.n_layers",
                "2",
            ],
            {"layers.0.moe.router.gate.weight": (4, 256)},
        ),
        (
            "deepseek_v3",
            "debugmodel",
            [
                "--model.args.n_layers",
                "2",
                "--model.args.dim",
                "128",
                "--model.args.vocab_size",
                "512",
            ],
            {"tok_embeddings.weight": (512, 128)},
        ),
    ],
)
def test_every_family_takes_its_own_args(name, flavor, given, expected):
    config = parse_job_config(["--model.name", name, "--model.flavor", flavor, *given])
    _, shapes = _shapes(config)
    for key, shape in expected.items():
        assert shapes[key] == shape
    assert not any(k.startswith("layers.2.") for k in shapes)


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        (
            ["--model.args.dimm", "12"],
            "model.args.dimm is not an argument of llama3 (Llama3Args); allowed: depth_init, dim,",
        ),
        (["--model.args.rope_scaling", "none"], "RoPE scaling is model.rope_scaling"),
        (["--model.args.dim", "250"], "dim=250 must be divisible by n_heads=16"),
        (["--model.args.n_layers", "two"], "model.args.n_layers must be a whole number"),
        (["--model.args.max_seq_len", "64"], "shorter than the longest sequence"),
    ],
)
def test_refused_before_anything_is_written(given, fragment, tmp_path, capsys):
    dump = tmp_path / "out"
    assert main([*given, "--training.steps", "1", "--job.dump_folder", str(dump)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert fragment in err
    assert not dump.exists()


def test_command_line_values_are_read_as_toml():
    rest, found = split_model_args(
        ["--model.args.n_kv_heads", "none", "--model.args.norm-eps", "1e-6", "--x.y", "1"]
    )
    assert rest == ["--x.y", "1"]
    assert found == {"n_kv_heads": None, "norm_eps": 1e-6}
    assert split_model_args(["--model.args.mlp_only_layers=[0, 1]"])[1] == {
        "mlp_only_layers": [0, 1]
    }
    with pytest.raises(ConfigError, match="needs a value"):
        split_model_args(["--model.args.dim"])


def test_not_a_table_is_refused(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nargs = 5\n")
    with pytest.raises(ConfigError, match=r"give a table of the model's arguments"):
        parse_job_config(["--job.config_file", str(toml)])


def test_config_print_shows_the_table(capsys):
    assert main(["config", "--model.args.n_layers", "2"]) == 0
    assert "[model.args]\nn_layers = 2\n" in capsys.readouterr().out
    assert main(["config"]) == 0
    assert "[model.args]" not in capsys.readouterr().out  # none given: no table
