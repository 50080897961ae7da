"""The step's loss is the global batch's summed token loss over its trained tokens
(``titan_train.trainer.step``), checked through the real ``train_step`` of a built run against the
same model computed by hand: with every token trained the loss and gradients are today's
(the mean over micro-batches of their mean losses); with masked labels, two accumulated
micro-batches give the loss and gradients of one batch holding both, which is the sum over
trained tokens / their count (and not the mean of the micro-batches' means); two gloo ranks
(FSDP) give those of one process holding the whole batch; validation divides the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from titan_dims import ParallelDims, init_distributed
from titan_models import reduce_loss
from titan_train import JobConfig, World, build, close, preflight, train_step
from titan_train.data import IGNORE_INDEX, build_dataloader
from titan_train.tokenizer import load_tokenizer
from titan_train.trainer.step import cross_entropy_loss, cross_entropy_sum
from titan_train.trainer.validation import ValidationConfig, Validator

SEQ, ROWS = 16, 8


def _batch(masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``ROWS`` sequences; masked: row ``r`` trains only on its last ``r`` tokens (row 0 on
    none), so the micro-batches and ranks hold very different numbers of trained tokens."""
    g = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, 2048, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, 2048, (ROWS, SEQ), generator=g)
    if masked:
        for r in range(ROWS):
            labels[r, : SEQ - 2 * r] = IGNORE_INDEX
    return inputs, labels


def _config(tmp_path: Path, local: int, global_: int) -> JobConfig:
    config = JobConfig()
    config.job.dump_folder = str(tmp_path)
    config.model.flavor = "debugmodel"
    config.training.seq_len, config.training.steps = SEQ, 1
    config.training.local_batch_size, config.training.global_batch_size = local, global_
    config.training.max_norm = 0.0  # the gradients as backward left them
    config.training.data_prefetch = 0
    config.parallelize.param_dtype = "float32"
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    return config


def _step(config: JobConfig, batches, weights=None):
    """One ``train_step`` of a freshly built run: (job loss, full gradients by name, the
    model before the step); ``weights`` (a full state dict) replaces the initial weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    run = build(config, preflight(config, World.current(torch.device("cpu"))))
    try:
        model = run.model_parts[0]
        if weights is not None:
            set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
        before = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
                  for k, v in model.state_dict().items()}  # fmt: skip
        result = train_step(run, batches)
        loss = reduce_loss(result.loss, run.plan.parallel_dims).item()
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = grad.clone()
    finally:
        close(run)
    return loss, grads, before


def _in_process(config: JobConfig, batches, weights=None):
    init_distributed()
    try:
        return _step(config, batches, weights)
    finally:
        dist.destroy_process_group()


def _by_hand(config: JobConfig, weights, batches, per_batch_mean: bool):
    """The loss and gradients of ``batches`` on a model holding ``weights``: each batch's
    mean / len(batches) (titan-train before) or the summed token losses / all trained."""
    from titan_train.config.model_args import build_model_args
    from titan_train.config.registry import load_model_spec

    spec = load_model_spec("llama3")
    args = build_model_args(spec, config.model, vocab_size=2048, max_seq_len=SEQ)
    model = spec.model_cls(args)
    model.load_state_dict(weights)
    count = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
    total = 0.0
    for inputs, labels in batches:
        if per_batch_mean:
            loss = cross_entropy_loss(model(inputs), labels) / len(batches)
        else:
            loss = cross_entropy_sum(model(inputs), labels) / count
        loss.backward()
        total += loss.item()
    return total, {name: p.grad for name, p in model.named_parameters()}


def _close(grads, expected, rtol=1e-5, atol=1e-7):
    assert grads.keys() == expected.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected[name], rtol=rtol, atol=atol, msg=name)


def test_every_token_trained_gives_todays_loss_and_gradients(tmp_path):
    inputs, labels = _batch(masked=False)
    batches = [(inputs[:4], labels[:4]), (inputs[4:], labels[4:])]
    config = _config(tmp_path, local=4, global_=8)  # 2 accumulation steps
    loss, grads, before = _in_process(config, batches)
    expected, expected_grads = _by_hand(config, before, batches, per_batch_mean=True)
    assert loss == pytest.approx(expected, rel=1e-6)
    _close(grads, expected_grads)


def test_accumulated_micro_batches_equal_one_batch_and_the_per_token_mean(tmp_path):
    inputs, labels = _batch(masked=True)
    accumulated = _in_process(
        _config(tmp_path / "a", local=4, global_=8),
        [(inputs[:4], labels[:4]), (inputs[4:], labels[4:])],
    )
    whole = _in_process(_config(tmp_path / "b", local=8, global_=8), [(inputs, labels)])
    config = _config(tmp_path, local=8, global_=8)
    expected, expected_grads = _by_hand(config, whole[2], [(inputs, labels)], False)
    assert accumulated[0] == pytest.approx(whole[0], rel=1e-6)
    assert whole[0] == pytest.approx(expected, rel=1e-6)
    _close(accumulated[1], whole[1])
    _close(whole[1], expected_grads)
    # The mean of the two micro-batches' means is another number: the test can tell.
    halves = [(inputs[:4], labels[:4]), (inputs[4:], labels[4:])]
    mean_of_means, _ = _by_hand(config, whole[2], halves, per_batch_mean=True)
    assert abs(mean_of_means - expected) > 0.01  # 0.028 at seed 0: far above rounding


def _rank(rank: int, init_file: str, tmp: str, weights_file: str, out: str) -> None:
    """One of two gloo ranks (FSDP over both): its half of the global batch, in two
    accumulated micro-batches, from the weights of the single-process run."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        inputs, labels = _batch(masked=True)
        mine = slice(4 * rank, 4 * rank + 4)
        inputs, labels = inputs[mine], labels[mine]
        batches = [(inputs[:2], labels[:2]), (inputs[2:], labels[2:])]
        weights = torch.load(weights_file, weights_only=True)
        loss, grads, _ = _step(_config(Path(tmp) / f"r{rank}", 2, 8), batches, weights)
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tmp_path, monkeypatch):
    """FSDP over 2 ranks, each with a quarter of the trained tokens or three quarters: the
    trained tokens are counted over both, so the loss and gradients are the one process's."""
    # Spawned ranks import this module by its importlib name, from the repository root.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))
    inputs, labels = _batch(masked=True)
    loss, grads, before = _in_process(_config(tmp_path, 8, 8), [(inputs, labels)])
    torch.save(before, tmp_path / "weights.pt")
    out = tmp_path / "ranks.pt"
    torch.multiprocessing.spawn(
        _rank,
        args=(str(tmp_path / "init"), str(tmp_path), str(tmp_path / "weights.pt"), str(out)),
        nprocs=2,
        join=True,
    )
    ranks = torch.load(out, weights_only=True)
    assert ranks["loss"] == pytest.approx(loss, rel=1e-5)
    _close(ranks["grads"], grads)


def test_validation_divides_the_summed_loss_by_all_trained_tokens(tmp_path):
    """Chat validation data: the loss is the summed token loss over every batch / every
    trained token, as ``cross_entropy_sum`` gives them by hand."""
    rows = [
        {"messages": [{"role": "user", "content": f"Q{i}" * (1 + i % 4)},
                      {"role": "assistant", "content": "A" * (1 + 3 * i % 7)}]}
        for i in range(12)
    ]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer = load_tokenizer("embedded_chat")
    config = ValidationConfig(
        enable=True, dataset=str(path), dataset_format="chat", seq_len=SEQ, local_batch_size=2
    )
    validator = Validator(
        config, tokenizer, dims=ParallelDims(world_size=1, device_type="cpu"), device="cpu"
    )
    from titan_models.llama3 import Llama3
    from titan_train.config.registry import load_model_spec

    args = load_model_spec("llama3").args_fn("debugmodel", vocab_size=tokenizer.vocab_size)
    args.n_layers, args.dim, args.n_heads, args.n_kv_heads = 1, 32, 2, 2
    torch.manual_seed(0)
    model = Llama3(args)
    model.init_weights()
    data = config.data_config(seq_len=SEQ, local_batch_size=2, infinite=False)
    total, count, tokens, means = 0.0, 0, 0, []
    with torch.no_grad():
        for inputs, labels in build_dataloader(data, tokenizer):
            total += cross_entropy_sum(model(inputs), labels).item()
            count += int((labels != IGNORE_INDEX).sum())
            tokens += labels.numel()
            if (labels != IGNORE_INDEX).any():
                means.append(cross_entropy_loss(model(inputs), labels).item())
    assert 0 < count < tokens
    assert validator.validate([model]) == pytest.approx(total / count, rel=1e-6)
    assert abs(sum(means) / len(means) - total / count) > 1e-3  # not the mean of means


def test_packed_windows_with_document_masking_equal_the_documents_run_unpacked(tmp_path):
    """SFT-shaped data packed two windows deep, document masking on (positions restarting):
    the step's loss and gradients equal those of every document run alone, unpacked, with
    its summed token loss over the trained tokens of all of them."""
    eos = load_tokenizer().eos_id
    inputs, labels = _batch(masked=True)
    inputs, labels = inputs[:2].clone(), labels[:2].clone()
    inputs[inputs == eos] = eos - 1  # the documents end only where the test says
    for row, ends in ((0, (3, 9)), (1, (6,))):
        inputs[row, list(ends)] = eos
    labels[1, 2:5] = torch.randint(0, 2048, (3,))  # a trained span in the first document too
    config = _config(tmp_path, local=2, global_=2)
    config.training.document_masking = True
    loss, grads, before = _in_process(config, [(inputs, labels)])

    from titan_models.documents import document_ids
    from titan_train.config.model_args import build_model_args
    from titan_train.config.registry import load_model_spec

    spec = load_model_spec("llama3")
    model = spec.model_cls(build_model_args(spec, config.model, vocab_size=2048, max_seq_len=SEQ))
    model.load_state_dict(before)
    count = int((labels != IGNORE_INDEX).sum())
    ids = document_ids(inputs, eos)
    total = 0.0
    for row in range(2):
        for doc in ids[row].unique():
            tokens = ids[row] == doc  # one document alone, from position 0
            doc_loss = cross_entropy_sum(
                model(inputs[row, tokens][None]), labels[row, tokens][None]
            )
            (doc_loss / count).backward()
            total += doc_loss.item() / count
    assert int(ids.max()) == 2  # three documents in row 0, two in row 1
    assert count > 0
    assert loss == pytest.approx(total, rel=1e-5)
    _close(grads, {name: p.grad for name, p in model.named_parameters()}, rtol=1e-4, atol=1e-6)
    # Without masking the packed window is another computation: the test can tell.
    config.training.document_masking = False
    plain, _, _ = _in_process(config, [(inputs, labels)], before)
    assert abs(plain - total) > 1e-4
