"""Data that scales with the ranks (issue 14): virtual shards read from a real local jsonl
through ``datasets`` (streaming, offline), checked against one uninterrupted rank.

- with dp 4 the documents each rank tokenizes are disjoint and cover the corpus;
- the union of the windows the ranks see equals one rank's stream at every dp dividing S;
- state saved at dp 4, merged as a distributed checkpoint merges it, resumes at dp 2 (and 3)
  with no window repeated or skipped and no document tokenized again;
- a state of the single-stream layout is refused with one message saying how to resume it.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from titan_train.data import DataConfig, DataError, TextDataLoader, open_documents
from titan_train.data.dataloader import explain_load_error
from titan_train.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer()
S = 8
SEQ = 16
LOCAL = 2  # sequences per rank per step


class Recording:
    """The real tokenizer, recording every text it encodes (the work each rank does)."""

    def __init__(self, tokenizer=TOKENIZER):
        self.tokenizer = tokenizer
        self.texts: list[str] = []
        self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id
        self.vocab_size = tokenizer.vocab_size

    def encode(self, text, *, bos=False, eos=False):
        self.texts.append(text)
        return self.tokenizer.encode(text, bos=bos, eos=eos)


def _corpus(tmp_path, n=48):
    """``n`` documents of varied length (8 to ~120 tokens), one jsonl file."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
             "kappa", "lambda", "mu"]  # fmt: skip
    texts = [f"doc{i} " + " ".join(words[(i + k) % 12] for k in range(3 + (i * 7) % 40))
             for i in range(n)]  # fmt: skip
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts, open_documents(DataConfig(dataset=str(path)))


def _loader(source, tokenizer=TOKENIZER, *, rank=0, dp=1, local=LOCAL, num_shards=S, **kwargs):
    return TextDataLoader(source, tokenizer, seq_len=SEQ, local_batch_size=local, dp_rank=rank,
                          dp_degree=dp, num_shards=num_shards, **kwargs)  # fmt: skip


def _rows(batch):
    inputs, labels = batch
    return [(*row, last) for row, last in zip(inputs.tolist(), labels[:, -1].tolist(), strict=True)]


def _global(per_rank_batches, dp, first=0):
    """The windows of steps of ``dp`` ranks in global order: window ``g`` is rank
    ``g mod dp``'s next row."""
    rows = [[r for b in batches for r in _rows(b)] for batches in per_rank_batches]
    taken = [0] * dp
    out = []
    for g in range(first, first + sum(map(len, rows))):
        out.append(rows[g % dp][taken[g % dp]])
        taken[g % dp] += 1
    return out


def _run(source, dp, steps, tokenizers=None, states=None, **kwargs):
    loaders = [_loader(source, tokenizers[r] if tokenizers else TOKENIZER, rank=r, dp=dp, **kwargs)
               for r in range(dp)]  # fmt: skip
    for loader in loaders:
        if states is not None:
            loader.load_state_dict(states)
    batches = [list(itertools.islice(loader, steps)) for loader in loaders]
    return _global(batches, dp, 0 if states is None else states["windows"]), loaders


CONTIGUOUS = {"shard_layout": "contiguous"}


def _regions(source, shards):
    return [[text for _, text in source.iter_region(s, shards, 0)] for s in range(shards)]


def _merged(loaders):
    """What a distributed checkpoint holds: every rank's shard keys, one copy each."""
    states = [loader.state_dict() for loader in loaders]
    assert len({(s["windows"], s["num_shards"]) for s in states}) == 1
    shards = {}
    for s in states:
        for key, position in s["shards"].items():
            assert shards.setdefault(key, position) == position  # ranks sharing one agree
    return {**states[0], "shards": shards}


def test_each_rank_tokenizes_a_disjoint_share_and_together_the_corpus(tmp_path):
    texts, source = _corpus(tmp_path)
    recorders = [Recording() for _ in range(4)]
    # Enough steps that every shard wrapped into its second epoch.
    _, loaders = _run(source, 4, 40, tokenizers=recorders)
    assert all(min(p["epoch"] for p in ld.state_dict()["shards"].values()) >= 1 for ld in loaders)
    tokenized = [set(r.texts) for r in recorders]
    for rank, seen in enumerate(tokenized):
        # Rank r reads shards r and r + 4, i.e. documents i = r (mod 4).
        assert seen == set(texts[rank::4])
    assert set().union(*tokenized) == set(texts)
    assert sum(map(len, tokenized)) == len(texts)  # disjoint
    # Tokenizing work: the ranks together encode exactly what one process encodes for the
    # same windows (no document twice), each rank the share its two shards need.
    one = Recording()
    _run(source, 1, 40, tokenizers=[one], local=LOCAL * 4)
    assert sum(len(r.texts) for r in recorders) == len(one.texts)
    assert all(0.15 < len(r.texts) / len(one.texts) < 0.35 for r in recorders)


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_the_ranks_windows_together_are_one_ranks_stream(tmp_path, dp):
    _, source = _corpus(tmp_path)
    reference, _ = _run(source, 1, 24, local=LOCAL * dp)
    union, _ = _run(source, dp, 24)
    assert len(union) == 24 * LOCAL * dp
    assert union == reference


def test_one_stream_is_the_stream_before_shards(tmp_path):
    texts, source = _corpus(tmp_path)
    one = TextDataLoader(source, TOKENIZER, seq_len=SEQ, local_batch_size=4, num_shards=1)
    flat = [t for d in texts for t in TOKENIZER.encode(d, bos=True, eos=True)]
    windows = [w for b in itertools.islice(one, 5) for w in _rows(b)]
    assert windows == [tuple(flat[i : i + SEQ + 1]) for i in range(0, 20 * (SEQ + 1), SEQ + 1)]


@pytest.mark.parametrize("layout", ["interleaved", "contiguous"])
def test_shard_windows_are_packed_per_shard(tmp_path, layout):
    texts, source = _corpus(tmp_path)
    # One window of each shard per step.
    windows, _ = _run(source, 1, 4, local=S, shard_layout=layout)
    for s in range(S):
        # A shard's documents: every S-th, or the s-th run (the contiguous layout).
        mine_docs = texts[s::S] if layout == "interleaved" else _regions(source, S)[s]
        flat = [t for d in mine_docs for t in TOKENIZER.encode(d, bos=True, eos=True)]
        mine = [windows[g] for g in range(s, len(windows), S)]
        assert mine == [tuple(flat[i : i + SEQ + 1]) for i in range(0, len(mine) * (SEQ + 1),
                                                                   SEQ + 1)]  # fmt: skip


@pytest.mark.parametrize("after", [2, 3, 1])
def test_resume_at_another_dp_continues_exactly(tmp_path, after):
    texts, source = _corpus(tmp_path)
    before, steps_before, steps_after = 4, 5, 6
    total = before * steps_before + after * steps_after
    reference, _ = _run(source, 1, total, local=LOCAL)

    recorders = [Recording() for _ in range(after)]
    seen, loaders = _run(source, before, steps_before)
    state = _merged(loaders)
    assert any(p["token_offset"] > 0 for p in state["shards"].values())  # mid-document
    resumed, _ = _run(source, after, steps_after, tokenizers=recorders, states=state)
    assert seen + resumed == reference
    # No replay: a resumed rank tokenizes no document before its shard's saved position.
    assert all(p["epoch"] == 0 for p in state["shards"].values())
    for recorder in recorders:
        assert recorder.texts
        for text in recorder.texts:
            index = texts.index(text)
            assert index >= state["shards"][str(index % S)]["document"]


def test_state_survives_a_distributed_checkpoint_merge(tmp_path):
    """DCP stores each rank's shard keys; a fresh loader asks for all of them."""
    import torch.distributed.checkpoint as dcp

    _, source = _corpus(tmp_path)
    seen, loaders = _run(source, 1, 3, local=LOCAL * 2)
    dcp.save({"dataloader": loaders[0]}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    restored = _loader(source, rank=1, dp=2)
    dcp.load({"dataloader": restored}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert restored.state_dict()["windows"] == 3 * LOCAL * 2
    reference, _ = _run(source, 1, 5, local=LOCAL * 2)
    rank1 = _rows(next(iter(restored)))
    assert rank1 == reference[len(seen) + 1 :: 2][:LOCAL]


def test_a_single_stream_checkpoint_names_how_to_resume(tmp_path):
    import torch.distributed.checkpoint as dcp

    _, source = _corpus(tmp_path)
    old = TextDataLoader(source, TOKENIZER, seq_len=SEQ, local_batch_size=2)  # num_shards 1
    next(iter(old))
    dcp.save({"dataloader": old}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    sharded = _loader(source)
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException
        dcp.load({"dataloader": sharded}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    error = explain_load_error(raised.value, S)
    assert error is not None
    assert "training.data_shards = 1" in str(error)
    assert "exclude_from_loading" in str(error)
    # Handed over directly, the same state is refused the same way.
    with pytest.raises(DataError, match=r"--training.data_shards 1 to continue"):
        _loader(source).load_state_dict(old.state_dict())
    # ... and loads as it always did into one stream.
    again = TextDataLoader(source, TOKENIZER, seq_len=SEQ, local_batch_size=2)
    again.load_state_dict(old.state_dict())
    assert torch.equal(next(iter(again))[0], next(iter(old))[0])


def test_fewer_documents_than_shards_is_one_clear_error_before_any_batch(tmp_path):
    _, source = _corpus(tmp_path, n=5)
    recorder = Recording()
    # Refused at construction: the first document of each of the rank's shards is read.
    with pytest.raises(DataError, match=r"no document for data shard\(s\) \[5, 6, 7\] of 8.*"
                                        r"Lower training.data_shards"):  # fmt: skip
        _loader(source, recorder)
    assert recorder.texts == []  # before any tokenizing
    # Rank 1 of 2 owns the odd shards, two of them empty; rank 0 of 8 owns shard 0 alone.
    with pytest.raises(DataError, match=r"no document for data shard\(s\) \[5, 7\] of 8"):
        _loader(source, rank=1, dp=2)
    assert next(iter(_loader(source, rank=0, dp=8, local=1)))[0].shape == (1, SEQ)


@pytest.mark.slow  # 6 processes: ~20 s alone on 2 cores
def test_four_gloo_ranks_save_and_two_resume_through_titan_ckpt(tmp_path):
    """The real path: 4 ranks save their dataloaders (each its own shard keys) in one
    distributed checkpoint with titan-ckpt; 2 ranks load it and read on."""
    from pathlib import Path

    from titan_dims.testing import run_torchrun

    texts, source = _corpus(tmp_path)
    worker = Path(__file__).parent / "workers" / "dp_resume.py"
    corpus, folder = str(tmp_path / "corpus.jsonl"), str(tmp_path / "ckpt")
    for mode, nproc, steps in (("save", 4, 3), ("load", 2, 4)):
        run_torchrun(worker, nproc, [mode, corpus, folder, str(tmp_path), str(steps)],
                     timeout=120, env={"PYTHONWARNINGS": "ignore"})  # fmt: skip
    results = {
        (mode, r): json.loads((tmp_path / f"{mode}-rank{r}.json").read_text())
        for mode, nproc in (("save", 4), ("load", 2))
        for r in range(nproc)
    }

    def in_order(mode, dp, first):
        rows = [[tuple(w) for w in results[mode, r]["windows"]] for r in range(dp)]
        taken, out = [0] * dp, []
        for g in range(first, first + sum(map(len, rows))):
            out.append(rows[g % dp][taken[g % dp]])
            taken[g % dp] += 1
        return out

    reference, _ = _run(source, 1, 4 * 3 + 2 * 4)
    assert in_order("save", 4, 0) + in_order("load", 2, 24) == reference
    saved = [set(results["save", r]["texts"]) for r in range(4)]
    assert sum(map(len, saved)) == len(set().union(*saved))  # disjoint at dp 4
    for r in range(2):  # at dp 2, rank r reads documents i = r (mod 2)
        assert {texts.index(t) % 2 for t in results["load", r]["texts"]} == {r}


def test_each_rank_resumes_from_its_own_state_alone(tmp_path):
    """As torchft's replica groups do: each saves and loads only its own dataloader."""
    _, source = _corpus(tmp_path)
    reference, _ = _run(source, 1, 12)
    seen, loaders = _run(source, 2, 3)
    states = [loader.state_dict() for loader in loaders]
    assert [sorted(map(int, s["shards"])) for s in states] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    resumed = []
    for rank, state in enumerate(states):
        loader = _loader(source, rank=rank, dp=2)
        assert loader.state_dict()["shards"].keys() == state["shards"].keys()  # what DCP asks
        loader.load_state_dict(state)
        resumed.append(list(itertools.islice(loader, 3)))
    assert seen + _global(resumed, 2, states[0]["windows"]) == reference


# The contiguous layout: shard s is the s-th contiguous run of the corpus.


def _two_files(tmp_path, n=48):
    """``_corpus``'s documents over two jsonl files (a BOM, CRLF and blank lines in them)."""
    texts, _ = _corpus(tmp_path, n)
    folder = tmp_path / "two"
    folder.mkdir()
    rows = [json.dumps({"text": t}) for t in texts]
    (folder / "a.jsonl").write_bytes(
        b"\xef\xbb\xbf" + "\r\n".join(rows[:20]).encode() + b"\r\n\n  \n"
    )
    (folder / "b.jsonl").write_text("\n\n".join(rows[20:]))  # no newline at the end
    return texts, open_documents(DataConfig(dataset=str(folder)))


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 8, 13])
def test_regions_split_the_files_exactly_at_any_count(tmp_path, shards):
    texts, source = _two_files(tmp_path)
    regions = _regions(source, shards)
    assert [t for region in regions for t in region] == texts  # each row once, in order
    # Row k of a region from the k-th on (a resume inside the region) without the earlier.
    for s, region in enumerate(regions):
        for first in (0, 1, len(region) // 2, len(region), len(region) + 3):
            rows = list(source.iter_region(s, shards, first))
            assert rows == list(enumerate(region))[first:]


@pytest.mark.parametrize("shards", [2, 4, 8, 16])
def test_region_edges_on_line_starts_give_each_row_once(tmp_path, shards):
    """Eight rows of 16 bytes each, so that region edges fall on line starts (and, with 16
    regions of 8 bytes, every other region holds no row start at all)."""
    texts = [f"r{i}a" for i in range(8)]
    rows = [json.dumps({"text": t}) + "\n" for t in texts]
    assert {len(r) for r in rows} == {16}
    path = tmp_path / "even.jsonl"
    path.write_text("".join(rows))
    source = open_documents(DataConfig(dataset=str(path)))
    regions = _regions(source, shards)
    assert [t for region in regions for t in region] == texts
    if shards <= 8:
        assert regions == [texts[k : k + 8 // shards] for k in range(0, 8, 8 // shards)]
        assert source.bytes_read == 16 * 8  # no row read twice
    else:  # a region starting mid-row reads that row's end to find the next start
        assert regions[1::2] == [[]] * 8
        assert source.bytes_read == 16 * 8 + 8 * 8


def test_regions_are_by_bytes_and_a_rank_reads_only_its_own(tmp_path):
    texts, _ = _corpus(tmp_path)
    path = tmp_path / "corpus.jsonl"
    total, longest = path.stat().st_size, max(len(line) for line in path.read_bytes().split(b"\n"))
    dp = 4
    recorders = [Recording() for _ in range(dp)]
    sources = [open_documents(DataConfig(dataset=str(path))) for _ in range(dp)]
    loaders = [_loader(sources[r], recorders[r], rank=r, dp=dp, **CONTIGUOUS) for r in range(dp)]
    for loader in loaders:  # every shard into its second epoch
        list(itertools.islice(loader, 40))
    assert all(min(p["epoch"] for p in ld.state_dict()["regions"].values()) >= 1 for ld in loaders)
    tokenized = [set(r.texts) for r in recorders]
    assert set().union(*tokenized) == set(texts)
    assert sum(map(len, tokenized)) == len(texts)  # disjoint
    # Rank r reads shards r and r + 4: two runs of 1/8 of the bytes (each pass once per
    # epoch), plus the ends of the rows crossing their edges.
    epochs = [1 + max(p["epoch"] for p in ld.state_dict()["regions"].values()) for ld in loaders]
    for source, passes in zip(sources, epochs, strict=True):
        assert source.bytes_read <= passes * (total / dp + 2 * 2 * longest)
        assert source.bytes_read >= (passes - 1) * (total / dp - 2 * 2 * longest)
    # The documents of shard s are the s-th run of the rows.
    for s, region in enumerate(_regions(sources[0], S)):
        assert set(region) <= tokenized[s % dp]


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_contiguous_ranks_together_are_one_ranks_stream(tmp_path, dp):
    _, source = _two_files(tmp_path)
    reference, _ = _run(source, 1, 24, local=LOCAL * dp, **CONTIGUOUS)
    union, _ = _run(source, dp, 24, **CONTIGUOUS)
    assert union == reference
    interleaved, _ = _run(source, 1, 24, local=LOCAL * dp)
    assert union != interleaved  # another stream


@pytest.mark.parametrize("after", [2, 3, 1])
def test_contiguous_resume_at_another_dp_continues_exactly(tmp_path, after):
    _, source = _two_files(tmp_path)
    reference, _ = _run(source, 1, 4 * 5 + after * 6, **CONTIGUOUS)
    seen, loaders = _run(source, 4, 5, **CONTIGUOUS)
    states = [loader.state_dict() for loader in loaders]
    state = {**states[0], "regions": {k: v for s in states for k, v in s["regions"].items()}}
    assert "shards" not in state
    assert any(p["token_offset"] > 0 for p in state["regions"].values())  # mid-document
    recorders = [Recording() for _ in range(after)]
    resumed, _ = _run(source, after, 6, tokenizers=recorders, states=state, **CONTIGUOUS)
    assert seen + resumed == reference
    # No replay: a resumed shard starts at its saved document (k S + s: row k of shard s).
    regions = _regions(source, S)
    for recorder in recorders:
        for text in recorder.texts:
            s = next(s for s, region in enumerate(regions) if text in region)
            saved = state["regions"][str(s)]
            assert saved["epoch"] > 0 or regions[s].index(text) >= saved["document"] // S


def test_a_state_of_the_other_layout_is_refused_with_how_to_resume(tmp_path):
    import torch.distributed.checkpoint as dcp

    _, source = _corpus(tmp_path)
    for saver, loader, saved in (({}, CONTIGUOUS, "interleaved"), (CONTIGUOUS, {}, "contiguous")):
        old = _loader(source, **saver)
        next(iter(old))
        with pytest.raises(DataError, match=rf"data_shard_layout='{saved}'.*"
                                            rf"--training.data_shard_layout {saved}"):  # fmt: skip
            _loader(source, **loader).load_state_dict(old.state_dict())
        # Through a distributed checkpoint: DCP misses the other layout's keys.
        folder = tmp_path / f"ckpt-{saved}"
        dcp.save({"dataloader": old}, checkpoint_id=folder, no_dist=True)
        fresh = _loader(source, **loader)
        with pytest.raises(BaseException) as raised:
            dcp.load({"dataloader": fresh}, checkpoint_id=folder, no_dist=True)
        error = explain_load_error(raised.value, S, fresh.shard_layout)
        assert error is not None
        assert f"training.data_shard_layout = '{saved}'" in str(error)


def test_contiguous_needs_a_source_read_by_regions(tmp_path):
    from titan_train.data import build_dataloader

    class Stream:  # a source of the protocol's minimum: no regions
        name = "stream"

        def iter_from(self, index):
            return iter(["one", "two"][index:])

    with pytest.raises(DataError, match=r"cannot be split into contiguous shards.*Stream.*"
                                        r"data_shard_layout = 'interleaved'"):  # fmt: skip
        _loader(Stream(), **CONTIGUOUS)
    with pytest.raises(DataError, match="data_shard_layout='rows' is not allowed"):
        DataConfig(shard_layout="rows")
    # The embedded corpus is read by regions (by documents), one shard as one stream.
    embedded = build_dataloader(DataConfig(num_shards=S, seq_len=SEQ, **CONTIGUOUS), TOKENIZER)
    assert "regions" in embedded.state_dict()
    one = build_dataloader(DataConfig(num_shards=1, seq_len=SEQ, **CONTIGUOUS), TOKENIZER)
    plain = build_dataloader(DataConfig(num_shards=1, seq_len=SEQ), TOKENIZER)
    assert torch.equal(next(iter(one))[0], next(iter(plain))[0])
    assert one.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt", "embedded"])
def test_a_contiguous_shard_without_a_document_is_refused_before_any_batch(tmp_path, kind):
    texts = [f"document {i}" for i in range(5)]
    if kind == "embedded":
        from titan_train.data.sources import _ListSource

        source = _ListSource("five", texts)
    else:
        path = tmp_path / f"five.{kind}"
        if kind == "jsonl":
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        elif kind == "txt":
            path.write_text("\n\n".join(texts))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": texts}), path)
        source = open_documents(DataConfig(dataset=str(path)))
    recorder = Recording()
    # 8 shards over 5 documents: some shard has none; the loader refuses at construction.
    with pytest.raises(DataError, match=r"no document in data shard\(s\) \[\d.*of 8.*"
                                        r"Lower training.data_shards"):  # fmt: skip
        _loader(source, recorder, **CONTIGUOUS)
    assert recorder.texts == []  # before any tokenizing
    # A rank whose own shards all hold documents is not refused (rank 1 of 8 owns shard 1
    # alone, and with 5 documents shard 1 of 8 holds one by rows and by bytes).
    regions = _regions(source, S)
    assert regions[1]
    assert not all(regions)
    assert list(itertools.islice(_loader(source, rank=1, dp=8, local=1, **CONTIGUOUS), 2))
    assert [t for r in regions for t in r] == texts


def _paragraph_files(folder, seed, files=3):
    """Text files of random paragraphs, with every kind of line end and blank-line run."""
    import random

    rnd = random.Random(seed)
    atoms = [b"a", b"bc", b"\n", b"\r", b"\r\n", b" ", "\u00e9".encode(), b"xyz"]
    folder.mkdir()
    for f in range(files):
        data = b"".join(rnd.choice(atoms) for _ in range(rnd.randint(0, 120)))
        (folder / f"part{f}.txt").write_bytes(data)
    return open_documents(DataConfig(dataset=str(folder)))


@pytest.mark.parametrize("seed", range(12))
def test_text_regions_split_paragraphs_exactly_at_any_count(tmp_path, seed, monkeypatch):
    from titan_train.data import local_files

    source = _paragraph_files(tmp_path / "txt", seed)
    assert isinstance(source, local_files.TextSource)
    whole = list(source.iter_from(0))  # the sequential split (what the interleaved layout reads)
    # Small reads put chunk edges inside line-end runs and "\r\n" pairs.
    monkeypatch.setattr(local_files, "_REGION_CHUNK", [1, 3, 7, 1 << 20][seed % 4])
    for shards in (1, 2, 3, 5, 8, 17, 64):
        regions = _regions(source, shards)
        assert [t for region in regions for t in region] == whole
        for s, region in enumerate(regions):
            assert source.region_has_rows(s, shards) == bool(region)
            for first in (1, len(region)):
                assert list(source.iter_region(s, shards, first)) == list(enumerate(region))[first:]


def test_text_regions_read_only_their_bytes(tmp_path):
    paragraphs = [f"paragraph {i} " + "word " * (5 + i % 9) for i in range(64)]
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(paragraphs))
    total, longest = path.stat().st_size, max(map(len, paragraphs)) + 2
    for shards in (2, 8):
        sources = [open_documents(DataConfig(dataset=str(path))) for _ in range(shards)]
        regions = [[t for _, t in src.iter_region(s, shards, 0)] for s, src in enumerate(sources)]
        assert [t for r in regions for t in r] == paragraphs
        for src in sources:  # its share, the paragraph crossing its end, the one before it
            assert total / shards - longest <= src.bytes_read <= total / shards + 2 * longest + 256


def test_datasets_streams_are_split_into_regions_by_whole_files(tmp_path):
    """Compressed JSON lines keep datasets' streaming reader; their regions are whole files
    (datasets' own contiguous shard), and a region never opens another's files: the last
    file is corrupt, and the regions before it read fine."""
    import gzip

    texts, _ = _corpus(tmp_path, n=40)
    folder = tmp_path / "gz"
    folder.mkdir()
    for f in range(4):
        rows = "".join(json.dumps({"text": t}) + "\n" for t in texts[f * 10 : (f + 1) * 10])
        (folder / f"part{f}.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    source = open_documents(DataConfig(dataset=str(folder)))
    assert not hasattr(source, "region_has_rows")  # datasets' reader, not ours
    assert _regions(source, 2) == [texts[:20], texts[20:]]
    assert _regions(source, 4) == [texts[k : k + 10] for k in range(0, 40, 10)]
    assert list(source.iter_region(1, 2, 15)) == list(enumerate(texts[20:]))[15:]
    union, _ = _run(source, 2, 4, num_shards=4, **CONTIGUOUS)
    reference, _ = _run(source, 1, 4, local=LOCAL * 2, num_shards=4, **CONTIGUOUS)
    assert union == reference
    # More shards than files: refused before any batch, saying how many files there are.
    with pytest.raises(DataError, match=r"in 4 file\(s\).*whole files.*data_shards to at most "
                                        r"4.*'interleaved'"):  # fmt: skip
        _loader(source, **CONTIGUOUS)
    (folder / "part3.jsonl.gz").write_bytes(b"not gzip at all")
    broken = open_documents(DataConfig(dataset=str(folder)))
    for s in range(3):
        assert [t for _, t in broken.iter_region(s, 4, 0)] == texts[s * 10 : (s + 1) * 10]
    with pytest.raises(Exception):  # noqa: B017 - datasets' own error for a corrupt file
        list(broken.iter_region(3, 4, 0))


def test_parquet_regions_are_by_rows_over_files_and_row_groups(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, _ = _corpus(tmp_path, n=50)
    folder = tmp_path / "pq"
    folder.mkdir()
    for name, part in (("a", texts[:23]), ("b", texts[23:])):
        table = pa.table({"id": list(range(len(part))), "text": part})
        pq.write_table(table, folder / f"{name}.parquet", row_group_size=4)
    source = open_documents(DataConfig(dataset=str(folder)))
    for shards in (1, 3, 8):
        regions = _regions(source, shards)
        assert [t for r in regions for t in r] == texts
        assert max(map(len, regions)) - min(map(len, regions)) <= 1  # by rows
        last = shards - 1
        assert list(source.iter_region(last, shards, 2)) == list(enumerate(regions[last]))[2:]
    union, _ = _run(source, 4, 6, **CONTIGUOUS)
    reference, _ = _run(source, 1, 6, local=LOCAL * 4, **CONTIGUOUS)
    assert union == reference


def test_the_trainer_saves_the_contiguous_layout_and_refuses_the_other_on_resume(tmp_path, capsys):
    """``training.data_shard_layout`` through ``titan-train``: the checkpoint holds the
    dataloader's ``regions``; resuming it with the other layout exits 2 before training,
    naming the key and value to resume with."""
    from torch.distributed.checkpoint import FileSystemReader

    from titan_train.cli import main

    args = ["train", "--job.dump_folder", str(tmp_path), "--training.seq_len", "32",
            "--training.local_batch_size", "2", "--checkpoint.interval", "1",
            "--metrics.log_freq", "1"]  # fmt: skip
    assert main([*args, "--training.steps", "2", "--training.data_shard_layout", "contiguous"]) == 0
    keys = (
        FileSystemReader(str(tmp_path / "checkpoint" / "step-2"))
        .read_metadata()
        .state_dict_metadata
    )
    assert any(k.startswith("dataloader.regions.") for k in keys)
    assert not any(k.startswith("dataloader.shards.") for k in keys)
    capsys.readouterr()
    assert main([*args, "--training.steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "training.data_shard_layout = 'contiguous'" in err
    assert "exclude_from_loading" in err
    assert main([*args, "--training.steps", "3", "--training.data_shard_layout", "contiguous"]) == 0


def test_a_datasets_stream_resumes_from_its_state_without_reading_earlier_files(tmp_path):
    """The contiguous layout saves, with each shard's position, the state of datasets'
    stream there; a resume loads it instead of reading past the region's earlier rows: it
    still continues exactly when files the shard had finished are no longer readable
    (datasets' state points at the start of an Arrow table read a little earlier, here up
    to two small files back: those are read again, up to the position)."""
    import gzip

    import torch.distributed.checkpoint as dcp

    texts, _ = _corpus(tmp_path, n=96)
    folder = tmp_path / "gz"
    folder.mkdir()
    for f in range(12):  # two regions of 6 files of 8 documents
        rows = "".join(json.dumps({"text": t}) + "\n" for t in texts[f * 8 : (f + 1) * 8])
        (folder / f"part{f:02d}.jsonl.gz").write_bytes(gzip.compress(rows.encode()))
    config = DataConfig(dataset=str(folder))
    kwargs = {"num_shards": 2, "local": 8, **CONTIGUOUS}
    reference, _ = _run(open_documents(config), 1, 34, **kwargs)
    seen, loaders = _run(open_documents(config), 1, 26, **kwargs)
    state = loaders[0].state_dict()
    sources = {s: json.loads(p["source"]) for s, p in state["regions"].items()}
    assert all(sources.values())  # datasets' own state, as saved
    rows = {s: p["document"] // 2 for s, p in state["regions"].items()}
    assert 24 <= min(rows.values()) <= max(rows.values()) < 40, rows  # in their 4th-5th file
    folder_ckpt = tmp_path / "ckpt"
    dcp.save({"dataloader": loaders[0]}, checkpoint_id=folder_ckpt, no_dist=True)
    # A file each region finished before the last two (datasets' state may point that far
    # back): unreadable now (not the corpus's first, from which datasets infers the columns
    # when it opens the folder).
    for f in (1, 6):
        (folder / f"part{f:02d}.jsonl.gz").write_bytes(b"gone")
    fresh = _loader(open_documents(config), **kwargs)
    dcp.load({"dataloader": fresh}, checkpoint_id=folder_ckpt, no_dist=True)
    assert fresh.state_dict() == state
    resumed = _global([list(itertools.islice(fresh, 8))], 1, state["windows"])
    assert seen + resumed == reference
    # Without the saved stream states the same resume reads past the rows: it fails here.
    plain = {**state, "regions": {s: {**p, "source": ""} for s, p in state["regions"].items()}}
    fresh = _loader(open_documents(config), **kwargs)
    fresh.load_state_dict(plain)
    with pytest.raises(Exception, match="gzip"):
        next(iter(fresh))
    # Local files keep no stream state: their regions resume by counting rows.
    _, local = _corpus(tmp_path, n=20)
    _, ran = _run(local, 1, 2, **kwargs)
    assert {p["source"] for p in ran[0].state_dict()["regions"].values()} == {""}


def test_a_damaged_stream_state_is_refused_when_loaded(tmp_path):
    _, source = _corpus(tmp_path)
    loader = _loader(source, **CONTIGUOUS)
    next(iter(loader))
    state = loader.state_dict()
    state["regions"]["3"]["source"] = "__import__('os')"  # not titan-train's JSON object
    with pytest.raises(DataError, match=r"data shard 3: its stream state .* not the JSON object"):
        _loader(source, **CONTIGUOUS).load_state_dict(state)
