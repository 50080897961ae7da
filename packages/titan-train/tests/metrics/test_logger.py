"""MetricsLogger: scalars read back from TensorBoard event files with tensorboard's own
EventAccumulator, JSONL records, the console line, window averaging, per-rank files and
the Weights & Biases import guard. Peak FLOP/s is set in the config so the numbers are exact."""

from __future__ import annotations

import json
import logging
import re
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan_train.metrics import MetricsConfig, MetricsError, MetricsLogger, device_memory
from titan_train.metrics import logger as logger_module

PEAK = 1e12  # FLOP/s of the pretend device
FLOPS_PER_TOKEN = 6e6


def _run(tmp_path, config=None, rank=0, steps=5):
    config = config or MetricsConfig(log_freq=2, peak_flops=PEAK)
    records = []
    with MetricsLogger(config, dump_folder=tmp_path, rank=rank, flops_per_token=FLOPS_PER_TOKEN,
                       total_steps=steps) as metrics:  # fmt: skip
        for step in range(1, steps + 1):
            record = metrics.log(
                step=step,
                loss=10.0 - step,
                tokens=4096,
                step_seconds=0.5 if step % 2 else 1.5,  # odd steps 0.5 s, even 1.5 s
                data_seconds=0.1,
                grad_norm=2.0 * step,
                lr=1e-3,
            )
            records.append(record)
    return records


def _scalars(folder):
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_files_hold_the_scalars(tmp_path):
    _run(tmp_path)
    scalars = _scalars(tmp_path / "tb")
    assert set(scalars) >= {"loss", "grad_norm", "lr", "tps", "tflops", "mfu_pct", "memory_gib",
                            "data_pct", "step_s", "eta_s"}  # fmt: skip
    assert scalars["loss"] == [(1, 9.0), (2, 8.0), (4, 6.0), (5, 5.0)]  # first, every 2nd, last
    assert scalars["grad_norm"] == [(1, 2.0), (2, 4.0), (4, 8.0), (5, 10.0)]
    # Step 1 alone: 4096 tokens in 0.5 s; steps 3+4 together: 8192 tokens in 2.0 s.
    # (TensorBoard stores float32.)
    assert scalars["tps"] == [(1, 8192.0), (2, pytest.approx(4096 / 1.5)), (4, 4096.0), (5, 8192.0)]
    tps4 = 4096.0
    assert scalars["mfu_pct"][2] == (4, pytest.approx(100 * FLOPS_PER_TOKEN * tps4 / PEAK))
    assert scalars["tflops"][2] == (4, pytest.approx(FLOPS_PER_TOKEN * tps4 / 1e12))
    assert scalars["data_pct"][2] == (4, pytest.approx(100 * 0.2 / 2.0))
    assert scalars["eta_s"] == [(1, 2.0), (2, 4.5), (4, 1.0), (5, 0.0)]


def test_jsonl_records_and_return_values(tmp_path):
    records = _run(tmp_path)
    assert [r is None for r in records] == [False, False, True, False, False]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 4, 5]
    assert lines[2]["tps"] == 4096.0
    assert lines[2]["loss"] == 6.0
    assert lines[2]["mfu_pct"] == pytest.approx(2.4576)  # 6e6 * 4096 / 1e12 * 100
    assert {k: v for k, v in lines[2].items() if k != "time"} == records[3]


def test_console_line(tmp_path, caplog):
    config = MetricsConfig(log_freq=2, peak_flops=PEAK, disable_color_printing=True,
                           enable_tensorboard=False, enable_jsonl=False)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="titan_train.metrics"):
        _run(tmp_path, config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step")]
    assert len(lines) == 4
    assert lines[2].startswith(
        "step     4  loss   6.0000  grad_norm  8.0000  lr 1.00e-03  tps 4,096  tflops 0.0246  "
        "mfu 2.5%  memory "
    )
    assert lines[2].endswith("GiB (RSS)  data 10.0%  eta 0:00:01")
    assert "\033[" not in lines[2]
    assert not (tmp_path / "tb").exists()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_slow_run_reports_progress_between_reports(tmp_path, caplog):
    """Past ``heartbeat_s`` without a console line, a short progress line; the full report
    (console, JSONL) keeps its ``log_freq`` schedule."""
    config = MetricsConfig(log_freq=10, disable_color_printing=True, enable_tensorboard=False)
    slow = MetricsLogger(config, dump_folder=tmp_path, total_steps=12, heartbeat_s=0)
    with caplog.at_level(logging.INFO, logger="titan_train.metrics"), slow as metrics:
        for step in range(1, 13):
            metrics.log(step=step, loss=1.0, tokens=8, step_seconds=2.0)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 12
    assert lines[1] == "step     2/12  2.0 s/step  (full report at step 10)"
    assert lines[10] == "step    11/12  2.0 s/step  (full report at step 12)"
    assert [line.split()[1] for line in lines if "loss" in line] == ["1", "10", "12"]
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [1, 10, 12]


def test_console_eta_of_a_run_longer_than_a_timedelta(tmp_path, caplog):
    config = MetricsConfig(log_freq=1, disable_color_printing=True, enable_tensorboard=False,
                           enable_jsonl=False)  # fmt: skip
    long_run = MetricsLogger(config, dump_folder=tmp_path, total_steps=2**63 - 1)
    with caplog.at_level(logging.INFO, logger="titan_train.metrics"), long_run as metrics:
        metrics.log(step=1, loss=1.0, tokens=8, step_seconds=0.5, data_seconds=0.0)
    assert caplog.records[0].getMessage().endswith("eta 5.34e+13 days")


def test_colored_console_on_a_terminal(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logger_module, "_COLOR_TERMINAL", True)
    with caplog.at_level(logging.INFO, logger="titan_train.metrics"):
        _run(tmp_path, steps=1)
    assert "\033[32mloss   9.0000\033[0m" in caplog.records[-1].getMessage()


def test_plain_console_when_piped(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logger_module, "_COLOR_TERMINAL", False)
    with caplog.at_level(logging.INFO, logger="titan_train.metrics"):
        _run(tmp_path, steps=1)
    assert "\033[" not in caplog.records[-1].getMessage()


def test_only_rank0_writes_unless_all_ranks(tmp_path):
    _run(tmp_path / "a", rank=1)
    assert not (tmp_path / "a").exists()
    config = MetricsConfig(log_freq=2, peak_flops=PEAK, save_for_all_ranks=True)
    _run(tmp_path / "b", config, rank=1)
    assert (tmp_path / "b" / "metrics_rank1.jsonl").is_file()
    assert _scalars(tmp_path / "b" / "tb" / "rank_1")["loss"][0] == (1, 9.0)


def test_log_scalars_for_validation(tmp_path):
    with MetricsLogger(MetricsConfig(), dump_folder=tmp_path) as metrics:
        metrics.log_scalars(20, {"validation/loss": 3.5})
    assert _scalars(tmp_path / "tb")["validation/loss"] == [(20, 3.5)]


def test_no_flops_per_token_means_no_mfu(tmp_path):
    with MetricsLogger(MetricsConfig(enable_tensorboard=False), dump_folder=tmp_path) as m:
        record = m.log(step=1, loss=1.0, tokens=10, step_seconds=1.0)
    assert m.peak_flops is None
    assert "mfu_pct" not in record
    assert "tflops" not in record
    assert record["tps"] == 10.0


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    config = MetricsConfig(enable_wandb=True, enable_tensorboard=False, enable_jsonl=False)
    with pytest.raises(MetricsError, match=r"enable_wandb=True needs the wandb package: pip"):
        MetricsLogger(config, dump_folder=tmp_path)


def test_memory_of_a_cpu_process():
    numbers, kind = device_memory("cpu")
    gib = numbers["memory_gib"]
    assert kind == "RSS"
    assert 0.05 < gib < 64  # torch alone is ~0.2 GiB resident


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_freq": 0}, r"metrics.log_freq=0 is not allowed; it must be a whole number >= 1"),
        (
            {"peak_flops": -1.0},
            r"metrics.peak_flops=-1.0 is not allowed; it must be a finite number >= 0 \(FLOP/s",
        ),
        ({"save_tb_folder": ""}, r"metrics.save_tb_folder='' is not allowed"),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(MetricsError, match=match):
        MetricsConfig(**kwargs)


def test_mfu_never_exceeds_100_percent(tmp_path, caplog):
    """A peak below what training reaches (a CPU probe slowed by other work, a wrong
    metrics.peak_flops) is raised to the reached rate, with one warning in the run."""
    low = FLOPS_PER_TOKEN * 4096 / 2  # the rate of a 4,096-token step taking 2 s
    config = MetricsConfig(log_freq=1, peak_flops=low, enable_tensorboard=False)
    with (
        caplog.at_level(logging.INFO, logger=logger_module.__name__),
        MetricsLogger(config, dump_folder=tmp_path, flops_per_token=FLOPS_PER_TOKEN) as m,
    ):
        slow = m.log(step=1, loss=1.0, tokens=4096, step_seconds=4.0)
        fast = m.log(step=2, loss=1.0, tokens=4096, step_seconds=1.0)  # twice the peak
        again = m.log(step=3, loss=1.0, tokens=4096, step_seconds=2.0)
        faster = m.log(step=4, loss=1.0, tokens=4096, step_seconds=0.5)  # a second raise
    assert slow["mfu_pct"] == pytest.approx(50.0)
    assert fast["mfu_pct"] == pytest.approx(100.0)
    assert again["mfu_pct"] == pytest.approx(50.0)  # against the raised peak
    assert faster["mfu_pct"] == pytest.approx(100.0)
    assert m.peak_flops == pytest.approx(4 * low)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "metrics.peak_flops" in warnings[0].getMessage()
    assert "(metrics.peak_flops)" in caplog.records[0].getMessage()  # the peak's source


def test_the_cpu_peak_is_measured_and_said_so(tmp_path, caplog):
    with (
        caplog.at_level(logging.INFO, logger=logger_module.__name__),
        MetricsLogger(MetricsConfig(enable_tensorboard=False), dump_folder=tmp_path,
                      flops_per_token=FLOPS_PER_TOKEN),
    ):  # fmt: skip
        pass
    assert "measured" in caplog.text


# torchtitan 6204cdff9's tags (components/metrics.py) that titan has values for.
TORCHTITAN_TAGS = {
    "loss_metrics/global_avg_loss", "grad_norm", "throughput(tps)", "tflops", "mfu(%)",
    "time_metrics/end_to_end(s)", "time_metrics/data_loading(s)",
    "time_metrics/data_loading(%)", "memory/max_reserved(GiB)",
}  # fmt: skip


def test_torchtitan_tensorboard_names_and_layout(tmp_path):
    config = MetricsConfig(log_freq=2, peak_flops=PEAK, tensorboard_names="torchtitan")
    _run(tmp_path, config)
    (run,) = (tmp_path / "tb").iterdir()  # torchtitan's one folder per run: its start minute
    assert re.fullmatch(r"\d{8}-\d{4}", run.name)
    scalars = _scalars(run)
    assert set(scalars) >= TORCHTITAN_TAGS
    assert not {"loss", "tps", "mfu_pct", "step_s", "data_pct", "memory_gib"} & set(scalars)
    assert scalars["loss_metrics/global_avg_loss"] == [(1, 9.0), (2, 8.0), (4, 6.0), (5, 5.0)]
    assert scalars["throughput(tps)"][2] == (4, 4096.0)
    assert scalars["time_metrics/data_loading(s)"][2] == (4, pytest.approx(0.1))  # per step
    assert "lr" in scalars  # no torchtitan name: titan's


def test_tensorboard_names_are_checked():
    with pytest.raises(MetricsError, match=r"metrics.tensorboard_names='tt'.*'torchtitan'"):
        MetricsConfig(tensorboard_names="tt")
