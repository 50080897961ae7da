"""Issue 14's integrity targets, measured side by side on one state in one run.

Run through ``tools/bench/ckpt_save_load.py --targets`` (which starts the gloo ranks), or as
``python tools/bench/run.py ckpt_targets [ARGS]`` (the same). The state is a Llama 3 model
(``titan_models.llama3.Llama3``, ``--llama-dim``/``--llama-layers``, vocab 16384) with its AdamW
state after one training step, FSDP2-sharded over the ranks. Each repetition runs every
measure once, the order reversed every other repetition (A,B,C,D then D,C,B,A), after one
unrecorded warm-up round:

- plain ``dcp.save``: torch's DCP save of the same state dict (model FQNs at the top level,
  the flattened optimizer state under ``optimizer``) to DCP's default ``FileSystemWriter``.
  That is what torchtitan's ``CheckpointManager`` (July 2025, 6204cdff9) does in a
  synchronous save (``dcp.save(state, checkpoint_id=...)``), less its ``gc.collect``, and
  with Python's automatic garbage collection off, as torchtitan's trainer runs (the manager
  pauses it around its own DCP calls): the torchtitan-equivalent baseline;
- sync save, integrity off: ``CheckpointManager.save`` with async_mode=disabled through a
  writer that reports file sizes but hashes nothing (bench-only: the manager has no switch
  to turn integrity off); the manager's own costs (owner marker, commit, collectives) stay;
- sync save, integrity on: the same with titan-ckpt's default writer (hashing while writing,
  with ``--checksum``: auto, i.e. xxh3_128 where xxhash is installed, or sha256);
- both async modes as titan-train drives them (``Targets.driven``): save(), the next
  step's forward/backward (1 x 128 tokens) while the background copy runs (the whole state
  with async_with_pinned_mem; with async, the optimizer's state, the model's being copied
  before save() returns), then ``maybe_wait_for_staging()`` before that step's optimizer
  step. "blocked" is the time spent in save() and in that wait ("in save()": the first
  part alone; the wait is what remains of the background copy after that short
  forward/backward, which a real step's longer one would hide); "delayed" is how much
  longer the whole took than a forward/backward alone (so it also counts the copy slowing
  the step down); the write is then awaited outside the measure;
- load with ``verify_checksums`` off and on, of the integrity-on step.

Every measure is bracketed by barriers (the slowest rank's time); steps are deleted after
each repetition. Ratios are of medians, and, per repetition, of the two measures taken next
to each other (their median and range): on a shared machine the latter cancel some of the
load that comes and goes. "met" judges the ratio of medians.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titan_ckpt import CheckpointConfig, CheckpointManager, LocalStorage, OptimizerState
from titan_ckpt.formats.checksums import resolve_checksum
from titan_ckpt.formats.hashing import HashingFileSystemWriter, HashingStream, _HashingFileSystem

SAVES = (
    "plain dcp.save",
    "sync save, integrity off",
    "sync save, integrity on",
    "async blocked",
    "async in save()",
    "async delayed",
    "pinned blocked",
    "pinned in save()",
    "pinned delayed",
)
LOADS = ("load, verify off", "load, verify on")


class _CountingStream(HashingStream):
    """A write stream that counts its bytes and hashes none."""

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        self._size += memoryview(data).nbytes
        return n

    def digest(self) -> dict[str, Any] | None:
        return {"size": self._size, self._algorithm: "not computed (bench)"}


class _SizesOnly(_HashingFileSystem):
    """DCP's filesystem recording each written file's size, hashing nothing."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str):
        with self._inner.create_stream(path, mode) as raw:
            stream = _CountingStream(raw, self.algorithm)
            yield stream
        self.files[os.fspath(path)] = stream.digest()


class SizesOnlyWriter(HashingFileSystemWriter):
    """titan-ckpt's DCP writer with the hashing taken out: integrity off, all else equal."""

    def _wrap_fs(self, checksum: str) -> None:
        self.fs = _SizesOnly(self.fs, "sha256")


class NoIntegrityStorage(LocalStorage):
    """The local filesystem whose DCP writer hashes nothing (``SizesOnlyWriter``)."""

    def dcp_writer(self, path: str) -> SizesOnlyWriter:
        return SizesOnlyWriter(path)


def build_state(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A sharded Llama 3 and its AdamW after one step (so the optimizer state exists)."""
    from torch.distributed.fsdp import fully_shard

    from titan_models.llama3 import Llama3, Llama3Args

    torch.manual_seed(0)
    model_args = Llama3Args(
        dim=args.llama_dim, n_layers=args.llama_layers, n_heads=8, vocab_size=16384,
        max_seq_len=128, rope_scaling=None,
    )  # fmt: skip
    model = Llama3(model_args)
    model.init_weights()
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward_backward(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def forward_backward(model: torch.nn.Module) -> None:
    """One forward and backward on 1 x 128 tokens (gradients dropped afterwards)."""
    tokens = torch.randint(0, model.args.vocab_size, (1, 128))
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for p in model.parameters():
        p.grad = None


class Targets:
    """The managers over one state and the timed measures (every rank runs each)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.dir = args.dir
        self.checksum = args.checksum
        self.rank = dist.get_rank()
        self.model, self.opt = build_state(args)
        self.optimizer = OptimizerState(self.model, self.opt)
        self.on = self._manager("on", "disabled")
        self.off = self._manager("off", "disabled", storage=NoIntegrityStorage())
        self.async_ = self._manager("async", "async")
        self.pinned = self._manager("pinned", "async_with_pinned_mem")

    def _manager(self, name: str, mode: str, **kwargs: Any) -> CheckpointManager:
        config = CheckpointConfig(
            enable=True, folder=os.path.join(self.dir, name), interval=1, keep_latest_k=0,
            async_mode=mode, checksum=self.checksum,
        )  # fmt: skip
        return CheckpointManager(
            config, model_parts=[self.model], states={"optimizer": self.optimizer}, **kwargs
        )

    def state_bytes(self) -> int:
        """Bytes of the whole state (model and optimizer), summed over the ranks."""
        state = {**self.on.model.state_dict(), **self.optimizer.state_dict()}
        local = sum(
            (v.to_local() if hasattr(v, "to_local") else v).nbytes
            for v in state.values()
            if isinstance(v, torch.Tensor)
        )
        total = torch.tensor([local])
        dist.all_reduce(total)
        return int(total)

    def plain_dcp(self, rep: int) -> None:
        state = {**self.on.model.state_dict(), "optimizer": self.optimizer}
        with gc_paused():  # as torchtitan's trainer saves: its automatic collection is off
            dcp.save(state, checkpoint_id=os.path.join(self.dir, "plain", f"step-{rep}"))

    def driven(self, manager: CheckpointManager, label: str, rep: int) -> dict[str, float]:
        """An async save as titan-train drives it: save(), the next step's forward and
        backward while the background copy runs (the whole state's for
        async_with_pinned_mem, the optimizer's for async), then ``maybe_wait_for_staging``
        before its optimizer step. Blocked: the time in save() and in that wait (slowest
        rank), and the time in save() alone; delayed: how much longer save +
        forward/backward + wait took than a forward/backward alone (measured just before),
        which also counts the copy slowing the step down."""
        alone = timed(lambda: forward_backward(self.model))
        dist.barrier()
        t0 = time.perf_counter()
        manager.save(rep, force=True)
        t1 = time.perf_counter()
        forward_backward(self.model)
        t2 = time.perf_counter()
        manager.maybe_wait_for_staging()
        t3 = time.perf_counter()
        seconds = torch.tensor([(t1 - t0) + (t3 - t2), (t3 - t0) - alone, t1 - t0])
        manager.wait()
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        return {
            f"{label} blocked": float(seconds[0]),
            f"{label} in save()": float(seconds[2]),
            f"{label} delayed": max(0.0, float(seconds[1])),
        }

    def save_measures(self) -> dict[str, Callable[[int], dict[str, float]]]:
        def one(key: str, fn: Callable[[], Any]) -> Callable[[int], dict[str, float]]:
            return lambda rep: {key: timed(lambda: fn(rep))}

        return {
            "plain": one("plain dcp.save", self.plain_dcp),
            "off": one("sync save, integrity off", lambda rep: self.off.save(rep, force=True)),
            "on": one("sync save, integrity on", lambda rep: self.on.save(rep, force=True)),
            "async": lambda rep: self.driven(self.async_, "async", rep),
            "pinned": lambda rep: self.driven(self.pinned, "pinned", rep),
        }

    def clean(self, step: int) -> None:
        """Delete step ``step`` of every kind (rank 0): one state per kind on storage."""
        dist.barrier()
        if self.rank == 0:
            for name in ("plain", "off", "async", "pinned", "on"):
                shutil.rmtree(os.path.join(self.dir, name, f"step-{step}"), ignore_errors=True)
        dist.barrier()

    def run(self, reps: int) -> dict[str, list[float]]:
        measures, out = self.save_measures(), {}
        for rep in range(-1, reps):  # rep -1: warm-up, not recorded
            order = list(measures) if rep % 2 == 0 else list(measures)[::-1]
            for name in order:
                for key, seconds in measures[name](rep + 1).items():
                    if rep >= 0:
                        out.setdefault(key, []).append(seconds)
            if rep < reps - 1:
                self.clean(rep + 1)
        loads = {
            "load, verify off": lambda: self.on.load(reps, verify_checksums=False),
            "load, verify on": lambda: self.on.load(reps, verify_checksums=True),
        }
        for rep in range(-1, reps):
            for key in sorted(loads, reverse=rep % 2 == 1):
                seconds = timed(loads[key])
                if rep >= 0:
                    out.setdefault(key, []).append(seconds)
        return out

    def close(self) -> None:
        for manager in (self.on, self.off, self.async_, self.pinned):
            manager.close()


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for the block (the manager pauses it around
    its DCP calls; torchtitan's trainer keeps it off between its periodic collections)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it (the slowest rank)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def report(
    args: argparse.Namespace, out: dict[str, list[float]], nbytes: int, load_before: float
) -> None:
    """The table of medians and spreads, then each target's ratio and verdict."""
    med = {k: statistics.median(v) for k, v in out.items()}
    world = dist.get_world_size()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, "
          f"{os.cpu_count()} CPUs, load average {load_before:.1f} before and "
          f"{os.getloadavg()[0]:.1f} after; torch "
          f"{torch.__version__}; {world} gloo ranks; writing to {args.dir}")  # fmt: skip
    print(f"state: Llama 3 dim {args.llama_dim} x {args.llama_layers} layers + AdamW, "
          f"{nbytes / 2**20:.0f} MiB; {args.reps} interleaved repetitions; checksum "
          f"{args.checksum} = {resolve_checksum(args.checksum)}")  # fmt: skip
    print(f"\n| measure | median s | min-max s |\n|---|---|---|")  # noqa: F541
    for key in (*SAVES, *LOADS):
        values = out[key]
        print(f"| {key} | {med[key]:.3f} | {min(values):.3f}-{max(values):.3f} |")

    def pair(a: str, b: str, pct: bool) -> str:  # a_i / b_i of each repetition: median (range)
        ratios = [x / y for x, y in zip(out[a], out[b], strict=True)]

        def shown(r: float) -> str:
            return f"{r:.1%}" if pct else f"{r:.2f}x"

        return f"{shown(statistics.median(ratios))} ({shown(min(ratios))}-{shown(max(ratios))})"

    rows = [
        ("sync save: integrity on / off", "sync save, integrity on", "sync save, integrity off",
         1.1, "<= 1.1x"),
        ("sync save with integrity / plain dcp.save (torchtitan)", "sync save, integrity on",
         "plain dcp.save", 1.0, "<= 1.0x"),
        ("async save: blocked / sync save with integrity", "async blocked",
         "sync save, integrity on", 0.1, "< 10%"),
        ("async save: in save() / sync save", "async in save()",
         "sync save, integrity on", 0.1, "< 10%"),
        ("async save: delayed / sync save", "async delayed",
         "sync save, integrity on", None, "(a measure)"),
        ("async_with_pinned_mem: blocked / sync save", "pinned blocked",
         "sync save, integrity on", 0.1, "< 10%"),
        ("async_with_pinned_mem: in save() / sync save", "pinned in save()",
         "sync save, integrity on", 0.1, "< 10%"),
        ("async_with_pinned_mem: delayed / sync save", "pinned delayed",
         "sync save, integrity on", None, "(a measure)"),
        ("load: verify on / off", "load, verify on", "load, verify off", 1.2, "<= 1.2x"),
    ]  # fmt: skip
    print("\n| target | ratio of medians | per repetition: median (min-max) | goal | met |")
    print("|---|---|---|---|---|")
    for name, a, b, limit, goal in rows:
        ratio = med[a] / med[b]
        pct = "%" in goal or limit is None
        shown = f"{ratio:.1%}" if pct else f"{ratio:.2f}x"
        if limit is None:  # not a target of the issue's: how much the save slowed the step
            met = "-"
        else:
            met = "yes" if (ratio < limit if pct else ratio <= limit) else "NO"
        print(f"| {name} | {shown} | {pair(a, b, pct)} | {goal} | {met} |")


def run_targets(args: argparse.Namespace) -> None:
    """Build the state, run the measures, print the tables on rank 0."""
    load_before = os.getloadavg()[0]
    targets = Targets(args)
    nbytes = targets.state_bytes()
    out = targets.run(args.reps)
    targets.close()
    if dist.get_rank() == 0:
        report(args, out, nbytes, load_before)


if __name__ == "__main__":  # the same as ckpt_save_load.py --targets (which starts the ranks)
    import runpy
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_save_load.py")
    sys.argv = [script, "--targets", *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")
