"""torchtitan 2026's configurations (``--module M --config F``) in titan-train
(``titan_train.compat.head``), checked against the settings they load to, a titan
preflight of each, a real run of ``llama3_debugmodel`` in a torchtitan-shaped checkout
(``tt_checkout``), the TOML ``config import`` writes, and, where ``TORCHTITAN_REPO`` names a
torchtitan checkout, torchtitan's own registry source (read with ``ast``, never imported).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_train.cli import main
from titan_train.compat import flatten
from titan_train.compat.head import CONFIGS, HEAD_COMMIT, preset_values
from titan_train.config import parse_job_config
from titan_train.config.model_args import build_model_args
from titan_train.config.registry import load_model_spec
from titan_train.errors import ConfigError
from titan_train.preflight import World, preflight

_spec = importlib.util.spec_from_file_location(
    "tt_checkout", Path(__file__).with_name("tt_checkout.py")
)
assert _spec is not None
assert _spec.loader is not None
tt_checkout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt_checkout)

RUNS = [(m, f) for m, fs in CONFIGS.items() for f, e in fs.items() if not e.refused]
REFUSED = [(m, f) for m, fs in CONFIGS.items() for f, e in fs.items() if e.refused]


def _preset(module: str, name: str, *more: str):
    return parse_job_config(["--module", module, "--config", name, *more])


def _world_size(config) -> int:
    """The smallest world the layout fits: the fixed degrees, EP borrowed from dp_shard."""
    p = config.parallelism
    fixed = p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree
    shard = max(1, p.data_parallel_shard_degree)
    while (shard * p.context_parallel_degree) % p.expert_parallel_degree:
        shard += 1
    return fixed * shard * p.data_parallel_replicate_degree


@pytest.mark.parametrize(("module", "name"), RUNS)
def test_each_entry_loads_and_preflights(module, name):
    config = _preset(module, name, "--training.no_memory_check")  # the layout, not this host
    entry = CONFIGS[module][name]
    while entry.base:
        entry = CONFIGS[module][entry.base]
    assert (config.model.name, config.model.flavor) == (entry.model, entry.flavor)
    assert config.model.args == dict(entry.model_args)
    assert config.metrics.tensorboard_names == "torchtitan"
    # torchtitan's token counts as whole sequences of its context length
    flat, _ = preset_values(module, name)
    tokens = flat["training.num_tokens_per_microbatch_per_dp_rank"]
    assert config.training.seq_len == flat["training.max_context_length"]
    assert config.training.local_batch_size * config.training.seq_len == tokens
    assert config.optimizer.lr == flat["optimizer.param_groups.0.optimizer_kwargs.lr"]
    plan = preflight(
        config, World(rank=0, world_size=_world_size(config), device=torch.device("cpu"))
    )
    assert plan.spec.name == entry.model


def test_what_the_debug_entries_set():
    config = _preset("llama3", "llama3_debugmodel")
    assert (config.training.steps, config.training.dataset, config.optimizer.lr) == (
        10,
        "c4_test",
        8e-4,
    )
    assert (config.lr_scheduler.warmup_steps, config.lr_scheduler.decay_ratio) == (2, 0.8)
    assert config.parallelize.activation_checkpoint.mode == "selective"
    assert config.parallelize.activation_checkpoint.selective_option == "op"  # per-op SAC
    assert config.pipeline.schedule == "Interleaved1F1B"
    assert (config.checkpoint.enable, config.checkpoint.interval) == (False, 10)
    assert (config.validation.freq, config.validation.steps, config.validation.seq_len) == (
        5,
        10,
        2048,
    )
    assert config.model.tokenizer_path == "./tests/assets/tokenizer"
    # torchtitan's attention stays inside each document, its positions restarting
    assert (config.training.document_masking, config.training.document_positions) == (
        True,
        "restart",
    )
    big = _preset("llama3", "llama3_70b")
    assert big.parallelism.tensor_parallel_degree == 8
    assert big.parallelize.activation_checkpoint.mode == "full"
    assert (big.training.local_batch_size, big.training.seq_len) == (8, 8192)
    dsv3 = _preset("deepseek_v3", "deepseek_v3_16b")
    assert (dsv3.lr_scheduler.decay_type, dsv3.lr_scheduler.min_lr_factor) == ("cosine", 0.1)
    assert dsv3.parallelism.expert_parallel_degree == 8
    assert dsv3.parallelize.compile is True
    # a derived function: its base's settings, then its own
    ep = _preset("deepseek_v3", "deepseek_v3_debugmodel_minimal_async_ep")
    assert ep.parallelism.data_parallel_shard_degree == 1
    assert ep.training.steps == 10


@pytest.mark.parametrize(("module", "name"), REFUSED)
def test_refused_entries_say_why_in_one_line(module, name, capsys):
    assert main(["--module", module, "--config", name]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"{module}.{name} cannot be trained by titan" in err
    suggested = err.rsplit("train ", 1)[1].split()[0]
    assert suggested in CONFIGS[module]
    assert not CONFIGS[module][suggested].refused


def test_unknown_module_or_function_lists_the_known_ones(capsys):
    assert main(["--module", "flux", "--config", "flux_debugmodel"]) == 2
    assert "llama3, deepseek_v3, qwen3" in capsys.readouterr().err
    assert main(["--module", "torchtitan.models.llama3", "--config", "llama3_tiny"]) == 2
    err = capsys.readouterr().err
    assert "llama3_debugmodel" in err
    assert "llama3_70b" in err
    assert main(["--module", "llama3"]) == 2
    assert "--config is missing" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="keep one"):
        _preset("llama3", "llama3_debugmodel", "--job.config_file", "x.toml")


def test_flags_override_the_configuration():
    config = _preset(
        "llama3",
        "llama3_debugmodel",
        "--training.steps",
        "3",
        "--training.max_context_length",  # torchtitan's name: tokens per microbatch stay
        "1024",
        "--optimizer.param_groups.0.optimizer_kwargs.lr",
        "1e-3",
        "--validator.freq",
        "3",
        "--profiler.profile_freq",
        "7",
        "--hf_assets_path",
        "/tok",
        "--model.args.n_layers",
        "2",
    )
    assert (config.training.steps, config.training.seq_len) == (3, 1024)
    assert config.training.local_batch_size == 16384 // 1024
    assert (config.validation.seq_len, config.validation.local_batch_size) == (1024, 16)
    assert (config.optimizer.lr, config.validation.freq, config.profiling.profile_freq) == (
        1e-3,
        3,
        7,
    )
    assert config.model.tokenizer_path == "/tok"
    assert config.model.args == {"vocab_size": 2048, "n_layers": 2}
    # titan's own key wins over the configuration's token count
    titan = _preset("llama3", "llama3_debugmodel", "--training.local_batch_size", "2")
    assert (titan.training.local_batch_size, titan.training.seq_len) == (2, 2048)


def test_pipeline_microbatches_as_torchtitan_counts_them():
    config = _preset(
        "llama3",
        "llama3_debugmodel",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.num_pp_microbatches",
        "4",
    )
    # 16,384 tokens per microbatch = 8 sequences of 2,048; 4 microbatches per local batch
    assert (config.training.local_batch_size, config.pipeline.microbatch_size) == (32, 8)
    plain = _preset("llama3", "llama3_debugmodel", "--parallelism.num_pp_microbatches", "4")
    assert plain.training.local_batch_size == 8  # without pipelining torchtitan ignores it


def test_token_counts_in_a_titan_run():
    config = parse_job_config(
        [
            "--training.num_tokens_per_microbatch_per_dp_rank",
            "4096",
            "--training.num-tokens-per-train-step",
            "16384",
        ]
    )
    assert config.training.seq_len == 512  # titan's default: the run's own length
    assert (config.training.local_batch_size, config.training.global_batch_size) == (8, 32)
    assert config.validation.local_batch_size == 8  # titan's validation keeps its own


@pytest.mark.parametrize(
    ("flag", "fragment"),
    [
        (["--debug.batch_invariant"], "no batch-invariant kernels"),
        (["--debug.detect_anomaly", "true"], "no autograd anomaly mode"),
        (["--override.imports", "my.module.fn"], "swaps no components"),
        (["--optimizer.param_groups.1.optimizer_kwargs.lr", "0.1"], "param_group_rules"),
        (["--training.num_tokens_per_microbatch_per_dp_rank", "1000"], "multiple of 2048"),
        (["--parallelism.num_pp_microbatches", "0"], ">= 1"),
    ],
)
def test_refused_flags_are_one_line(flag, fragment, capsys):
    assert main(["config", "--module", "llama3", "--config", "llama3_debugmodel", *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert fragment in err


def test_ignored_flags_are_named_once(caplog):
    with caplog.at_level("INFO", logger="titan_train"):
        config = _preset(
            "llama3",
            "llama3_debugmodel",
            "--debug.print_config",
            "--loss.num_chunks",
            "4",
            "--training.disable_cuda_graphs",
            "--parallelism.spmd_backend",
            "dtensor",
        )
    assert config.training.steps == 10
    ignored = [r.getMessage() for r in caplog.records if "no effect in titan" in r.getMessage()]
    assert len(ignored) == 1
    for key in (
        "debug.print_config",
        "loss.num_chunks",
        "training.disable_cuda_graphs",
        "parallelism.spmd_backend",
    ):
        assert key in ignored[0]
    carried = [r.getMessage() for r in caplog.records if "not carried" in r.getMessage()]
    assert len(carried) == 1
    assert carried[0].endswith("not carried: nothing")  # the debug function reads in order
    with caplog.at_level("INFO", logger="titan_train"):
        _preset("qwen3", "qwen3_0_6b")
    assert any("titan reads documents in order" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("module", "name"), RUNS)
def test_import_writes_a_toml_that_loads_to_the_same_config(module, name, tmp_path, capsys):
    out = tmp_path / f"{name}.toml"
    assert (
        main(["config", "import", "--torchtitan-module", module, "--config", name, "-o", str(out)])
        == 0
    )
    assert "Not carried" in out.read_text()
    assert "Not carried" in capsys.readouterr().err
    imported = parse_job_config(["--job.config_file", str(out)]).to_dict()
    imported["job"].pop("config_file")
    assert imported == _preset(module, name).to_dict()


def test_import_keeps_an_existing_file_unless_forced(tmp_path, capsys):
    out = tmp_path / "run.toml"
    out.write_text("# mine\n")
    argv = [
        "config",
        "import",
        "--torchtitan-module",
        "qwen3",
        "--config",
        "qwen3_debugmodel",
        "--output",
        str(out),
    ]
    assert main(argv) == 2
    assert "--force" in capsys.readouterr().err
    assert out.read_text() == "# mine\n"
    assert main([*argv, "--force", "--training.steps", "4"]) == 0
    assert parse_job_config(["--job.config_file", str(out)]).training.steps == 4
    assert (
        main(["config", "import", "--torchtitan-module", "qwen3", "--config", "qwen3_moe_deepep"])
        == 2
    )
    assert "DeepEP" in capsys.readouterr().err


@pytest.mark.slow  # the debug model at 8 x 2048 tokens: ~40 s for 1 step on 2 cores
def test_llama3_debugmodel_trains(tmp_path):
    tt_checkout.write_tokenizer(tmp_path / "tests" / "assets" / "tokenizer")
    tt_checkout.write_c4_test(tmp_path / "tests" / "assets" / "c4_test")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", "1"]
    done = subprocess.run(
        [sys.executable, "-m", "titan_train.cli", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "outputs/metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert "8 x 2048 tokens per step" in done.stderr
    assert "torchtitan's c4_test" in done.stderr


# ---------------------------------------------------------------- torchtitan's own source

REPO = os.environ.get("TORCHTITAN_REPO")
needs_repo = pytest.mark.skipif(
    not REPO, reason="TORCHTITAN_REPO (a torchtitan checkout of about HEAD_COMMIT) is unset"
)


def _number(node: ast.AST, names: dict[str, object]) -> object:
    """A constant, a local name bound to one, or a product of them (``8 * 2048``)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        a, b = _number(node.left, names), _number(node.right, names)
        if isinstance(a, int | float) and isinstance(b, int | float):
            return a * b
    return None


def _keywords(function: ast.FunctionDef) -> dict[str, object]:
    """Every ``name=value`` keyword and ``name = value`` assignment with a constant value."""
    names: dict[str, object] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                value = _number(node.value, names)
                if value is not None:
                    names[target.id] = value
    found = dict(names)
    for call in (n for n in ast.walk(function) if isinstance(n, ast.Call)):
        rope = "RoPE" in ast.unparse(call.func)  # its dim is the rotated head channels
        for keyword in call.keywords:
            value = _number(keyword.value, names)
            if keyword.arg and value is not None and not (rope and keyword.arg == "dim"):
                found[keyword.arg] = value
    return found


def _functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


@needs_repo
@pytest.mark.parametrize("module", CONFIGS)
def test_the_table_names_every_registered_function(module):
    registry = _functions(Path(REPO, "torchtitan", "models", module, "config_registry.py"))
    configs = {
        name
        for name, f in registry.items()
        if not name.startswith("_")
        and ast.unparse(f.returns or ast.Constant(None)) == "Trainer.Config"
    }
    assert configs == set(CONFIGS[module]), HEAD_COMMIT


# torchtitan's keyword (in a registry function) -> the key of the table it sets
_SETS = {
    "lr": "optimizer.param_groups.0.optimizer_kwargs.lr",
    "warmup_steps": "lr_scheduler.warmup_steps",
    "decay_ratio": "lr_scheduler.decay_ratio",
    "decay_type": "lr_scheduler.decay_type",
    "min_lr_factor": "lr_scheduler.min_lr_factor",
    "num_tokens_per_microbatch_per_dp_rank": "training.num_tokens_per_microbatch_per_dp_rank",
    "max_context_length": "training.max_context_length",
    "steps": None,  # training.steps, or validator.steps: both checked below
    "interval": "checkpoint.interval",
    "log_freq": "metrics.log_freq",
    "tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "expert_parallel_degree": "parallelism.expert_parallel_degree",
    "pipeline_parallel_schedule": "parallelism.pipeline_parallel_schedule",
    "hf_assets_path": "hf_assets_path",
    "export_dtype": "checkpoint.export_dtype",
}


@needs_repo
@pytest.mark.parametrize(("module", "name"), [(m, f) for m, f in RUNS if not CONFIGS[m][f].base])
def test_the_table_has_each_functions_values(module, name):
    function = _functions(Path(REPO, "torchtitan", "models", module, "config_registry.py"))[name]
    found = _keywords(function)
    flat, _ = preset_values(module, name)
    for keyword, key in _SETS.items():
        if keyword not in found:
            continue
        if key is None:
            assert found[keyword] in (flat["training.steps"], flat["validator.steps"])
        else:
            assert flat[key] == found[keyword], (keyword, key)
    registry_call = next(
        n
        for n in ast.walk(function)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "model_registry"
    )
    assert ast.literal_eval(registry_call.args[0]) == CONFIGS[module][name].flavor


# torchtitan's model-builder names -> titan's args field, per family (others: same name)
_ARG_NAMES = {
    "deepseek_v3": {
        "dense_hidden_dim": "inter_dim",
        "moe_hidden_dim": "moe_inter_dim",
        "num_experts": "n_routed_experts",
        "num_shared_experts": "n_shared_experts",
        "router_top_k": "n_activated_experts",
        "router_score_func": "score_func",
        "router_route_norm": "route_norm",
        "router_route_scale": "route_scale",
        "rope_dim": "qk_rope_head_dim",
        "theta": "rope_theta",
        "max_context_length": "max_seq_len",
    },
    "qwen3": {"moe_hidden_dim": "moe_inter_dim", "theta": "rope_theta"},
    "llama3": {"theta": "rope_theta"},
}


@needs_repo
@pytest.mark.parametrize(("module", "name"), [(m, f) for m, f in RUNS if not CONFIGS[m][f].base])
def test_titan_builds_torchtitans_model(module, name):
    """titan's flavor with the entry's ``model_args`` has every shape torchtitan's model
    builder writes down (dims, layers, heads, experts, vocabulary, RoPE base)."""
    entry = CONFIGS[module][name]
    builders = _functions(Path(REPO, "torchtitan", "models", module, "__init__.py"))
    builder = "_" + entry.flavor.lower().replace(".", "_").replace("-", "_")
    found = _keywords(builders[builder])
    config = _preset(module, name)
    args = build_model_args(
        load_model_spec(module), config.model, vocab_size=None, max_seq_len=config.training.seq_len
    )
    fields = {f.name for f in dataclasses.fields(args)}
    names = _ARG_NAMES[module]
    compared = {}
    for keyword, value in found.items():
        field = names.get(keyword, keyword)
        # max_seq_len is the RoPE table: a shape only where it changes the numbers (YaRN)
        if field in fields and (field != "max_seq_len" or module == "deepseek_v3"):
            compared[field] = value
            assert getattr(args, field) == value, (builder, keyword, field)
    assert {"dim", "n_layers", "vocab_size"} <= set(compared)


def test_the_table_records_its_commit():
    assert len(HEAD_COMMIT) == 40
    assert all(e.refused or e.base or e.model for fs in CONFIGS.values() for e in fs.values())
    assert "training.num_tokens_per_microbatch_per_dp_rank" in flatten(
        {"training": {"num_tokens_per_microbatch_per_dp_rank": 1}}
    )
