"""Layout-independent initialization: the same ``training.seed`` gives the same initial
weights, bit for bit, in one process and under FSDP, TP, PP, EP and their mixes, with no
seed checkpoint. Each layout is built through the trainer's own model path on real gloo
ranks (``workers/init_layouts.py``), its parameters and buffers gathered whole and compared
with ``torch.equal`` to the same build in this one process."""

import importlib.util
from pathlib import Path

import pytest
import torch

from titan_dims.testing import run_torchrun
from titan_models import init
from titan_train import World, preflight
from titan_train.trainer.build import _build_model

WORKER = Path(__file__).parent / "workers" / "init_layouts.py"


def _worker():
    spec = importlib.util.spec_from_file_location("titan_train_tests_init_layouts", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layouts = _worker()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """The worker's block size: shards start and end inside the generators' blocks."""
    monkeypatch.setattr(init, "BLOCK_VALUES", layouts.BLOCK_VALUES)


def one_process(model: str, tmp_path: Path, seed: int = layouts.SEED) -> dict[str, torch.Tensor]:
    """``model``'s debug model as one process builds it, parameters and buffers by name."""
    dump = str(tmp_path / f"{model}-{seed}")
    config = layouts.job_config(model, layouts.ONE_PROCESS, "none", dump)
    config.training.seed = seed
    plan = preflight(config, World(rank=0, world_size=1, device=torch.device("cpu")))
    _, parts, _ = _build_model(config, plan, layouts.VOCAB, False, layouts.cross_entropy_loss)
    return layouts.full_state(parts)


def check_layouts(tmp_path: Path, nproc: int, cases: list[str]) -> None:
    run_torchrun(WORKER, nproc, [str(tmp_path), *cases], timeout=600)
    references: dict[str, dict[str, torch.Tensor]] = {}
    for case in cases:
        model = layouts.CASES[case][0]
        if model not in references:
            references[model] = one_process(model, tmp_path)
        expected, got = references[model], torch.load(tmp_path / f"{case}.pt")
        assert got.keys() == expected.keys(), case
        differ = [name for name in expected if not torch.equal(got[name], expected[name])]
        assert not differ, f"{case}: {differ}"


@pytest.mark.slow
def test_two_rank_layouts_start_from_the_one_process_weights(tmp_path):
    # FSDP (with activation checkpointing's wrapper names), TP and PP for Llama 3; FSDP+EP
    # (the case), TP and PP for DeepSeek-V3; PP for Qwen3 (a tied embedding).
    cases = ["llama3-fsdp-ac", "llama3-tp", "llama3-pp", "deepseek_v3-fsdp-ep",
             "deepseek_v3-tp", "deepseek_v3-pp", "qwen3-pp"]  # fmt: skip
    check_layouts(tmp_path, 2, cases)


@pytest.mark.slow
def test_four_rank_mixes_start_from_the_one_process_weights(tmp_path):
    # FSDP x TP shards dim 0 twice (a strided shard); DeepSeek-V3 adds EP to that, and
    # pipeline stages sharded by FSDP and EP.
    cases = ["llama3-fsdp-tp", "deepseek_v3-fsdp-tp-ep", "deepseek_v3-pp-fsdp-ep"]
    check_layouts(tmp_path, 4, cases)


def test_another_seed_gives_other_weights(tmp_path):
    seven, eight = one_process("llama3", tmp_path), one_process("llama3", tmp_path, seed=8)
    for name, tensor in seven.items():
        drawn = "norm" not in name and name != "rope"  # norms start at one, RoPE is computed
        assert torch.equal(tensor, eight[name]) != drawn, name
