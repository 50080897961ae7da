"""Semi-synchronous fault tolerance (``titan_train.fault_tolerance.semi_sync``): the keys'
checks, the model's fragments, and real runs under a real torchft lighthouse:

- two replica groups (threads in this process, each its own torchft ``Manager``) train a
  tiny Llama with Streaming DiLoCo in two fragments: each fragment is equal across the
  groups right after its own sync step and only then, and the synced weights are what the
  outer Nesterov SGD gives from the averaged pseudo-gradient;
- two ``titan-train`` replica groups (one process each) with LocalSGD every 2 steps: their
  weights (the validation loss of the same unsharded batch) are equal after steps 2 and 4
  and differ after steps 1 and 3, and losses decrease; DiLoCo with ``outer_lr = 1`` and no
  momentum trains exactly like LocalSGD (the stated equivalence);
- a group started late (as a killed group restarts) heals from its peer at its first sync
  and trains in step with it from then on.

The tests needing torchft are skipped when the ``torchft`` extra is not installed.
"""

from __future__ import annotations

import copy
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.nn import functional

from titan_models.llama3 import Llama3, Llama3Args
from titan_optim import OptimizerConfig, build_optimizers
from titan_train.cli import main
from titan_train.config import parse_job_config
from titan_train.config.loader import ConfigError
from titan_train.fault_tolerance import LIGHTHOUSE_ENV, FaultToleranceConfig, ReplicaGroup
from titan_train.fault_tolerance.semi_sync import (
    check_semi_sync,
    model_fragments,
    semi_sync_training,
)

pytestmark = pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated")


def _ft_helpers():
    """test_fault_tolerance.py's runners of two ``titan-train`` replica groups."""
    path = Path(__file__).with_name("test_fault_tolerance.py")
    spec = importlib.util.spec_from_file_location("_titan_ft_helpers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults_are_torchtitans_and_off():
    ft = parse_job_config([]).fault_tolerance
    assert ft.semi_sync_method is None
    assert (ft.sync_steps, ft.num_fragments, ft.fragment_sync_delay) == (5, 1, 0)
    assert (ft.should_quantize, ft.fragment_update_alpha) == (False, 0.0)
    assert (ft.outer_lr, ft.outer_momentum, ft.outer_nesterov) == (0.7, 0.9, True)


def test_a_torchtitan_toml_carries_over(tmp_path):
    pytest.importorskip("torchft")
    toml = tmp_path / "tt.toml"
    toml.write_text(
        "[fault_tolerance]\nenable = true\ngroup_size = 2\nsemi_sync_method = 'diloco'\n"
        "sync_steps = 6\nnum_fragments = 3\nfragment_sync_delay = 1\n"
        "fragment_update_alpha = 0.5\nshould_quantize = false\n"
    )
    ft = parse_job_config(["--job.config_file", str(toml)]).fault_tolerance
    assert (ft.semi_sync_method, ft.sync_steps, ft.num_fragments) == ("diloco", 6, 3)
    assert (ft.fragment_sync_delay, ft.fragment_update_alpha) == (1, 0.5)


@pytest.mark.parametrize("enable", ["false", "true"])
def test_an_empty_method_in_a_toml_means_unset(tmp_path, enable):
    # torchtitan's TOMLs write "" for "no semi-sync"; it must not stop a run here.
    if enable == "true":
        pytest.importorskip("torchft")  # fault tolerance on needs it installed
    toml = tmp_path / "tt.toml"
    toml.write_text(
        f"[fault_tolerance]\nenable = {enable}\ngroup_size = 2\nsemi_sync_method = ''\n"
    )
    assert (
        parse_job_config(["--job.config_file", str(toml)]).fault_tolerance.semi_sync_method is None
    )
    cli = ["--fault_tolerance.semi_sync_method", ""]
    assert parse_job_config(cli).fault_tolerance.semi_sync_method is None


DILOCO = {"enable": True, "group_size": 2, "semi_sync_method": "diloco"}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({**DILOCO, "semi_sync_method": "sgd"}, "must be one of local_sgd, diloco"),
        ({**DILOCO, "sync_steps": 0}, "fault_tolerance.sync_steps=0"),
        ({**DILOCO, "sync_steps": 3, "num_fragments": 2}, "sync_steps=3 must be a multiple"),
        ({**DILOCO, "sync_steps": 4, "num_fragments": 2, "fragment_sync_delay": 2}, "below"),
        ({**DILOCO, "semi_sync_method": "local_sgd", "num_fragments": 2}, "diloco' only"),
        ({"semi_sync_method": "local_sgd"}, "needs fault_tolerance.enable=true"),
        ({**DILOCO, "outer_momentum": 1.0}, "fault_tolerance.outer_momentum=1.0"),
        ({**DILOCO, "fragment_update_alpha": 2.0}, "fragment_update_alpha=2.0"),
        ({**DILOCO, "outer_lr": -1.0}, "fault_tolerance.outer_lr=-1.0"),
    ],
)
def test_bad_values_are_one_clear_error(values, message):
    pytest.importorskip("torchft")
    with pytest.raises(ConfigError, match=message):
        FaultToleranceConfig(**values)


def test_fragments_must_divide_the_blocks_and_quantizing_needs_cuda():
    pytest.importorskip("torchft")
    config = FaultToleranceConfig(**DILOCO, sync_steps=4, num_fragments=4)
    with pytest.raises(ConfigError, match=r"does not divide the model's 6 blocks.*1, 2, 3, 6"):
        check_semi_sync(config, n_layers=6, device_type="cpu")
    check_semi_sync(config, n_layers=8, device_type="cpu")
    config = FaultToleranceConfig(**DILOCO, should_quantize=True)
    with pytest.raises(ConfigError, match="should_quantize=true needs CUDA"):
        check_semi_sync(config, n_layers=2, device_type="cpu")
    check_semi_sync(config, n_layers=2, device_type="cuda")


def test_command_with_bad_fragments_exits_2_before_work(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.setenv(LIGHTHOUSE_ENV, "http://localhost:1")  # never reached
    out = tmp_path / "out"
    args = ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    args += ["--fault_tolerance.semi_sync_method", "diloco", "--model.flavor", "debugmodel"]
    args += ["--fault_tolerance.sync_steps", "4", "--fault_tolerance.num_fragments", "4"]
    assert main(["train", "--job.dump_folder", str(out), *args]) == 2
    assert "num_fragments=4 does not divide the model's 6 blocks" in capsys.readouterr().err
    assert not out.exists()
    args[4] = "adam"  # an unknown method: the command line parser's own exit 2
    with pytest.raises(SystemExit) as exited:
        main(["train", "--job.dump_folder", str(out), *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err  # wrapped to the terminal's width
    assert all(word in err for word in ("'adam'", "semi_sync_method", "'local_sgd'", "'diloco'"))
    assert not out.exists()


def _tiny_llama() -> Llama3:
    torch.manual_seed(0)
    model = Llama3(Llama3Args(dim=16, n_layers=4, n_heads=2, vocab_size=32, max_seq_len=8))
    model.init_weights()
    return model


def test_fragments_are_whole_blocks_with_the_ends_attached():
    model = _tiny_llama()
    first, second = model_fragments(model, 2)
    names = [{n for n, _ in f.named_parameters()} for f in (first, second)]
    assert {n.split(".")[0] for n in names[0]} == {"tok_embeddings", "layers"}
    assert {n.split(".")[1] for n in names[0] if n.startswith("layers.")} == {"0", "1"}
    assert {n.split(".")[1] for n in names[1] if n.startswith("layers.")} == {"2", "3"}
    assert {"norm.weight", "output.weight"} <= names[1]
    # Together they are the model's parameters, each once, the same tensors.
    fragment_params = [id(p) for f in (first, second) for p in f.parameters()]
    assert sorted(fragment_params) == sorted(id(p) for p in model.parameters())
    assert model_fragments(model, 1) == [model]


# ------------------------------------------------- DiLoCo fragments, two groups in threads

SYNC_STEPS, FRAGMENTS, STEPS = 4, 2, 4
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_group(replica: int, model: Llama3, batches: list, lighthouse: str) -> dict:
    config = FaultToleranceConfig(
        **DILOCO,
        replica_id=replica,
        min_replica_size=2,
        lighthouse=lighthouse,
        sync_steps=SYNC_STEPS,
        num_fragments=FRAGMENTS,
        outer_lr=OUTER_LR,
        outer_momentum=OUTER_MOMENTUM,
    )
    replicas = ReplicaGroup(config, device=torch.device("cpu"), rank=0, world_size=1)
    optimizers = build_optimizers(model, OptimizerConfig(lr=0.01, implementation="for-loop"))
    local, synced = [], []  # the weights after each step, before and after the sync hook
    # Registered before the semi-sync context's hook, so it runs first: the local weights.
    optimizers.register_step_post_hook(lambda _: local.append(_params(model)))
    try:
        with semi_sync_training(config, replicas, [model], optimizers):
            for inputs, labels in batches:
                optimizers.zero_grad()
                functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).backward()
                optimizers.step()
                synced.append(_params(model))
    finally:
        replicas.close()
    return {"local": local, "synced": synced}


@pytest.fixture(scope="module")
def diloco_groups():
    pytest.importorskip("torchft")
    from torchft._torchft import LighthouseServer

    model = _tiny_llama()
    initial = _params(model)
    generator = torch.Generator().manual_seed(1)
    batches = [
        [(torch.randint(0, 32, (2, 8), generator=generator),) * 2 for _ in range(STEPS)]
        for _ in range(2)
    ]
    batches = [[(x, torch.roll(x, -1, dims=1)) for x, _ in group] for group in batches]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(_train_group, r, copy.deepcopy(model), batches[r], lighthouse.address())
                for r in (0, 1)
            ]
            groups = [f.result(timeout=120) for f in futures]
    finally:
        lighthouse.shutdown()
    fragments = [{n for n, _ in f.named_parameters()} for f in model_fragments(model, FRAGMENTS)]
    return initial, groups, fragments


def _equal(groups: list[dict], step: int, names: set[str]) -> bool:
    a, b = (g["synced"][step - 1] for g in groups)
    return all(torch.equal(a[n], b[n]) for n in names)


def test_each_fragment_syncs_at_its_own_steps(diloco_groups):
    _, groups, (first, second) = diloco_groups
    # One fragment syncs every sync_steps / num_fragments = 2 steps, in turn: the first
    # after step 2, the second after step 4; between, each group trains its own copy.
    assert [_equal(groups, s, first) for s in range(1, STEPS + 1)] == [False, True, False, False]
    assert [_equal(groups, s, second) for s in range(1, STEPS + 1)] == [False, False, False, True]


def test_the_outer_nesterov_step_moves_the_synced_weights(diloco_groups):
    initial, groups, (first, second) = diloco_groups
    # Each fragment's first sync: pseudo-gradient g = initial - mean of the groups' local
    # weights; Nesterov SGD's first step (momentum buffer = g) is initial - lr (1 + m) g.
    for step, names in ((2, first), (4, second)):
        for name in names:
            mean = (groups[0]["local"][step - 1][name] + groups[1]["local"][step - 1][name]) / 2
            expected = initial[name] - OUTER_LR * (1 + OUTER_MOMENTUM) * (initial[name] - mean)
            torch.testing.assert_close(groups[0]["synced"][step - 1][name], expected)
            # Not the plain average: the outer optimizer is what moved them.
            assert not torch.allclose(groups[0]["synced"][step - 1][name], mean)


# --------------------------------------------------- two titan-train replica groups (CLI)

SEMI_STEPS = ["--validation.freq", "1", "--checkpoint.no-enable"]
LOCAL_SGD = ["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "2"]
DILOCO_AS_AVERAGE = ["--fault_tolerance.semi_sync_method", "diloco"]
DILOCO_AS_AVERAGE += ["--fault_tolerance.sync_steps", "2", "--fault_tolerance.outer_lr", "1"]
DILOCO_AS_AVERAGE += ["--fault_tolerance.outer_momentum", "0"]


@pytest.fixture(scope="module")
def semi_sync_runs(tmp_path_factory):
    """Two one-process replica groups under a lighthouse, 4 steps: LocalSGD every 2 steps,
    and DiLoCo every 2 steps with outer lr 1 and no momentum. Both groups start from the
    same weights (same seed and layout); validation (same batch in both) after every step."""
    pytest.importorskip("torchft")
    helpers = _ft_helpers()
    root = tmp_path_factory.mktemp("semi")
    helpers._replica_groups(root / "local_sgd", *SEMI_STEPS, *LOCAL_SGD)
    helpers._replica_groups(root / "diloco", *SEMI_STEPS, *DILOCO_AS_AVERAGE)
    return {
        method: [
            helpers._records(root / method / f"ft-replica-{r}" / "metrics.jsonl") for r in (0, 1)
        ]
        for method in ("local_sgd", "diloco")
    }


@pytest.mark.slow
def test_local_sgd_groups_agree_right_after_each_sync(semi_sync_runs):
    first, second = semi_sync_runs["local_sgd"]
    validation = [first["validation/loss"], second["validation/loss"]]
    assert sorted(validation[0]) == [1, 2, 3, 4]
    # Weights averaged after steps 2 and 4 (bit for bit), trained apart after 1 and 3.
    assert [validation[0][s] == validation[1][s] for s in (1, 2, 3, 4)] == [
        False,
        True,
        False,
        True,
    ]
    # Training works: each group's loss falls, and the synced model improves.
    for group in (first, second):
        assert group["loss"][4] < group["loss"][1]
    assert validation[0][4] < validation[0][2]


@pytest.mark.slow
def test_diloco_with_outer_lr_1_and_no_momentum_is_local_sgd(semi_sync_runs):
    for local_sgd, diloco in zip(
        semi_sync_runs["local_sgd"], semi_sync_runs["diloco"], strict=True
    ):
        for key in ("loss", "validation/loss"):
            steps = sorted(local_sgd[key])
            assert [diloco[key][s] for s in steps] == pytest.approx(
                [local_sgd[key][s] for s in steps], rel=1e-6, abs=1e-6
            )
    first, second = semi_sync_runs["diloco"]
    assert first["validation/loss"][2] == pytest.approx(second["validation/loss"][2], abs=1e-6)


JOIN_STEPS = 120
REPLICA_0, REPLICA_1 = (["--fault_tolerance.replica_id", str(r)] for r in (0, 1))


@pytest.mark.slow
def test_a_group_that_joins_late_heals_at_the_next_sync(tmp_path):
    """Group 0 trains alone (``min_replica_size = 1``); group 1 starts once group 0 is past
    step 4 (as a killed group restarts): at its first sync it copies group 0's state (weights,
    optimizer, step) through torchft and from then on the two sync every 2 steps."""
    pytest.importorskip("torchft")
    import subprocess
    import time

    from torchft._torchft import LighthouseServer

    helpers = _ft_helpers()
    args = ["--job.dump_folder", str(tmp_path), *SEMI_STEPS, *LOCAL_SGD]
    args += ["--training.steps", str(JOIN_STEPS), "--metrics.log_freq", "1"]
    args += ["--fault_tolerance.enable", "--fault_tolerance.group_size", "2"]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    env = helpers._env(**{LIGHTHOUSE_ENV: lighthouse.address()})
    metrics = tmp_path / "ft-replica-0" / "metrics.jsonl"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    groups = [subprocess.Popen(helpers._command(*args, *REPLICA_0), **quiet)]
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 8):
            assert groups[0].poll() is None, "group 0 ended before group 1 could join"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        groups.append(subprocess.Popen(helpers._command(*args, *REPLICA_1), **quiet))
        assert [g.wait(timeout=240) for g in groups] == [0, 0]
    finally:
        for group in groups:
            if group.poll() is None:
                group.kill()
        lighthouse.shutdown()
    first, second = (
        helpers._records(tmp_path / f"ft-replica-{r}" / "metrics.jsonl") for r in (0, 1)
    )
    assert sorted(first["loss"]) == list(range(1, JOIN_STEPS + 1))
    joined = sorted(second["loss"])
    # Step 1 alone, then healed at its first sync: group 0's step, far past step 2.
    assert joined[0] == 1
    assert joined[1] > 4
    assert joined[-1] == JOIN_STEPS
    # From then on the same weights at every sync step.
    for step in (s for s in joined[1:] if s % 2 == 0):
        assert first["validation/loss"][step] == second["validation/loss"][step], step
