"""Fault tolerance with torchft: the ``[fault_tolerance]`` section's checks, and two replica
groups (each its own one-process ``titan-train`` run) coordinated by a real local lighthouse:
they see different data, step with the same averaged gradients, resume bit for bit, and
train like a plain two-rank data-parallel run of the same config; resumed as one group,
their data goes on exactly; one killed with SIGKILL and started again heals from the other's
live state and ends with its weights.

The tests needing torchft are skipped when the ``torchft`` extra is not installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from titan_dims import ParallelDims, ParallelismConfig
from titan_train.cli import main
from titan_train.config import JobConfig, parse_job_config
from titan_train.config.loader import ConfigError
from titan_train.fault_tolerance import (
    LIGHTHOUSE_ENV,
    FaultToleranceConfig,
    check_fault_tolerance,
    lighthouse_address,
)
from titan_train.preflight import check_seq_lens
from titan_train.trainer.validation import ValidationConfig

# torchft 0.2.0 logs through the deprecated Logger.warn; that is its business, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated")

PACKAGE = Path(__file__).resolve().parents[1]


def test_defaults_follow_torchtitan_and_are_off():
    config = parse_job_config([])
    assert config.fault_tolerance == FaultToleranceConfig()
    assert not config.fault_tolerance.enable
    assert config.fault_tolerance.process_group_timeout_ms == 10000
    assert (config.fault_tolerance.replica_id, config.fault_tolerance.group_size) == (0, 0)


def test_enable_without_torchft_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'titan-train\[torchft\]'"):
        FaultToleranceConfig(enable=True, group_size=2)
    FaultToleranceConfig(enable=False)  # off, torchft is not needed
    # ... and the extra the message names exists.
    project = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]
    assert any(r.startswith("torchft") for r in project["optional-dependencies"]["torchft"])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"group_size": 0}, "fault_tolerance.group_size=0 is not allowed"),
        ({"group_size": 2, "replica_id": 2}, "replica_id=2 is out of range"),
        ({"group_size": 2, "replica_id": -1}, "it must be 0 to 1"),
        ({"group_size": 2, "min_replica_size": 3}, "min_replica_size=3 is not allowed"),
        ({"group_size": 2, "min_replica_size": 0}, "it must be 1 to group_size=2"),
        ({"group_size": 2, "process_group_timeout_ms": 0}, "process_group_timeout_ms=0"),
        ({"group_size": 2, "bucket_cap_mb": -1}, "bucket_cap_mb=-1 is not allowed"),
    ],
)
def test_bad_values_are_one_clear_error(values, message):
    pytest.importorskip("torchft")
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        FaultToleranceConfig(enable=True, **values)


def test_pipeline_parallel_seed_checkpoints_and_a_missing_lighthouse_are_refused():
    pytest.importorskip("torchft")
    config = FaultToleranceConfig(enable=True, group_size=2)
    lighthouse = {LIGHTHOUSE_ENV: "http://h:1"}
    pipelined = ParallelDims.from_config(
        ParallelismConfig(pipeline_parallel_degree=2), 2, device_type="cpu"
    )
    with pytest.raises(ConfigError, match="pipeline_parallel_degree=2 cannot be combined"):
        check_fault_tolerance(config, pipelined, environ=lighthouse)
    plain = ParallelDims.from_config(ParallelismConfig(), 1, device_type="cpu")
    with pytest.raises(ConfigError, match="create_seed_checkpoint=true cannot be combined"):
        check_fault_tolerance(config, plain, create_seed_checkpoint=True, environ=lighthouse)
    with pytest.raises(ConfigError, match=f"set {LIGHTHOUSE_ENV}="):
        check_fault_tolerance(config, plain, environ={})
    check_fault_tolerance(config, plain, environ=lighthouse)
    check_fault_tolerance(FaultToleranceConfig(), pipelined, environ={})  # off: no checks
    assert lighthouse_address(config, {LIGHTHOUSE_ENV: "http://h:1"}) == "http://h:1"
    config.lighthouse = "http://other:2"  # the config key wins over the environment
    assert lighthouse_address(config, {LIGHTHOUSE_ENV: "http://h:1"}) == "http://other:2"


def test_command_without_a_lighthouse_exits_2_before_work(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.delenv(LIGHTHOUSE_ENV, raising=False)
    out = tmp_path / "out"
    args = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    assert main(["train", "--job.dump_folder", str(out), *args]) == 2
    assert f"set {LIGHTHOUSE_ENV}=" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("tp", "cp", "section", "seq_len", "allowed"),
    [
        (2, 2, "training", 100, "96 or 104"),
        (1, 2, "training", 6, "4 or 8"),
        (2, 1, "validation", 66, "64 or 68"),
        (2, 2, "validation", 4, "8"),
    ],
)
def test_seq_lens_must_divide_by_the_layouts_divisor(tp, cp, section, seq_len, allowed):
    dims = ParallelDims.from_config(
        ParallelismConfig(tensor_parallel_degree=tp, context_parallel_degree=cp),
        tp * cp,
        device_type="cpu",
    )
    config = JobConfig(validation=ValidationConfig(enable=True, seq_len=64))
    config.training.seq_len = 64
    getattr(config, section).seq_len = seq_len
    with pytest.raises(ConfigError) as error:
        check_seq_lens(config, dims)
    message = str(error.value)
    assert message.startswith(f"{section}.seq_len={seq_len} must be divisible by {2 * tp * cp}")
    assert f"e.g. {allowed}." in message
    getattr(config, section).seq_len = 8 * seq_len
    check_seq_lens(config, dims)  # a multiple passes
    config.validation = ValidationConfig(enable=False, seq_len=3)
    check_seq_lens(config, dims)  # a validation that does not run is not checked


# ------------------------------------------------------------------ two replica groups

STEPS = 4
TINY = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--metrics.log_freq", "1",
    "--optimizer.lr", "0.003",
    "--lr_scheduler.warmup_steps", "1",
    "--lr_scheduler.min_lr_factor", "1.0",  # a constant lr: every step moves the weights
    "--parallelize.param_dtype", "float32",
    "--metrics.no_enable_tensorboard",
    # Validation is not sharded over replica groups: equal numbers mean equal weights.
    "--validation.enable",
    "--validation.freq", str(STEPS),
    "--validation.steps", "1",
    "--validation.seq_len", "32",
    "--validation.local_batch_size", "2",
    "--checkpoint.interval", "2",
]  # fmt: skip
FT = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
FT += ["--fault_tolerance.min_replica_size", "2"]  # both groups take part in every step
REPLICA_ID = ["--fault_tolerance.replica_id"]


def _command(*args: str, nproc: int = 1) -> list[str]:
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    return [sys.executable, "-m", "titan_train.cli", "train", *launch, *TINY, *args]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (LIGHTHOUSE_ENV, "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(*commands: list[str], env: dict[str, str]) -> None:
    """Run ``commands`` side by side; all must succeed (the rest are stopped if one fails:
    a lone replica group would wait for its peer)."""
    processes = [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in commands
    ]
    outputs = {}
    try:
        for i, process in enumerate(processes):
            outputs[i], _ = process.communicate(timeout=300)
            if process.returncode != 0:
                break
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    for i, process in enumerate(processes):
        assert process.returncode == 0, f"{commands[i]} failed:\n{outputs.get(i, '')[-4000:]}"


def _records(path: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl as {key: {step: value}}."""
    out: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if isinstance(value, int | float) and key not in ("step", "time"):
                out.setdefault(key, {})[record["step"]] = value
    return out


def _replica_groups(folder: Path, *args: str) -> None:
    """Both replica groups, in one dump folder, under a fresh lighthouse."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        _run(
            *(
                _command("--job.dump_folder", str(folder), *args, *FT, *REPLICA_ID, str(replica))
                for replica in (0, 1)
            ),
            env=_env(**{LIGHTHOUSE_ENV: lighthouse.address()}),
        )
    finally:
        lighthouse.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A seed checkpoint; two replica groups under a lighthouse; the same two resumed from
    their step-2 checkpoints; a plain two-rank data-parallel run (replicated weights,
    gradients all-reduced: the same math). Fresh runs start from the seed."""
    pytest.importorskip("torchft")
    root = tmp_path_factory.mktemp("ft")
    seed = root / "seed"
    env = _env()
    _run(_command("--job.dump_folder", str(seed), "--checkpoint.create_seed_checkpoint"), env=env)
    start = ("--checkpoint.initial_load_path", str(seed / "checkpoint"))

    _replica_groups(root / "ft", *start)

    # Resume both groups from step 2: the shared checkpoint and each group's own data.
    resumed = root / "ft-resumed"
    shutil.copytree(root / "ft", resumed)
    for last in resumed.glob(f"checkpoint/**/step-{STEPS}"):
        shutil.rmtree(last)
    for metrics in resumed.glob("ft-replica-*/metrics.jsonl"):
        metrics.unlink()
    _replica_groups(resumed, *start)

    plain = ("--parallelism.data_parallel_replicate_degree", "2")
    plain += ("--parallelism.data_parallel_shard_degree", "1")
    _run(_command("--job.dump_folder", str(root / "dp"), *start, *plain, nproc=2), env=env)
    return root


def test_both_replica_groups_finish_and_checkpoint_once(runs):
    checkpoint = runs / "ft" / "checkpoint"
    assert (checkpoint / f"step-{STEPS}" / ".metadata").is_file()  # the shared checkpoint
    for replica in (0, 1):
        # Each group saves its own data position, and reports in its own folder.
        assert (checkpoint / f"ft-replica-{replica}" / f"step-{STEPS}" / ".metadata").is_file()
        metrics = _records(runs / "ft" / f"ft-replica-{replica}" / "metrics.jsonl")
        assert sorted(metrics["loss"]) == list(range(1, STEPS + 1))
    assert not (runs / "ft" / "metrics.jsonl").exists()


def test_replica_groups_step_with_the_same_averaged_gradients(runs):
    first, second = (_records(runs / "ft" / f"ft-replica-{r}" / "metrics.jsonl") for r in (0, 1))
    # Different data shards: the same starting weights give different losses at step 1.
    assert first["loss"][1] != second["loss"][1]
    # The same averaged gradient every step (its norm, bit for bit) ...
    assert first["grad_norm"] == second["grad_norm"]
    # ... so the same weights at the end: the same (unsharded) validation batch gives the
    # same loss, bit for bit.
    assert first["validation/loss"][STEPS] == second["validation/loss"][STEPS]


def test_replica_groups_train_like_two_data_parallel_ranks(runs):
    replicas = [_records(runs / "ft" / f"ft-replica-{r}" / "metrics.jsonl") for r in (0, 1)]
    plain = _records(runs / "dp" / "metrics.jsonl")
    # Replica group r sees data-parallel rank r's shard; the plain run logs the mean loss.
    mean_loss = [(replicas[0]["loss"][s] + replicas[1]["loss"][s]) / 2 for s in plain["loss"]]
    assert sorted(plain["loss"]) == list(range(1, STEPS + 1))
    assert mean_loss == pytest.approx(list(plain["loss"].values()), rel=1e-6)
    # The same averaged gradient at every step (its norm); the loss of step s + 1 shows
    # that the weights after step s are the same too.
    assert list(replicas[0]["grad_norm"].values()) == pytest.approx(
        list(plain["grad_norm"].values()), rel=1e-6
    )


def test_resumed_replica_groups_continue_bit_for_bit(runs):
    for replica in (0, 1):
        original = _records(runs / "ft" / f"ft-replica-{replica}" / "metrics.jsonl")
        resumed = _records(runs / "ft-resumed" / f"ft-replica-{replica}" / "metrics.jsonl")
        # Steps 3-4 again, from the shared weights and this group's own data position.
        assert sorted(resumed["loss"]) == [3, 4]
        for key in ("loss", "grad_norm"):
            assert resumed[key] == {s: original[key][s] for s in (3, 4)}, (replica, key)


def test_a_new_replica_group_count_reshards_the_per_group_data_state(runs):
    """Two replica groups saved step 2, each with the data shards it read; one group resumes
    it alone (group_size 1) and reads on exactly: after steps 3-4 its data state is that of
    one uninterrupted stream after the same windows (2 steps x 2 groups x 2, then 2 x 2)."""
    from torchft._torchft import LighthouseServer

    from titan_ckpt.formats.dcp import DcpSource
    from titan_train.data import build_dataloader
    from titan_train.tokenizer import load_tokenizer

    alone = runs / "ft-alone"
    shutil.copytree(runs / "ft", alone)
    for step in alone.glob(f"checkpoint/**/step-{STEPS}"):
        shutil.rmtree(step)
    shutil.rmtree(alone / "ft-replica-0")
    one = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "1"]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:
        command = _command("--job.dump_folder", str(alone), *one, *REPLICA_ID, "0")
        _run(command, env=_env(**{LIGHTHOUSE_ENV: lighthouse.address()}))
    finally:
        lighthouse.shutdown()
    assert sorted(_records(alone / "ft-replica-0" / "metrics.jsonl")["loss"]) == [3, 4]

    config = parse_job_config(TINY)
    training = config.training
    data = training.data_config(
        seq_len=training.seq_len,
        local_batch_size=training.local_batch_size,
        infinite=True,
        num_shards=training.data_shards,
    )
    stream = build_dataloader(data, load_tokenizer(config.model.tokenizer_path))
    batches = iter(stream)
    for _ in range(2 * 2 + 2):  # local batches of 2 windows: 8 windows, then 4
        next(batches)
    expected = stream.state_dict()
    assert expected["num_shards"] > 2  # each group held only half the shards
    saved = DcpSource(str(alone / "checkpoint" / "ft-replica-0" / f"step-{STEPS}"))
    keys = [k for k in saved.entries if k.startswith("dataloader.")]
    stored = saved.read(keys)
    assert stored["dataloader.windows"] == expected["windows"] == 12
    for shard, position in expected["shards"].items():
        for key, value in position.items():
            assert stored[f"dataloader.shards.{shard}.{key}"] == value, (shard, key)


KILL_STEPS = 80  # the survivor trains alone while the killed group restarts (seconds)


def _last_step(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


@pytest.mark.slow
def test_a_killed_replica_group_heals_from_its_live_peer_and_rejoins(tmp_path):
    """Group 1 is killed (SIGKILL) at step 10 and started again with the same command while
    group 0 trains on alone: the restarted group loads the newest shared checkpoint from
    disk, then torchft heals it from group 0's live state (its checkpoint transport), a
    later step than the disk holds; both end with the same weights."""
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    folder = tmp_path / "ft"
    steps = [a if a != str(STEPS) else str(KILL_STEPS) for a in TINY]
    args = ["--job.dump_folder", str(folder), "--checkpoint.interval", "5"]
    args += ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    # A step goes on with the groups that are there (group 0 alone while 1 is down).
    args += ["--fault_tolerance.min_replica_size", "1"]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=1000)
    env = _env(**{LIGHTHOUSE_ENV: lighthouse.address()})

    def start(replica: int, log: str) -> subprocess.Popen:
        command = [*_command(*args, *REPLICA_ID, str(replica)), *steps]
        out = (tmp_path / log).open("w")
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    groups = [start(0, "group-0.log"), start(1, "group-1.log")]
    try:
        killed_metrics = folder / "ft-replica-1" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while _last_step(killed_metrics) < 10:
            assert groups[1].poll() is None
            assert time.monotonic() < deadline
            time.sleep(0.02)
        groups[1].send_signal(signal.SIGKILL)
        killed_at = _last_step(killed_metrics)
        assert groups[1].wait() == -signal.SIGKILL
        groups[1] = start(1, "group-1-restarted.log")
        for group in groups:
            group.wait(timeout=180)
    finally:
        for group in groups:
            if group.poll() is None:
                group.kill()
                group.wait()
        lighthouse.shutdown()
    logs = {
        name: (tmp_path / f"{name}.log").read_text() for name in ("group-0", "group-1-restarted")
    }
    assert [g.returncode for g in groups] == [0, 0], logs["group-1-restarted"][-3000:]

    survivor, healed = (_records(folder / f"ft-replica-{r}" / "metrics.jsonl") for r in (0, 1))
    # The survivor never stopped: every step logged, once.
    assert sorted(survivor["loss"]) == list(range(1, KILL_STEPS + 1))
    # The restarted group read the newest shared step N from disk, then healed from the
    # live peer at a later step M > N (torchft's step: committed steps).
    restarted = logs["group-1-restarted"]
    loaded = int(re.search(r"Loaded \S+/step-(\d+) \(model", restarted).group(1))
    heal = re.search(
        r"healing is required step=0, max_step=(\d+), recover_src_replica_rank=0", restarted
    )
    assert heal is not None
    assert int(heal.group(1)) > loaded
    # It did not replay from step N: it rejoined at the peer's step, logging every step on.
    rejoined = sorted(s for s in healed["loss"] if s > killed_at)
    assert rejoined[0] > loaded + 1
    assert rejoined == list(range(rejoined[0], KILL_STEPS + 1))
    # The same weights as the peer at the end: the same unsharded validation batch gives
    # the same loss, bit for bit.
    assert survivor["validation/loss"][KILL_STEPS] == healed["validation/loss"][KILL_STEPS]
    if loaded > killed_at:  # down at step N: its data goes on from its own older state
        assert f"Replica group 1 has no committed dataloader state at step {loaded}" in restarted


@pytest.mark.slow
def test_replica_groups_nudge_expert_biases_by_the_same_total_counts(tmp_path):
    """DeepSeek-V3 (MoE) as two replica groups, each on its own data: the token counts are
    summed over both groups before each commit, so both log the same expert load (shares of
    the summed counts) and nudge their biases alike; before, each group read only its own
    tokens and their routing drifted apart."""
    pytest.importorskip("torchft")
    moe = ["--model.name", "deepseek_v3", "--training.steps", "2", "--validation.no_enable"]
    moe += ["--checkpoint.no_enable"]
    _replica_groups(tmp_path, *moe)
    first, second = (_records(tmp_path / f"ft-replica-{r}" / "metrics.jsonl") for r in (0, 1))
    assert first["loss"][1] != second["loss"][1]  # different tokens
    load = {k: v for k, v in first.items() if k.startswith("moe/")}
    assert load
    assert load == {k: second[k] for k in load}
