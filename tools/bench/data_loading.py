"""Data loading at data-parallel degree 8: what one rank's dataloader costs the step.

Writes a ~200 MB jsonl corpus into a temporary folder (documents of words drawn from the
embedded corpus, lengths log-normal around 2.4 kB; nothing is downloaded), then measures
titan-train's ``TextDataLoader`` (shipped 2,048-id BPE, ``training.data_shards`` shards)
as rank 0 of 8 ranks would run it. Ranks share nothing while loading, so one rank in one
process is what each of the 8 does.

0. *Reading by rank*: rank 0 of 8, and of 64 (``data_shards`` 64: it needs documents
   ``i = 0 mod dp``) reads the whole corpus, as jsonl, a parquet and a txt copy, through
   titan-train's rank-aware reader (``titan_train.data.local_files``) and through
   ``datasets``' streaming reader with its by-example node split (the path before), which
   parses every row (pyarrow, or Python for txt) before the split drops the others: CPU
   seconds to read and parse (all threads; each CPU figure the fewest of 3 runs), the
   share of the corpus's rows the rank parsed, CPU seconds to tokenize its documents, the
   share of reading and parsing in its reading + tokenizing, and the seconds to the first
   document of a resume at the middle of the corpus. Both readers must give the same
   documents (checked). A second table (0b) shows what the rank reads from storage in
   each shard layout (``training.data_shard_layout``): with ``interleaved`` its documents
   are in every megabyte of every file; with ``contiguous`` it reads its shards' runs.
1. *Pipeline alone*: batches made as fast as possible on the caller's thread (no
   prefetch), tokens/s per rank, beside one process reading the whole stream (dp 1) and
   beside the single-stream layout (``data_shards = 1``), where every rank tokenizes all.
2. *Tokenizing work*: documents and tokens rank 0 of 8 encodes for ``--steps`` global steps,
   against what one process encodes for the same global windows (target ~1/8).
3. *Share of the step*: rank 0 of 8 with the background prefetch; each step takes its
   batch (timed: the wait for data) and then trains. Two steps: the Llama 3 debug model's
   forward + backward + AdamW on this CPU for the rank's batch (measured), and a device
   step of ``--device-step-ms`` (a sleep: a GPU step leaves the host's cores to the
   dataloader, as a sleep does). Share = data wait / step time.

    python tools/bench/data_loading.py                 # ~3 minutes on 2 cores
    python tools/bench/data_loading.py --mb 50 --steps 20 --model-steps 3
    python tools/bench/data_loading.py --mb 100 --parts 0   # reading by rank only, ~1 minute

Part 0 with ``--mb 100 --parts 0`` on the shared 2-core machine (102 MB, 40,000
documents), CPU seconds a rank spends reading and parsing the corpus, by rank against
``datasets`` (before): jsonl 0.10 against 0.28 at dp 8 and 0.06 against 0.24 at dp 64;
parquet 0.24 against 0.37 and 0.25 against 0.30 (the text column's pages are still
decoded whole); txt 0.30 against 0.79 and 0.75. The rank parses 0.125 (dp 8) and 0.016
(dp 64) of the rows instead of all. Reading is then 12% of a dp-8 rank's reading +
tokenizing CPU for jsonl (28% before), 40% at dp 64 (73% before). A resume at the
corpus's middle reaches its first document in 0.03-0.04 s for jsonl (0.12-0.16 s before),
0.06-0.07 s for parquet (0.24-0.27 s) and 0.31 s for txt (0.61-0.92 s).

Part 0b, the same command on 2026-12-03 (an AMD EPYC VM, 2 cores): rank 0 of 8 reads 12.7
of the jsonl's 101.6 MB with the contiguous layout (0.125) in 0.07 CPU s, against all of
it in 0.12 s interleaved; of 64, 1.6 MB (0.016) in 0.01 s against 0.06 s. Parquet (row
groups of 2,000 rows): 0.12 against 0.29 s at dp 8, 0.02 against 0.21 s at dp 64. Text
(paragraphs; added with text regions, run again that day): rank 0 of 8 reads 12.4 of
98.9 MB in 0.10 CPU s against 0.26 s, of 64 1.5 MB in 0.01 s against 0.23 s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional

from titan_train.data import DataConfig, TextDataLoader, embedded_documents, open_documents
from titan_train.data.sources import _HFSource, _load_streaming, iter_strided
from titan_train.tokenizer import load_tokenizer

DP = 8


def write_corpus(folder: Path, megabytes: float, seed: int = 0) -> tuple[Path, int]:
    """A jsonl file of about ``megabytes`` MB; its path and number of documents."""
    words = np.array(" ".join(embedded_documents()).split())
    rng = np.random.default_rng(seed)
    path, written, count = folder / "corpus.jsonl", 0, 0
    with path.open("w") as out:
        while written < megabytes * 1e6:
            lengths = np.clip(rng.lognormal(5.6, 0.8, 1000), 20, 8000).astype(int)
            picks = rng.integers(0, len(words), int(lengths.sum()))
            start = 0
            lines = []
            for n in lengths:
                lines.append(json.dumps({"text": " ".join(words[picks[start : start + n]])}))
                start += n
            chunk = "\n".join(lines) + "\n"
            out.write(chunk)
            written += len(chunk)
            count += len(lines)
    return path, count


class Counting:
    """The real tokenizer, counting documents and tokens it encodes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos_id, self.eos_id = tokenizer.bos_id, tokenizer.eos_id
        self.vocab_size = tokenizer.vocab_size
        self.documents = self.tokens = 0

    def encode(self, text, *, bos=False, eos=False):
        ids = self.tokenizer.encode(text, bos=bos, eos=eos)
        self.documents += 1
        self.tokens += len(ids)
        return ids


def loader(source, tokenizer, args, *, dp=DP, shards=None, local=None, prefetch=0):
    return TextDataLoader(
        source,
        tokenizer,
        seq_len=args.seq,
        local_batch_size=local or args.batch,
        dp_rank=0,
        dp_degree=dp,
        num_shards=args.shards if shards is None else shards,
        prefetch=prefetch,
    )


_SAMPLE_BY = {"text": {"sample_by": "paragraph"}}  # as titan_train.data.sources reads text


def _cpu(work, repeat=1):
    """``work()``'s result, and the fewest CPU seconds of this process (all threads) it
    took in ``repeat`` runs (the machine is shared: the least disturbed run counts)."""
    best = math.inf
    for _ in range(repeat):
        begin = time.process_time()
        result = work()
        best = min(best, time.process_time() - begin)
    return result, best


def reading_by_rank(jsonl: Path, tokenizer, args) -> None:
    import pyarrow.json
    import pyarrow.parquet

    parquet, text = jsonl.with_suffix(".parquet"), jsonl.with_suffix(".txt")
    table = pyarrow.json.read_json(jsonl)
    pyarrow.parquet.write_table(table, parquet, row_group_size=2000)
    text.write_text("\n\n".join(table.column("text").to_pylist()) + "\n")  # paragraphs
    print(f"\n0. Reading by rank: rank 0 of dp ranks, data_shards {args.shards}, whole corpus:")
    print(
        f"   {'file':<8}{'dp':>4}  {'reader':<27}{'read+parse cpu s':>17}{'rows parsed':>12}"
        f"{'tokenize cpu s':>15}{'parse share':>12}{'resume s':>9}"
    )
    for path, builder in ((jsonl, "json"), (parquet, "parquet"), (text, "text")):
        total = sum(1 for _ in open_documents(DataConfig(dataset=str(path))).iter_from(0))
        readers = {
            "by rank (local_files)": open_documents(DataConfig(dataset=str(path))),
            "datasets by-example split": _HFSource(
                path.name,
                _load_streaming(builder, data_files=[str(path)], **_SAMPLE_BY.get(builder, {})),
                "text",
            ),
        }
        for dp in (DP, 64):
            stride, own = math.gcd(dp, args.shards), None
            for name, source in readers.items():
                before = getattr(source, "rows_parsed", 0)
                docs, read_s = _cpu(
                    lambda s=source, k=stride: list(iter_strided(s, 0, k)), repeat=3
                )
                assert own is None or docs == own, "the two readers disagree"
                if own is None:
                    own = docs
                    _, token_s = _cpu(
                        lambda d=own: [tokenizer.encode(t, bos=True, eos=True) for _, t in d],
                        repeat=3,
                    )
                # datasets parses every row (pyarrow) before its split drops the others.
                parsed = (getattr(source, "rows_parsed", before + 3 * total) - before) / 3
                begin = time.perf_counter()
                next(iter_strided(source, total // 2, stride))
                resume = time.perf_counter() - begin
                print(
                    f"   {path.suffix[1:]:<8}{dp:>4}  {name:<27}{read_s:>17.2f}"
                    f"{parsed / total:>12.3f}{token_s:>15.2f}"
                    f"{read_s / (read_s + token_s):>12.1%}{resume:>9.2f}"
                )


def reading_contiguous(jsonl: Path, args) -> None:
    """Part 0, second table: what rank 0 reads from storage in each shard layout. The
    interleaved layout's rank reads every byte (its documents are in every megabyte);
    the contiguous layout's reads its shards' runs (``iter_region``)."""
    from titan_train.data.shards import owned_shards

    parquet, text = jsonl.with_suffix(".parquet"), jsonl.with_suffix(".txt")
    size = {path: path.stat().st_size for path in (jsonl, parquet, text)}
    print(f"\n0b. What rank 0 reads, by shard layout (data_shards {args.shards}):")
    print(
        f"   {'file':<8}{'dp':>4}  {'layout':<12}{'read+parse cpu s':>17}{'bytes read':>12}"
        f"{'of the file':>12}{'documents':>11}"
    )
    for path in (jsonl, parquet, text):
        for dp in (DP, 64):
            stride = math.gcd(dp, args.shards)
            own = owned_shards(args.shards, 0, dp)
            for layout in ("interleaved", "contiguous"):
                source = open_documents(DataConfig(dataset=str(path)))
                if layout == "interleaved":
                    work = lambda s=source, k=stride: list(iter_strided(s, 0, k))  # noqa: E731
                else:
                    work = lambda s=source, mine=own: [  # noqa: E731
                        text for r in mine for _, text in s.iter_region(r, args.shards, 0)
                    ]
                docs, read_s = _cpu(work, repeat=3)
                if path.suffix != ".parquet":  # the reader counts its bytes for regions
                    read = source.bytes_read / 3 if layout == "contiguous" else size[path]
                    shown = f"{read / 1e6:>10.1f}MB{read / size[path]:>12.3f}"
                else:  # parquet: the row groups holding the rank's rows (whole otherwise)
                    shown = f"{'':>12}{'':>12}"
                print(
                    f"   {path.suffix[1:]:<8}{dp:>4}  {layout:<12}{read_s:>17.2f}{shown}"
                    f"{len(docs):>11,}"
                )


def pipeline_alone(source, tokenizer, args) -> None:
    print(f"\n1. Pipeline alone, {args.steps} steps of {args.batch} x {args.seq} per rank:")
    print(f"   {'setting':<34}{'first batch s':>14}{'tokens/s per rank':>19}{'docs encoded':>14}")
    settings = [
        (f"rank 0 of {DP}, data_shards={args.shards}", {}),
        (f"rank 0 of {DP}, data_shards=1", {"shards": 1}),
        (f"1 process (dp 1), data_shards={args.shards}", {"dp": 1, "local": args.batch * DP}),
    ]
    for name, kwargs in settings:
        counting = Counting(tokenizer)
        batches = iter(loader(source, counting, args, **kwargs))
        begin = time.perf_counter()
        inputs, _ = next(batches)
        first = time.perf_counter() - begin
        tokens = 0
        begin = time.perf_counter()
        for _ in range(args.steps):
            inputs, _ = next(batches)
            tokens += inputs.numel()
        rate = tokens / (time.perf_counter() - begin)
        print(f"   {name:<34}{first:>14.2f}{rate:>19,.0f}{counting.documents:>14,}")


def tokenizing_work(source, tokenizer, args) -> None:
    print(f"\n2. Tokenizing work for {args.steps} global steps ({DP} x {args.batch} windows):")
    whole = Counting(tokenizer)
    for _ in itertools.islice(loader(source, whole, args, dp=1, local=args.batch * DP), args.steps):
        pass
    for shards in (args.shards, 1):
        rank = Counting(tokenizer)
        for _ in itertools.islice(loader(source, rank, args, shards=shards), args.steps):
            pass
        print(
            f"   rank 0 of {DP}, data_shards={shards:<4}: {rank.documents:,} documents, "
            f"{rank.tokens:,} tokens = {rank.tokens / whole.tokens:.3f} of the whole "
            f"({whole.documents:,} documents, {whole.tokens:,} tokens)"
        )


def model_step(args):
    from titan_models.llama3 import Llama3, llama3_args

    model_args = llama3_args("debugmodel", max_seq_len=args.seq)
    torch.manual_seed(0)
    model = Llama3(model_args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(inputs, labels):
        logits = model(inputs)
        loss = functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def share_of_step(source, tokenizer, args) -> None:
    print(f"\n3. Data wait with the background prefetch (depth {args.prefetch}), rank 0 of {DP}:")
    train = model_step(args)
    steps = {
        f"Llama 3 debugmodel fwd+bwd+AdamW, {args.batch}x{args.seq}, CPU": (
            train,
            args.model_steps,
        ),
        f"device step of {args.device_step_ms:.0f} ms (host idle)": (
            lambda inputs, labels: time.sleep(args.device_step_ms / 1e3),
            args.steps,
        ),
    }
    for name, (step, count) in steps.items():
        data = loader(source, tokenizer, args, prefetch=args.prefetch)
        batches = iter(data)
        step(*next(batches))  # the first batch (opening the files) and warm-up
        waits, totals = [], []
        for _ in range(count):
            begin = time.perf_counter()
            inputs, labels = next(batches)
            waited = time.perf_counter() - begin
            step(inputs, labels)
            waits.append(waited)
            totals.append(time.perf_counter() - begin)
        data.close()
        share = sum(waits) / sum(totals)
        print(
            f"   {name:<52} step {statistics.median(totals) * 1e3:8.1f} ms, wait median "
            f"{statistics.median(waits) * 1e3:6.2f} ms, max {max(waits) * 1e3:6.2f} ms: "
            f"share {share:.3%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=200, help="corpus size in MB")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--shards", type=int, default=64, help="training.data_shards")
    parser.add_argument("--steps", type=int, default=60, help="steps for parts 1-3")
    parser.add_argument("--model-steps", type=int, default=4, help="CPU model steps (part 3)")
    parser.add_argument("--device-step-ms", type=float, default=250.0, help="part 3")
    parser.add_argument("--prefetch", type=int, default=2, help="training.data_prefetch")
    parser.add_argument("--parts", default="0,1,2,3", help="which parts to run (0-3)")
    args = parser.parse_args()
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        begin = time.perf_counter()
        path, count = write_corpus(Path(tmp), args.mb)
        size = path.stat().st_size / 1e6
        print(
            f"corpus: {path.name}, {size:.0f} MB, {count:,} documents (written in "
            f"{time.perf_counter() - begin:.0f} s); tokenizer: shipped BPE, "
            f"{tokenizer.vocab_size} ids; torch threads {torch.get_num_threads()}"
        )
        parts = {int(p) for p in args.parts.split(",")}
        if 0 in parts:
            reading_by_rank(path, tokenizer, args)
            reading_contiguous(path, args)
        source = open_documents(DataConfig(dataset=str(path)))
        for part, run in ((1, pipeline_alone), (2, tokenizing_work), (3, share_of_step)):
            if part in parts:
                run(source, tokenizer, args)


if __name__ == "__main__":
    main()
