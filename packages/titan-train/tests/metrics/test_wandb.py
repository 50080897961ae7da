"""MetricsLogger with the real Weights & Biases package, offline: the scalars it logs are read
back from the run's own ``.wandb`` file, decoded with wandb's protobuf ``Record``. Skipped
when wandb (the ``wandb`` extra) is not installed."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from titan_train.metrics import MetricsConfig, MetricsLogger

BLOCK = 32 * 1024
"""The .wandb file is a LevelDB-format log: a 7-byte file header (":W&B", magic 0xBEE1, a
version byte), then 32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type:
1 whole record, 2 first, 3 middle, 4 last piece)."""


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, pieces = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def _history(path: Path) -> dict[int, dict[str, float]]:
    """The run's logged rows by step."""
    rows = {}
    for record in _records(path):
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows[row["_step"]] = row
    return rows


def test_offline_run_holds_the_logged_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's output capture alone
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "titan-test")

    config = MetricsConfig(
        log_freq=2, enable_wandb=True, enable_tensorboard=False, enable_jsonl=False, peak_flops=1e12
    )
    with MetricsLogger(config, dump_folder=tmp_path, flops_per_token=6e6, total_steps=4) as metrics:
        for step in range(1, 5):
            metrics.log(
                step=step, loss=10.0 - step, tokens=4096, step_seconds=0.5, grad_norm=2.0 * step
            )
        metrics.log_scalars(4, {"validation/loss": 1.5})

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's writer is a separate service process; on a loaded machine its last records can
    # reach the file a moment after finish() returned (seen with an empty history): wait for
    # the run's last row, for at most 30 s, before checking every row.
    deadline = time.monotonic() + 30
    while 4 not in (history := _history(run_file)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(history) == [1, 2, 4]  # the reporting steps: first, every 2nd, last
    assert [history[s]["loss"] for s in (1, 2, 4)] == [9.0, 8.0, 6.0]
    assert [history[s]["grad_norm"] for s in (1, 2, 4)] == [2.0, 4.0, 8.0]
    assert history[4]["validation/loss"] == 1.5
    assert history[2]["tps"] == pytest.approx(2 * 4096 / 1.0)  # two steps of 0.5 s
    assert history[2]["mfu_pct"] == pytest.approx(100 * 6e6 * 8192 / 1e12)
    assert {"tflops", "memory_gib", "data_pct", "step_s"} <= set(history[4])
