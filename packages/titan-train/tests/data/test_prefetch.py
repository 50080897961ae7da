"""Background prefetch: the dataloader's thread gives the same batches as no thread, stays
a bounded number of items ahead, ends when its iterator is dropped or replaced, and raises
a tokenizer's error in the training thread, after the batches made before it."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
import torch

from titan_train.data import DataConfig, TextDataLoader, open_documents
from titan_train.data.prefetch import Prefetcher
from titan_train.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()


def _source(tmp_path, n=40):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * (3 + i % 9)}) + "\n"
                            for i in range(n)))  # fmt: skip
    return open_documents(DataConfig(dataset=str(path)))


def _loader(source, tokenizer=TOKENIZER, **kwargs):
    return TextDataLoader(source, tokenizer, seq_len=8, local_batch_size=2, num_shards=4,
                          dp_rank=1, dp_degree=2, **kwargs)  # fmt: skip


def _data_threads():
    return [t for t in threading.enumerate() if t.name.startswith("titan-data")]


def test_prefetch_gives_the_same_batches_and_state(tmp_path):
    source = _source(tmp_path)
    plain, ahead = _loader(source), _loader(source, prefetch=3)
    for a, b in zip(itertools.islice(plain, 12), itertools.islice(ahead, 12), strict=True):
        assert torch.equal(a[0], b[0])
        assert torch.equal(a[1], b[1])
        # The state follows the batch handed out, not the thread running ahead of it.
        assert plain.state_dict() == ahead.state_dict()
    assert not _data_threads()


def test_the_thread_ends_with_its_iterator(tmp_path):
    loader = _loader(_source(tmp_path), prefetch=2)
    unstarted = iter(loader)  # the thread starts at once, before a batch is asked for
    assert len(_data_threads()) == 1
    del unstarted
    assert not _data_threads()
    batches = iter(loader)
    next(batches)
    assert len(_data_threads()) == 1
    again = iter(loader)  # a new iterator ends the old one's thread
    next(again)
    assert len(_data_threads()) == 1
    del batches, again  # dropping the generator closes it
    assert not _data_threads()
    for _ in itertools.islice(loader, 2):  # so does leaving a loop early
        pass
    assert not _data_threads()


class _Failing:
    """The real tokenizer, failing on one document."""

    bos_id, eos_id, vocab_size = TOKENIZER.bos_id, TOKENIZER.eos_id, TOKENIZER.vocab_size

    def encode(self, text, *, bos=False, eos=False):
        if text.startswith("document 21 "):
            raise ValueError("cannot encode document 21")
        return TOKENIZER.encode(text, bos=bos, eos=eos)


def test_a_tokenizer_error_in_the_thread_is_raised_in_order(tmp_path):
    source = _source(tmp_path)
    before, got = [], []
    with pytest.raises(ValueError, match="cannot encode document 21") as plain:
        before.extend(_loader(source, _Failing()))
    with pytest.raises(ValueError, match="cannot encode document 21") as threaded:
        got.extend(_loader(source, _Failing(), prefetch=4))
    assert len(got) == len(before) > 0  # every batch made before the error was delivered
    assert "encode" in "".join(str(f.name) for f in threaded.traceback)  # its own traceback
    assert plain.type is threaded.type
    assert not _data_threads()


def test_the_queue_is_bounded():
    made = []

    def produce():
        for i in itertools.count():
            made.append(i)
            yield i

    prefetcher = Prefetcher(produce, depth=3, name="titan-data-test")
    assert next(prefetcher) == 0
    time.sleep(0.3)
    assert len(made) <= 1 + 3 + 1  # the one taken, 3 waiting, 1 blocked on a full queue
    prefetcher.close()
    assert not prefetcher.alive
    with pytest.raises(StopIteration):
        next(prefetcher)
