"""TextDataLoader: exact packing of [BOS] doc [EOS] streams into seq_len+1 windows, data-parallel
sharding, finite/infinite ends, and state that reshards between dp degrees with no window
repeated or skipped, checked against one uninterrupted rank."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from titan_train.data import (
    DataConfig,
    DataError,
    TextDataLoader,
    build_dataloader,
    embedded_documents,
    open_documents,
)
from titan_train.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
DOCS = ["alpha beta gamma", "delta", "", "epsilon zeta eta theta iota kappa"]


class _Docs:
    name = "fixed"

    def __init__(self, docs):
        self.docs = docs

    def iter_from(self, index):
        return iter(self.docs[index:])


def _stream(docs):
    return [t for d in docs for t in TOKENIZER.encode(d, bos=True, eos=True)]


def _windows(batches):
    """The full seq_len+1 windows behind (inputs, labels) batches, in order."""
    out = []
    for inputs, labels in batches:
        assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are inputs shifted by one
        rows = zip(inputs.tolist(), labels[:, -1].tolist(), strict=True)
        out += [(*row, last) for row, last in rows]
    return out


def _loader(docs=DOCS, **kwargs):
    kwargs = {"seq_len": 4, "local_batch_size": 2, **kwargs}
    return TextDataLoader(_Docs(docs), TOKENIZER, **kwargs)


def test_packs_documents_with_bos_eos_into_windows():
    stream = _stream(DOCS)
    # Documents of 9, 2, 0 and 18 tokens, each with BOS and EOS: 11 + 4 + 2 + 20 = 37.
    assert [len(TOKENIZER.encode(d)) for d in DOCS] == [9, 2, 0, 18]
    assert len(stream) == 37
    assert stream[11:17] == [TOKENIZER.bos_id, 1043, 455, TOKENIZER.eos_id, 2040, 2041]
    loader = _loader(infinite=False)
    batches = list(loader)
    # 37 tokens -> 7 windows of 5 (2 tokens left) -> 3 batches of 2 (the 7th window dropped).
    assert len(batches) == 3
    assert batches[0][0].shape == (2, 4)
    assert batches[0][0].dtype == torch.int64
    assert _windows(batches) == [tuple(stream[i : i + 5]) for i in range(0, 30, 5)]
    # 30 tokens consumed: documents 0-2 hold 17, so the next token is document 3's 14th.
    assert loader.state_dict() == {"epoch": 0, "document": 3, "token_offset": 13, "windows": 6}


def test_infinite_loops_over_epochs():
    loader = _loader(local_batch_size=1)
    windows = _windows(itertools.islice(loader, 9))
    stream = _stream(DOCS) * 2
    assert windows == [tuple(stream[i : i + 5]) for i in range(0, 45, 5)]
    # 45 tokens = one epoch of 37, then 8 into document 0 of epoch 1.
    assert loader.state_dict() == {"epoch": 1, "document": 0, "token_offset": 8, "windows": 9}


def test_ranks_split_each_step_round_robin():
    ref = _windows(itertools.islice(_loader(local_batch_size=1), 8))
    r0 = _windows(itertools.islice(_loader(dp_rank=0, dp_degree=2), 2))
    r1 = _windows(itertools.islice(_loader(dp_rank=1, dp_degree=2), 2))
    assert r0 == [ref[0], ref[2], ref[4], ref[6]]
    assert r1 == [ref[1], ref[3], ref[5], ref[7]]


def test_finite_gives_every_rank_the_same_number_of_batches():
    counts = [len(list(_loader(local_batch_size=1, dp_rank=r, dp_degree=3, infinite=False)))
              for r in range(3)]  # fmt: skip
    assert counts == [2, 2, 2]  # 7 windows: two full steps of 3, the 7th dropped


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3)])
def test_state_reshards_with_no_window_repeated_or_skipped(before, after):
    docs = embedded_documents()
    kwargs = {"seq_len": 64, "local_batch_size": 2}
    steps_before, steps_after = 3, 4
    n_total = 2 * (before * steps_before + after * steps_after)
    reference = _windows(itertools.islice(TextDataLoader(_Docs(docs), TOKENIZER, **kwargs),
                                          n_total // 2))  # fmt: skip

    seen, states = [], []
    for rank in range(before):
        loader = TextDataLoader(_Docs(docs), TOKENIZER, dp_rank=rank, dp_degree=before, **kwargs)
        seen.append(_windows(itertools.islice(loader, steps_before)))
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)  # rank-independent state
    assert states[0]["token_offset"] > 0  # the save point is inside a document

    resumed = []
    for rank in range(after):
        loader = TextDataLoader(_Docs(docs), TOKENIZER, dp_rank=rank, dp_degree=after, **kwargs)
        loader.load_state_dict(states[rank % before])
        resumed.append(_windows(itertools.islice(loader, steps_after)))

    # Windows of one step are ordered rank-fastest within each batch row.
    def step_order(per_rank, steps):
        degree = len(per_rank)
        return [per_rank[k % degree][s * 2 + k // degree]
                for s in range(steps) for k in range(2 * degree)]  # fmt: skip

    union = step_order(seen, steps_before) + step_order(resumed, steps_after)
    assert union == reference
    assert len(set(union)) == len(union) == n_total


def test_state_dict_round_trip_and_bad_state():
    loader = _loader()
    loader.load_state_dict({"epoch": 2, "document": 1, "token_offset": 1, "windows": 7})
    assert loader.state_dict() == {"epoch": 2, "document": 1, "token_offset": 1, "windows": 7}
    inputs, _ = next(iter(loader))
    stream = _stream(DOCS)
    assert inputs[0].tolist() == stream[12:16]  # document 1 starts at token 11; offset 1
    with pytest.raises(DataError, match=r"dataloader state lacks \['token_offset', 'windows'\]"):
        loader.load_state_dict({"epoch": 0, "document": 0})


def test_bad_rank_is_named():
    with pytest.raises(DataError, match=r"dp_rank=2, dp_degree=2 is not allowed"):
        _loader(dp_rank=2, dp_degree=2)


def test_empty_dataset_is_an_error_not_a_hang():
    with pytest.raises(DataError, match=r"dataset 'fixed' has no documents"):
        next(iter(_loader(docs=[])))


def test_build_from_the_training_section():
    from titan_train.config import TrainingConfig

    section = TrainingConfig(dataset="embedded", seq_len=16, local_batch_size=3, steps=10)
    data = section.data_config(seq_len=16, local_batch_size=3, infinite=True)
    loader = build_dataloader(data, TOKENIZER, dp_rank=1, dp_degree=2)
    assert loader.infinite
    assert loader.dp_rank == 1
    inputs, labels = next(iter(loader))
    assert inputs.shape == labels.shape == (3, 16)
    direct = TextDataLoader(open_documents(DataConfig()), TOKENIZER, seq_len=16,
                            local_batch_size=6)  # fmt: skip
    assert torch.equal(inputs, next(iter(direct))[0][1::2])


def test_only_a_data_config_is_taken():
    """No more matching of look-alike objects' field names: the sections convert explicitly."""
    section = SimpleNamespace(dataset="embedded", seq_len=16, local_batch_size=3)
    with pytest.raises(TypeError, match=r"takes a DataConfig.*\.data_config\("):
        build_dataloader(section, TOKENIZER)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_survives_torch_distributed_checkpoint(tmp_path):
    import torch.distributed.checkpoint as dcp

    saved = _loader()
    first = _windows(itertools.islice(saved, 2))
    dcp.save({"dataloader": saved}, checkpoint_id=tmp_path, no_dist=True)
    restored = _loader()
    dcp.load({"dataloader": restored}, checkpoint_id=tmp_path, no_dist=True)
    assert restored.state_dict() == saved.state_dict()
    reference = _windows(itertools.islice(_loader(), 3))
    assert first + _windows(itertools.islice(restored, 1)) == reference
