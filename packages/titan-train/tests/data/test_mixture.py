"""Weighted dataset mixtures: the tokens taken from each source match the weights within 1%
over 1M tokens (counted from the loader's batches, no model); a stop and resume at random
steps, through ``state_dict`` and at another data-parallel degree, gives the batches of one
uninterrupted run; each source's windows are that source's own packed stream; bad
``[[training.datasets]]`` entries are refused at config load with one line. Checked against
real local JSON-lines files, the embedded corpus and titan's shipped tokenizer."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from titan_train.config import ConfigError, TrainingConfig, parse_job_config
from titan_train.data import (
    DataConfig,
    DatasetEntry,
    MixtureDataLoader,
    build_dataloader,
    build_mixture_dataloader,
)
from titan_train.data.mixture import source_choices
from titan_train.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two JSON-lines corpora whose documents name their source and index."""
    folder = tmp_path_factory.mktemp("corpora")
    paths = {}
    for name, words in (("red", "red apple"), ("blue", "blue sky over the sea")):
        path = folder / f"{name}.jsonl"
        rows = (json.dumps({"text": f"{words} {i} " * (1 + i % 7)}) for i in range(300))
        path.write_text("\n".join(rows) + "\n")
        paths[name] = str(path)
    return paths


def _entries(files, weights=(0.6, 0.3, 0.1)):
    return [
        DatasetEntry(dataset="embedded", weight=weights[0]),
        DatasetEntry(dataset=files["red"], weight=weights[1]),
        DatasetEntry(dataset=files["blue"], weight=weights[2], name="blue"),
    ]


def _loader(files, *, rank=0, dp=1, seed=3, shards=4, batch=2, seq_len=32, weights=None):
    data = DataConfig(seq_len=seq_len, local_batch_size=batch, num_shards=shards)
    entries = _entries(files, *(() if weights is None else (weights,)))
    return build_mixture_dataloader(
        entries, TOKENIZER, seed=seed, data=data, dp_rank=rank, dp_degree=dp
    )


def test_tokens_per_source_match_the_weights_over_a_million_tokens(files):
    loader = _loader(files, batch=64, seq_len=256, weights=(0.55, 0.3, 0.15))
    batches = itertools.islice(loader, 62)  # 62 x 64 x 256 = 1,015,808 tokens
    total = sum(labels.numel() for _, labels in batches)
    assert total >= 1_000_000
    tokens = loader.tokens_by_source()
    assert sum(tokens.values()) == total
    shares = {name: n / total for name, n in tokens.items()}
    for (name, share), weight in zip(shares.items(), (0.55, 0.3, 0.15), strict=True):
        assert abs(share - weight) < 0.01 * weight, (name, shares)  # within 1% of the weight
    assert list(tokens) == ["embedded", "red.jsonl", "blue"]


def test_each_source_gives_its_own_packed_stream(files):
    """The windows a mixture (one shard) draws from red are, in order, red's windows when
    red is read alone: nothing of another source mixed in, nothing skipped."""
    mix = _loader(files, shards=1, batch=4)
    windows = [row for inputs, _ in itertools.islice(mix, 10) for row in inputs.tolist()]
    choices = source_choices(3, [0.6, 0.3, 0.1], 0, len(windows))
    alone = build_dataloader(
        DataConfig(dataset=files["red"], seq_len=32, local_batch_size=1, num_shards=1), TOKENIZER
    )
    red = [w for w, k in zip(windows, choices, strict=True) if k == 1]
    assert len(red) == 12  # 30% of 40
    assert red == [inputs[0].tolist() for inputs, _ in itertools.islice(alone, len(red))]


def test_zero_weight_source_is_never_read(files, tmp_path):
    entries = [
        DatasetEntry(dataset="embedded", weight=1),
        DatasetEntry(dataset=str(tmp_path / "empty.jsonl"), weight=0),
    ]
    (tmp_path / "empty.jsonl").write_text("")
    data = DataConfig(seq_len=16, local_batch_size=2, num_shards=2)
    loader = build_mixture_dataloader(entries, TOKENIZER, seed=0, data=data)
    next(iter(loader))
    assert loader.tokens_by_source() == {"embedded": 32, "empty.jsonl": 0}


def _steps(per_rank):
    """The global windows of each step: rank r holds rows of windows g = r (mod dp)."""
    dp = len(per_rank)
    out = []
    for batches in zip(*per_rank, strict=True):
        rows = [b.tolist() for b, _ in batches]
        out.append([rows[k % dp][k // dp] for k in range(dp * len(rows[0]))])
    return out


@pytest.mark.parametrize(("before", "after"), [(1, 1), (2, 1), (1, 2), (2, 4)])
def test_resume_at_random_steps_gives_the_uninterrupted_batches(files, before, after):
    rng = random.Random(before * 10 + after)
    reference = _steps([itertools.islice(_loader(files, batch=4), 24)])
    step, got = 0, []
    degree = before
    loaders = [_loader(files, rank=r, dp=degree, batch=4 // degree) for r in range(degree)]
    while step < 24:
        stop = min(24, step + rng.randint(1, 7))
        got += _steps([itertools.islice(loader, stop - step) for loader in loaders])
        merged: dict = {}
        for loader in loaders:  # merged over the ranks, as a checkpoint holds them
            merged = _merge(merged, loader.state_dict())
        degree = after if degree == before else before
        batch = 4 // degree
        loaders = [_loader(files, rank=r, dp=degree, batch=batch) for r in range(degree)]
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(merged)))
        step = stop
    assert got == reference
    assert loaders[0].tokens_by_source() == _counted(files, 24 * 4 * 32)


def _counted(files, tokens):
    loader = _loader(files, batch=4)
    sum(1 for _ in itertools.islice(loader, tokens // (4 * 32)))
    return loader.tokens_by_source()


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_survives_torch_distributed_checkpoint(files, tmp_path):
    import torch.distributed.checkpoint as dcp

    saved = _loader(files)
    first = [b for b, _ in itertools.islice(saved, 3)]
    dcp.save({"dataloader": saved}, checkpoint_id=tmp_path, no_dist=True)
    restored = _loader(files)
    dcp.load({"dataloader": restored}, checkpoint_id=tmp_path, no_dist=True)
    assert restored.state_dict() == saved.state_dict()
    reference = [b for b, _ in itertools.islice(_loader(files), 5)]
    after = [b for b, _ in itertools.islice(restored, 2)]
    assert all(torch.equal(x, y) for x, y in zip(first + after, reference, strict=True))


def test_another_seed_draws_another_order(files):
    one = next(iter(_loader(files, seed=1, batch=16)))[0]
    two = next(iter(_loader(files, seed=2, batch=16)))[0]
    assert not torch.equal(one, two)


def test_a_single_source_state_is_refused_with_a_way_out(files):
    loader = _loader(files)
    with pytest.raises(ConfigError, match=r"not a mixture's.*exclude_from_loading"):
        loader.load_state_dict({"epoch": 0, "document": 0, "token_offset": 0, "windows": 0})
    state = _loader(files).state_dict()
    del state["sources"]["2"]
    with pytest.raises(ConfigError, match=r"holds 2 mixture source\(s\), this run has 3"):
        loader.load_state_dict(state)
    assert isinstance(loader, MixtureDataLoader)


def _toml(tmp_path, text):
    path = tmp_path / "mix.toml"
    path.write_text(text)
    return ["--job.config_file", str(path)]


def test_toml_entries_load_and_the_command_line_changes_one(tmp_path, files):
    args = _toml(
        tmp_path,
        f"""
[[training.datasets]]
dataset = "embedded"
weight = 2

[[training.datasets]]
dataset = {json.dumps(files["red"])}
text_column = "text"
weight = 1
name = "red"
""",
    )
    config = parse_job_config([*args, "--training.datasets.1.weight", "0.5"])
    entries = config.training.datasets
    assert [(e.dataset, e.weight, e.label) for e in entries] == [
        ("embedded", 2.0, "embedded"),
        (files["red"], 0.5, "red"),
    ]


@pytest.mark.parametrize(
    ("toml", "match"),
    [
        ("[[training.datasets]]\ndataset = 'embedded'\nweight = -1",
         r"weight = -1.0; a weight must be a finite number >= 0"),
        ("[[training.datasets]]\ndataset = 'embedded'\nweight = nan",
         r"weight = nan; a weight must be a finite number"),
        ("[[training.datasets]]\ndataset = 'embedded'\nweight = inf",
         r"weight = inf; a weight must be a finite number"),
        ("[[training.datasets]]\ndataset = 'embedded'\nweight = 0",
         r"weights sum to 0.0; they must sum to a positive number"),
        ("[[training.datasets]]\nweight = 1", r"entry has no source: set its dataset ="),
        ("[training]\ndataset = 'c4'\n[[training.datasets]]\ndataset = 'embedded'",
         r"given together with training.dataset: a run reads either one dataset or a mixture"),
        ("[[training.datasets]]\ndataset = 'embedded'\n[[training.datasets]]\ndataset = 'embedded'",
         r"share the name\(s\) \['embedded'\]; give each a distinct name"),
    ],
)  # fmt: skip
def test_bad_entries_are_refused_in_one_line(tmp_path, toml, match):
    with pytest.raises(ConfigError, match=match) as error:
        parse_job_config(_toml(tmp_path, toml))
    assert "\n" not in str(error.value)


def test_text_column_together_with_datasets_is_refused():
    with pytest.raises(ConfigError, match=r"training.text_column"):
        TrainingConfig(text_column="body", datasets=[DatasetEntry(dataset="embedded")])


def _run(dump, config, steps):
    from titan_train.cli import main

    args = ["train", "--job.config_file", str(config), "--job.dump_folder", str(dump)]
    assert main([*args, "--training.steps", str(steps)]) == 0
    return [json.loads(line) for line in (dump / "metrics.jsonl").open()]


def test_a_real_run_resumes_the_mixture_and_logs_tokens_per_source(tmp_path, files):
    """titan-train itself: 4 steps straight, and 2 steps then a resume from the step-2
    checkpoint to 4, train on the same batches (equal losses); each report and the
    TensorBoard event file hold the tokens taken from each source."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tmp_path / "mix.toml"
    config.write_text(f"""
[training]
seq_len = 32
local_batch_size = 2
data_shards = 4
deterministic = true
[metrics]
log_freq = 1
[checkpoint]
enable = true
interval = 2
last_save_model_only = false
[lr_scheduler]
warmup_steps = 1
[[training.datasets]]
dataset = "embedded"
weight = 0.75
[[training.datasets]]
dataset = {json.dumps(files["red"])}
weight = 0.25
name = "red"
""")
    straight = _run(tmp_path / "straight", config, 4)
    _run(tmp_path / "resumed", config, 2)
    resumed = _run(tmp_path / "resumed", config, 4)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    expected = _loader(files, seed=0, batch=2, weights=(0.75, 0.25, 0))
    list(itertools.islice(expected, 4))
    want = expected.tokens_by_source()
    for record in resumed:
        step = record["step"]
        got = {k: record[f"tokens_seen/{k}"] for k in ("embedded", "red")}
        assert sum(got.values()) == step * 2 * 32
    assert got == {"embedded": want["embedded"], "red": want["red.jsonl"]}
    events = EventAccumulator(str(tmp_path / "straight" / "tb"))
    events.Reload()
    red = [(e.step, e.value) for e in events.Scalars("tokens_seen/red")]
    assert red == [(r["step"], r["tokens_seen/red"]) for r in straight]
    assert red[-1][1] > 0


def test_the_readme_example_loads(tmp_path):
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("### Dataset mixtures", 1)[1]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    entries = parse_job_config(_toml(tmp_path, example)).training.datasets
    assert [(e.label, e.weight) for e in entries] == [("c4", 0.7), ("code", 0.2),
                                                      ("embedded", 0.1)]  # fmt: skip
