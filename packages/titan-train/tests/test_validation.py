"""Validator in one process: its loss equals the loss computed by hand on the same batches,
every evaluation starts the data over, ``steps=-1`` reads the whole finite set, and settings
that cannot work are refused with the key named. Layouts (FSDP, TP, PP) are compared in
integration_tests/test_train_runs.py."""

from __future__ import annotations

import json

import pytest
import torch

from titan_dims import ParallelDims
from titan_models.llama3 import Llama3
from titan_train.config import ConfigError
from titan_train.config.registry import load_model_spec
from titan_train.data import DataConfig, build_dataloader
from titan_train.tokenizer import load_tokenizer
from titan_train.trainer.step import cross_entropy_loss
from titan_train.trainer.validation import ValidationConfig, Validator

SEQ = 16


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    args = load_model_spec("llama3").args_fn("debugmodel", vocab_size=tokenizer.vocab_size)
    args.n_layers, args.dim, args.n_heads, args.n_kv_heads = 1, 32, 2, 2
    torch.manual_seed(0)
    model = Llama3(args)
    model.init_weights()
    return model


@pytest.fixture
def corpus(tmp_path):
    """10 documents, ~700 tokens in all: a finite set of a few batches."""
    path = tmp_path / "val.jsonl"
    lines = [
        json.dumps({"text": f"Document {i} says hello to the validator. " * 5}) for i in range(10)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _validator(config, tokenizer, **kwargs):
    return Validator(
        config,
        tokenizer,
        dims=ParallelDims(world_size=1, device_type="cpu"),
        device=torch.device("cpu"),
        **kwargs,
    )


def _by_hand(tokenizer, model, dataset, batches):
    loader = build_dataloader(
        DataConfig(dataset=dataset, seq_len=SEQ, local_batch_size=2, infinite=False), tokenizer
    )
    losses = []
    with torch.no_grad():
        for i, (inputs, labels) in enumerate(loader):
            if i == batches:
                break
            losses.append(cross_entropy_loss(model(inputs), labels).item())
    return losses


def test_loss_is_the_mean_over_the_first_steps_and_repeats(tokenizer, model, corpus):
    config = ValidationConfig(enable=True, dataset=corpus, steps=3, seq_len=SEQ, local_batch_size=2)
    validator = _validator(config, tokenizer)
    expected = sum(_by_hand(tokenizer, model, corpus, 3)) / 3
    assert validator.validate([model]) == pytest.approx(expected, rel=1e-6)
    # The data starts over at every evaluation; the model is back in training mode.
    assert validator.validate([model]) == pytest.approx(expected, rel=1e-6)
    assert model.training


def test_a_failed_evaluation_leaves_each_part_in_the_mode_it_had(tokenizer, model, corpus):
    config = ValidationConfig(enable=True, dataset=corpus, steps=1, seq_len=SEQ, local_batch_size=2)
    validator = _validator(config, tokenizer)

    def fail(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    frozen = torch.nn.Linear(2, 2).eval()  # a part the caller keeps in eval mode
    handle = model.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError, match="evaluation failed"):
            validator.validate([model, frozen])
    finally:
        handle.remove()
    assert model.training
    assert not frozen.training


def test_minus_one_steps_reads_the_whole_finite_set(tokenizer, model, corpus):
    config = ValidationConfig(
        enable=True, dataset=corpus, steps=-1, seq_len=SEQ, local_batch_size=2
    )
    every = _by_hand(tokenizer, model, corpus, 10**6)
    assert len(every) > 3
    assert _validator(config, tokenizer).validate([model]) == pytest.approx(
        sum(every) / len(every), rel=1e-6
    )


def test_should_validate_every_freq_steps_and_at_the_end(tokenizer):
    validator = _validator(ValidationConfig(enable=True, freq=4, seq_len=SEQ), tokenizer)
    assert [s for s in range(1, 11) if validator.should_validate(s, 10)] == [4, 8, 10]
    off = _validator(ValidationConfig(enable=False, seq_len=SEQ), tokenizer)
    assert not any(off.should_validate(s, 10) for s in range(1, 11))


def test_a_set_smaller_than_one_step_is_refused_when_built(tokenizer, corpus):
    config = ValidationConfig(enable=True, dataset=corpus, seq_len=SEQ, local_batch_size=1000)
    with pytest.raises(ConfigError, match="fewer tokens than one validation step"):
        _validator(config, tokenizer)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"freq": 0}, "validation.freq=0"),
        ({"steps": 0}, "validation.steps=0"),
        ({"steps": -2}, "validation.steps=-2"),
        ({"local_batch_size": -1}, "validation.local_batch_size=-1"),
        ({"seq_len": 0}, "validation.seq_len=0"),
    ],
)
def test_bad_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ValidationConfig(**kwargs)
